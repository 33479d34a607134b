"""A local cluster of worker processes on loopback (prefill, decode(s), an aggregated reference, the
proxy), and a client for it: what the demo runs and what the serving and fault tests drive.

Processes are `kvconnect` CLI children; `Cluster` is a context manager so they always stop. Faults are
injected with `signal`, `kill` and `restart` (same port, same engine id).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvconnect.harness.net import free_port, wait_stopped


@dataclass
class Cluster:
    """The demo's processes; use as a context manager so they always stop.

    Workers are named "prefill", each of `decodes` (default one, "decode") and "aggregated" (unless
    `aggregated=False`), plus "proxy" in front of the prefill and every decode worker. `extra_args` and
    `extra_env` add flags and environment per process name. Tests use `signal`, `kill` and `restart`
    (same port, same engine id) to inject faults, and `rss_bytes` to watch memory.
    """

    prefill_layout: str
    decode_layout: str
    device: str = "cpu"
    block_size: int = 16
    extra_args: dict[str, list[str]] = field(default_factory=dict)  # per process name
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    urls: dict[str, str] = field(default_factory=dict)
    log_dir: str | None = None
    extra_env: dict[str, dict[str, str]] = field(default_factory=dict)  # per process name
    decodes: tuple[str, ...] = ("decode",)
    aggregated: bool = True
    _cmds: dict[str, list[str]] = field(default_factory=dict)

    def env(self, name: str | None = None) -> dict[str, str]:
        env = dict(os.environ)
        if self.device == "cpu":  # loopback only: UCX over TCP + cma, on lo
            env.setdefault("UCX_TLS", "tcp,cma,sm,self")
            env.setdefault("UCX_NET_DEVICES", "lo")
        env.setdefault("NIXL_LOG_LEVEL", "WARN")
        env.update(self.extra_env.get(name or "", {}))
        return env

    def _spawn(self, name: str, args: list[str]) -> None:
        cmd = [sys.executable, "-m", "kvconnect.cli", "--log-level", "WARNING", *args, *self.extra_args.get(name, [])]
        self._cmds[name] = cmd
        self._start(name)

    def _start(self, name: str) -> None:
        if not self.log_dir:
            self.procs[name] = subprocess.Popen(
                self._cmds[name], env=self.env(name), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
            )
            return
        with open(os.path.join(self.log_dir, f"{name}.log"), "ab") as out:  # the child keeps its own copy
            self.procs[name] = subprocess.Popen(
                self._cmds[name], env=self.env(name), stdout=out, stderr=subprocess.STDOUT
            )

    def _worker(self, name: str, role: str, layout: str) -> None:
        port = free_port()
        self._spawn(
            name,
            [
                "serve",
                "--role",
                role,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--side-channel-host",
                "127.0.0.1",
                "--layout",
                layout,
                "--block-size",
                str(self.block_size),
                "--device",
                self.device,
                "--engine-id",
                f"demo-{name}",
            ],
        )
        self.urls[name] = f"http://127.0.0.1:{port}"

    def __enter__(self) -> Cluster:
        try:
            self._worker("prefill", "prefill", self.prefill_layout)
            for name in self.decodes:
                self._worker(name, "decode", self.decode_layout)
            if self.aggregated:
                self._worker("aggregated", "both", self.decode_layout)
            port = free_port()
            decode_args = [a for name in self.decodes for a in ("--decode", self.urls[name])]
            self._spawn(
                "proxy",
                ["proxy", "--host", "127.0.0.1", "--port", str(port), "--prefill", self.urls["prefill"], *decode_args],
            )
            self.urls["proxy"] = f"http://127.0.0.1:{port}"
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def pid(self, name: str) -> int:
        return self.procs[name].pid

    def signal(self, name: str, sig: int) -> None:
        """Send `sig`; a SIGSTOP returns once the process has really stopped (delivery is asynchronous)."""
        self.procs[name].send_signal(sig)
        if sig == signal.SIGSTOP:
            wait_stopped(self.procs[name].pid)

    def kill(self, name: str, timeout_s: float = 15.0) -> None:
        """SIGKILL one process and reap it."""
        proc = self.procs[name]
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout_s)

    def restart(self, name: str, timeout_s: float = 120.0) -> None:
        """Start a stopped (or killed) process again with the same command: same port, same engine id."""
        if self.procs[name].poll() is None:
            self.kill(name)
        self._start(name)
        self.wait_healthy(timeout_s, only=[name])

    def rss_bytes(self, name: str) -> int:
        """Resident memory of one process (VmRSS)."""
        with open(f"/proc/{self.pid(name)}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(f"no VmRSS for {name}")

    def wait_healthy(self, timeout_s: float = 180.0, only: list[str] | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        pending = {k: v for k, v in self.urls.items() if only is None or k in only}
        while pending:
            for name, proc in self.procs.items():
                if proc.poll() is not None and (only is None or name in only):
                    raise RuntimeError(f"a demo process exited early with status {proc.returncode} ({proc.args!r})")
            for name, url in list(pending.items()):
                try:
                    if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                        del pending[name]
                except httpx.HTTPError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"not healthy within {timeout_s}s: {sorted(pending)}")
            time.sleep(0.1)

    def health(self, name: str) -> dict[str, Any]:
        return httpx.get(self.urls[name] + "/health", timeout=5).json()  # type: ignore[no-any-return]

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)  # a stopped process would not act on SIGTERM
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(60)  # (a SIGKILLed process is reaped at once unless the machine is overloaded)
        self.procs.clear()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def complete(
    url: str, prompt: str, max_tokens: int, stream: bool = False, chat: bool = False, timeout_s: float = 120.0
) -> dict[str, Any]:
    """One request; returns {"token_ids", "text", "transfer", "status"} (streamed answers reassembled)."""
    body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0, "return_token_ids": True, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if not stream:
        r = httpx.post(url + path, json=body, timeout=timeout_s)
        data = r.json()
        if r.status_code != 200:
            return {"status": r.status_code, "error": data.get("error", {}).get("message"), "token_ids": None}
        choice = data["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        return {
            "status": 200,
            "token_ids": choice["token_ids"],
            "text": text,
            "transfer": data.get("kvconnect_transfer"),
        }
    ids: list[int] = []
    text = ""
    with httpx.stream("POST", url + path, json=body, timeout=timeout_s) as r:
        if r.status_code != 200:
            r.read()
            return {"status": r.status_code, "error": r.text, "token_ids": None}
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"status": 502, "error": chunk["error"]["message"], "token_ids": None}
            choice = chunk["choices"][0]
            ids.extend(choice.get("token_ids", []))
            text += choice["delta"].get("content", "") if chat else choice["text"]
    return {"status": 200, "token_ids": ids, "text": text, "transfer": None}

"""`kvconnect demo`: a local prefill worker, decode worker and proxy, checked against an aggregated worker.

Starts four processes on loopback (prefill, decode, a `both` worker as the reference, the proxy), sends
prompts of varied lengths through the proxy (some streamed, all concurrently), sends the same prompts to
the reference worker, and prints each completion with its transfer stats. It exits non-zero unless every
disaggregated completion equals the aggregated one token for token, and it always shuts everything down.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvconnect.core.errors import KVConnectError
from kvconnect.core.layout import LayoutKind

PROMPTS = [
    "Hi",
    "The quick brown fox jumps over the lazy dog.",
    "Disaggregated serving splits prefill and decode across two workers; the KV cache moves between them.",
    "abcdefghijklmno",  # exactly 15 bytes + BOS = one 16-token block
    "Once upon a time, " * 12,
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "NIXL pulls blocks with one READ per request.",
    "Z",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_stopped(pid: int, timeout_s: float = 10.0) -> None:
    """Poll /proc until every thread of `pid` is stopped (state T); KVConnectError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            states = []
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
        except OSError:  # no /proc, or the process is gone: nothing to wait for
            return
        if all(state in ("T", "t") for state in states):
            return
        if time.monotonic() >= deadline:
            raise KVConnectError(f"process {pid} did not stop within {timeout_s}s (thread states {states})")
        time.sleep(0.002)


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
        cmd = [sys.executable, "-m", "kvconnect.cli", "--log-level", "WARNING", *args,
               *self.extra_args.get(name, [])]
        self._cmds[name] = cmd
        self._start(name)

    def _start(self, name: str) -> None:
        if not self.log_dir:
            self.procs[name] = subprocess.Popen(self._cmds[name], env=self.env(name),
                                                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
            return
        with open(os.path.join(self.log_dir, f"{name}.log"), "ab") as out:  # the child keeps its own copy
            self.procs[name] = subprocess.Popen(self._cmds[name], env=self.env(name), stdout=out,
                                                stderr=subprocess.STDOUT)

    def _worker(self, name: str, role: str, layout: str) -> None:
        port = free_port()
        self._spawn(name, ["serve", "--role", role, "--host", "127.0.0.1", "--port", str(port),
                           "--side-channel-host", "127.0.0.1", "--layout", layout, "--block-size",
                           str(self.block_size), "--device", self.device, "--engine-id", f"demo-{name}"])
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
            self._spawn("proxy", ["proxy", "--host", "127.0.0.1", "--port", str(port), "--prefill",
                                  self.urls["prefill"], *decode_args])
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
                    raise RuntimeError(f"a demo process exited early with status {proc.returncode} "
                                       f"({proc.args!r})")
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
                proc.wait(5)
        self.procs.clear()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def complete(url: str, prompt: str, max_tokens: int, stream: bool = False, chat: bool = False,
             timeout_s: float = 120.0) -> dict[str, Any]:
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
        return {"status": 200, "token_ids": choice["token_ids"], "text": text,
                "transfer": data.get("kvconnect_transfer")}
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


def run_checks(cluster: Cluster, prompts: list[str], max_tokens: int, concurrency: int = 8) -> list[dict[str, Any]]:
    """Send every prompt through the proxy and to the reference; return one result row per prompt."""
    def one(i: int, prompt: str) -> dict[str, Any]:
        stream, chat = i % 3 == 1, i % 4 == 3
        disagg = complete(cluster.urls["proxy"], prompt, max_tokens, stream=stream, chat=chat)
        agg = complete(cluster.urls["aggregated"], prompt, max_tokens, chat=chat)
        return {"prompt": prompt, "stream": stream, "chat": chat, "disagg": disagg, "agg": agg,
                "equal": disagg["token_ids"] is not None and disagg["token_ids"] == agg["token_ids"]}

    with cf.ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda a: one(*a), enumerate(prompts)))


def _fmt(row: dict[str, Any]) -> str:
    t = row["disagg"].get("transfer")
    stats = "(streamed; stats in /metrics)" if row["stream"] else "(nothing to transfer)"
    if t:
        gbps = t["bytes"] / max(t["post_s"] + t["transfer_s"], 1e-9) / 1e9
        stats = (f"{t['bytes'] / 1024:.0f} KiB, {t['num_blocks']} blocks, {t['num_descs_merged']}/{t['num_descs']} "
                 f"descs, {t['total_s'] * 1e3:.1f} ms, {gbps:.2f} GB/s")
    mark = "OK " if row["equal"] else "MISMATCH"
    text = (row["disagg"].get("text") or row["disagg"].get("error") or "").replace("\n", "\\n")[:48]
    return f"[{mark}] {row['prompt'][:32]!r:36} -> {text!r:52} {stats}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layout", choices=[k.value for k in LayoutKind], default="cross_layer",
                   help="prefill worker layout")
    p.add_argument("--decode-layout", choices=[k.value for k in LayoutKind], default=None,
                   help="decode and reference worker layout (default: same as --layout)")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--json", action="store_true", help="print a machine-readable summary instead")


def run(args: argparse.Namespace) -> int:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    decode_layout = args.decode_layout or args.layout
    logging.getLogger("httpx").setLevel(logging.WARNING)
    t0 = time.monotonic()
    with Cluster(args.layout, decode_layout, device) as cluster:
        startup_s = time.monotonic() - t0
        rows = run_checks(cluster, PROMPTS, args.max_tokens)
        prefill, decode = cluster.health("prefill"), cluster.health("decode")
    ok = all(r["equal"] for r in rows)
    summary = {
        "disagg_equals_agg": ok,
        "num_prompts": len(rows),
        "num_equal": sum(r["equal"] for r in rows),
        "layouts": {"prefill": args.layout, "decode": decode_layout},
        "device": device,
        "startup_s": round(startup_s, 2),
        "prefill_leased_blocks_after": prefill["leased_blocks"],
        "decode_free_blocks_after": decode["free_blocks"],
        "results": rows,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"kvconnect demo: prefill({args.layout}) -> decode({decode_layout}) on {device}, "
              f"proxy {cluster.urls['proxy']}, started in {startup_s:.1f}s")
        print("(the demo model has seeded random weights: its text is noise; what matters is that every "
              "disaggregated completion equals the aggregated one token for token)")
        for row in rows:
            print(_fmt(row))
        print(f"disaggregated == aggregated: {ok} ({summary['num_equal']}/{len(rows)}); "
              f"prefill leased blocks after: {prefill['leased_blocks']}")
    return 0 if ok else 1

"""Two hosts on one machine: network namespaces joined by a veth pair, and vLLM servers started inside them.

`Hosts` makes the pair ("prefill" and "decode", 10.78.0.1 and 10.78.0.2 on the veth), gives each a thread pool
whose threads live inside it, and can cut and restore the link; `NetnsCluster` is a `VllmCluster` whose
processes (servers and proxies) run in the namespace `where` names for them. Each server's HTTP listens on its
namespace's loopback unless `listen` gives it an address (e.g. its veth address, so that a proxy on the other
host reaches it). Needs root and iproute2 (`netns_unavailable` says why not). The failure table
(tests/test_vllm_failures.py) and `benchmarks/vllm_serve_netns.py` use it.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from kvconnect.harness.vllm_cluster import Server, VllmCluster

T = TypeVar("T")

NS_PREFIX = "kvft-"
CLONE_NEWNET = 0x40000000


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({out.returncode}): {out.stderr.strip()}")
    return out


def netns_unavailable() -> str | None:
    """Why network namespaces cannot be made here (None: they can)."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    return None


def delete_stale_namespaces(prefix: str = NS_PREFIX) -> None:
    """Delete the namespaces named `<prefix><pid>-...` whose creating process is gone (a run that was killed)."""
    for name in ip("netns", "list", check=False).stdout.split():
        if name.startswith(prefix):
            pid = name[len(prefix) :].split("-", 1)[0]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                ip("netns", "del", name, check=False)


def enter_netns(name: str) -> None:
    """Move the calling thread (only it) into network namespace `name`."""
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({name}): {os.strerror(err)}")
    finally:
        os.close(fd)


@dataclass
class Hosts:
    """Two namespaces, "prefill" and "decode", joined by a veth pair; a thread pool inside each."""

    prefill_ns: str
    decode_ns: str
    prefill_dev: str
    decode_dev: str
    prefill_addr: str = "10.78.0.1"
    decode_addr: str = "10.78.0.2"
    pools: dict[str, cf.ThreadPoolExecutor] = field(default_factory=dict)

    @classmethod
    def make(cls) -> Hosts:
        delete_stale_namespaces()
        token = secrets.token_hex(3)
        base = f"{NS_PREFIX}{os.getpid()}-{token}"
        h = cls(f"{base}-p", f"{base}-d", f"kfp{token}", f"kfd{token}")
        made = []
        try:
            for ns in (h.prefill_ns, h.decode_ns):
                ip("netns", "add", ns)
                made.append(ns)
            ip("link", "add", h.prefill_dev, "netns", h.prefill_ns, "type", "veth", "peer", "name", h.decode_dev)
            ip("link", "set", h.decode_dev, "netns", h.decode_ns)
            for ns, dev, addr in (
                (h.prefill_ns, h.prefill_dev, h.prefill_addr),
                (h.decode_ns, h.decode_dev, h.decode_addr),
            ):
                ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                ip("-n", ns, "link", "set", "lo", "up")
                ip("-n", ns, "link", "set", dev, "up")
            for ns in (h.prefill_ns, h.decode_ns):
                h.pools[ns] = cf.ThreadPoolExecutor(16, thread_name_prefix=ns, initializer=enter_netns, initargs=(ns,))
        except BaseException:
            for ns in made:
                ip("netns", "del", ns, check=False)
            raise
        return h

    def cut(self) -> None:
        ip("-n", self.prefill_ns, "link", "set", "dev", self.prefill_dev, "down")

    def restore(self) -> None:
        ip("-n", self.prefill_ns, "link", "set", "dev", self.prefill_dev, "up")

    def call(self, ns: str, fn: Callable[..., T], *args: Any, **kw: Any) -> cf.Future[T]:
        return self.pools[ns].submit(fn, *args, **kw)

    def remove(self) -> None:
        for pool in self.pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        for ns in (self.prefill_ns, self.decode_ns):  # (deleting a namespace destroys its veth end, and the pair)
            ip("netns", "del", ns, check=False)


class NetnsCluster(VllmCluster):
    """A VllmCluster whose processes run in the namespaces `where` names (process name -> namespace; a proxy
    too, once named there); a server's HTTP is on its namespace's loopback, or on the address `listen` gives it
    (server name -> address), reached from a thread inside a namespace."""

    def __init__(
        self, *args: Any, hosts: Hosts, where: dict[str, str], listen: dict[str, str] | None = None, **kw: Any
    ) -> None:
        super().__init__(*args, **kw)
        self.hosts = hosts
        self.where = where
        self.listen = listen or {}

    def _command(self, server: Server, port: int) -> list[str]:
        cmd = super()._command(server, port)
        addr = self.listen.get(server.name)
        if addr:  # (argparse keeps the last --host)
            cmd += ["--host", addr]
            self.urls[server.name] = f"http://{addr}:{port}"
        return cmd

    def _spawn(self, name: str) -> None:
        ns = self.where.get(name)
        if ns is None:
            super()._spawn(name)
            return
        cmd, env = self._cmds[name]
        self._cmds[name] = (["ip", "netns", "exec", ns, *cmd], env)
        try:
            super()._spawn(name)
        finally:
            self._cmds[name] = (cmd, env)

    def call(self, name: str, fn: Callable[..., T], *args: Any, **kw: Any) -> cf.Future[T]:
        """fn(*args) on a thread in the namespace of process `name`."""
        return self.hosts.call(self.where[name], fn, *args, **kw)

    def wait_healthy(self, names: list[str], timeout_s: float = 420.0) -> None:
        def healthy(url: str) -> bool:
            try:
                return httpx.get(url + "/health", timeout=2.0).status_code == 200
            except httpx.HTTPError:
                return False

        deadline = time.monotonic() + timeout_s
        pending = set(names)
        while pending:
            for name in sorted(pending):
                if self.procs[name].poll() is not None:
                    raise RuntimeError(f"{name} exited while starting:\n{self.log_tail(name)}")
                if self.call(name, healthy, self.urls[name]).result(10):
                    pending.discard(name)
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"not healthy within {timeout_s:.0f}s: {sorted(pending)}")
            time.sleep(0.25)

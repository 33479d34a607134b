"""Ports, polling and process helpers shared by the tests, the demo and the benchmark.

Everything here waits by polling with a deadline, never by sleeping a fixed time.
"""

from __future__ import annotations

import os
import random
import socket
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kvconnect.core.errors import KVConnectError

T = TypeVar("T")


LOW_PORT = 10000  # the pool starts here, and ends where the kernel's ephemeral range begins


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now, below the kernel's ephemeral range where possible: a port the
    kernel hands out for `bind(0)` or an outgoing connection can be taken by any process (a NIXL agent,
    an HTTP client) between this call and the server's bind; a port below that range only by another
    caller of this function, which picks at random."""
    top = _ephemeral_start()
    if top - LOW_PORT >= 1000:
        for port in random.sample(range(LOW_PORT, top), 64):
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_port_run(count: int, host: str = "127.0.0.1") -> int:
    """A base port with `count` consecutive ports free on `host` (TP rank r listens on base + r)."""
    for _ in range(50):
        base = free_port(host)
        if base + count > 65536:
            continue
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                socks.append(socket.socket())
                socks[-1].bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise KVConnectError(f"no {count} consecutive free ports on {host}")


def poll_until(
    predicate: Callable[[], T], timeout_s: float = 15.0, what: str = "condition", interval_s: float = 0.02
) -> T:
    """The first truthy value of `predicate()`; AssertionError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"{what} not reached within {timeout_s}s (last: {last!r})")


def wait_stopped(pid: int, timeout_s: float = 10.0) -> None:
    """Poll /proc until every thread of `pid` is stopped (state T); KVConnectError after `timeout_s`.
    (SIGSTOP is delivered asynchronously: a thread may still run for a moment after `kill` returns.)"""
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

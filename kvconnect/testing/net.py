"""Ports, polling and process helpers shared by the tests, the demo and the benchmark.

Everything here waits by polling with a deadline, never by sleeping a fixed time.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kvconnect.core.errors import KVConnectError

T = TypeVar("T")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now."""
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


def poll_until(predicate: Callable[[], T], timeout_s: float = 15.0, what: str = "condition",
               interval_s: float = 0.02) -> T:
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

"""The threads a connector starts run off the cores its creator was pinned to (real NIXL and ZMQ).

vLLM pins each CPU worker's thread to its compute cores and builds the connector on it. Threads inherit
their creator's mask, so UCX's event thread and ZMQ's I/O thread (every side-channel message passes
through it) shared the pinned core with the engine's spinning loops."""

from __future__ import annotations

import os
import threading
import time

import pytest

from kvconnect.core.cache import KVCache
from kvconnect.core.connector import KVConnector
from kvconnect.core.plan.layout import CacheSpec, LayoutKind
from tests.helpers import config_for_tests

SPEC = CacheSpec(
    kind=LayoutKind.BLOCKS_FIRST,
    num_blocks=8,
    dtype="float16",
    num_layers=2,
    block_size=16,
    num_kv_heads=2,
    head_dim=32,
)


def threads() -> dict[int, tuple[str, frozenset[int]]]:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                out[int(tid)] = (f.read().strip(), frozenset(os.sched_getaffinity(int(tid))))
        except (OSError, ProcessLookupError):  # (a thread that ended meanwhile)
            pass
    return out


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs Linux and two CPUs"
)
def test_threads_the_connector_starts_leave_the_core_its_creator_was_pinned_to() -> None:
    allowed = frozenset(os.sched_getaffinity(0))
    pin = frozenset({min(allowed)})
    seen: dict[str, object] = {}

    def engine_thread() -> None:  # as vLLM's worker: pinned, then it builds the connector
        os.sched_setaffinity(0, pin)
        before = threads()
        conn = KVConnector(KVCache.allocate(SPEC), config_for_tests())
        try:
            # A thread names itself once it runs: a new ZMQ I/O thread reads "python" for a moment.
            deadline = time.monotonic() + 10
            while True:
                seen["new"] = new = {tid: v for tid, v in threads().items() if tid not in before}
                if any(name.startswith("ZMQbg/IO") for name, _ in new.values()) or time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            seen["own"] = frozenset(os.sched_getaffinity(0))
        finally:
            conn.close()

    t = threading.Thread(target=engine_thread)
    t.start()
    t.join(60)
    new = seen["new"]
    assert isinstance(new, dict) and any(name.startswith("ZMQbg/IO") for name, _ in new.values()), new
    assert {name: cpus for name, cpus in new.values() if cpus != allowed} == {}
    assert seen["own"] == pin  # the engine's own thread keeps its pin

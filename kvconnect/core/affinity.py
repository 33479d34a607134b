"""Which CPUs the connector's threads run on (Linux scheduler affinity).

An engine may pin the thread that builds the connector to its compute cores (vLLM pins each CPU worker to
its cores). A thread inherits its creator's mask when it starts, so the I/O threads that NIXL's UCX (its
`async` event thread) and ZMQ (its `ZMQbg/IO` thread, which carries every side-channel message) start
while the connector is built would share that engine's spinning cores. Those threads are started inside
`threads_started_on`, and the connector's own loop thread moves itself with `place_current_thread`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

log = logging.getLogger(__name__)


def io_cpus(wanted: frozenset[int] | None) -> frozenset[int]:
    """`wanted` (the `loop_cpus` setting), or every CPU (the kernel keeps a mask inside the cpuset)."""
    return wanted or frozenset(range(os.cpu_count() or 1))


def place_current_thread(cpus: frozenset[int], what: str) -> bool:
    """Run the calling thread on `cpus`; warns and returns False where that cannot be done."""
    try:
        os.sched_setaffinity(0, cpus)
        return True
    except (OSError, AttributeError) as e:  # (no CPU of the list is allowed here; or not Linux)
        log.warning(
            "%s stays on CPUs %s: cannot move it to %s: %s",
            what,
            sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?",
            sorted(cpus),
            e,
        )
        return False


@contextlib.contextmanager
def threads_started_on(cpus: frozenset[int]) -> Iterator[None]:
    """Threads started inside run on `cpus`; the calling thread gets its own mask back afterwards."""
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    moved = before is not None and before != cpus and place_current_thread(cpus, "the connector's I/O threads")
    try:
        yield
    finally:
        if moved and before is not None:
            os.sched_setaffinity(0, before)

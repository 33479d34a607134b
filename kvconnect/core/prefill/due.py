"""When the lease table must look at a lease next: a heap of due times, so that `expire` (run at every connector
tick, the engine's included) looks only at leases with something due, never at a minute's thousand tombstones.
"""

from __future__ import annotations

import heapq

from kvconnect.core.prefill.lease import Lease
from kvconnect.core.wire.protocol import LeaseState


def next_due(lease: Lease, tombstone_s: float, now_s: float) -> float:
    """When `lease` is due: a held lease at its TTL, or at its first pin's deadline while pinned (a TTL that ran
    out under a pin matters only once the pins go: their deadlines, or the unpin, which reschedules); an ended
    one still pinned at that deadline; else when its tombstone goes."""
    if lease.pins:
        first_pin = min(lease.pins.values())
        held = lease.state is LeaseState.HELD and lease.expires_s > now_s
        return min(first_pin, lease.expires_s) if held else first_pin
    if lease.state is LeaseState.HELD:
        return lease.expires_s
    return lease.ended_s + tombstone_s


class DueTimes:
    """Lease ids by when something of theirs is due, a heap. One lease may have several entries (each change adds
    one): an entry that finds nothing to do is harmless, the table reschedules the lease after looking."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, str]] = []

    def push(self, lease: Lease, tombstone_s: float, now_s: float) -> None:
        heapq.heappush(self._heap, (next_due(lease, tombstone_s, now_s), lease.lease_id))

    def pop_due(self, now_s: float) -> list[str]:
        """The ids with an entry due by `now_s`, each once, in due order (their entries removed)."""
        due: dict[str, None] = {}
        while self._heap and self._heap[0][0] <= now_s:
            due[heapq.heappop(self._heap)[1]] = None
        return list(due)

"""Fault injection, kept off the production surface: a `FaultHooks` object exists on a connector only when
whoever built it asked for one (kvconnect's workers with KVCONNECT_FAULT_INJECTION=1, the test harness).
Without it the connector has no way to pause its loop or expire leases on purpose, and its loop takes no
extra lock.

- `hold_loop()`: the connector's loop thread makes no tick while this is held (the side channel is not
  served either); only `KVConnector.drive` moves work;
- `expire_next_reads(n)`: the next n reads of a held lease to finish, or to be pinned (whichever reaches
  the prefill first), find it expired, as if its TTL had run out mid-read;
- `expire_lease(lease_id, scrub)`: end one lease now, EXPIRED; `scrub(block_ids)` may overwrite its blocks
  after it ended and before they go back (as reuse by another request would).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from kvconnect.core.wire.protocol import LeaseState

ForceExpire = Callable[[str, Callable[[list[int]], None] | None], LeaseState]


class FaultHooks:
    def __init__(self) -> None:
        self.gate = threading.Lock()  # held by `hold_loop`: the loop thread waits at it before each tick
        self._lock = threading.Lock()
        self._expire_reads = 0
        self._force_expire: ForceExpire | None = None

    def bind(self, force_expire: ForceExpire) -> None:
        """(The connector, at construction: how to expire one of its leases.)"""
        self._force_expire = force_expire

    @contextlib.contextmanager
    def hold_loop(self) -> Iterator[None]:
        with self.gate:
            yield

    def expire_next_reads(self, count: int) -> None:
        with self._lock:
            self._expire_reads = max(0, int(count))

    def take_read_expiry(self) -> bool:
        """Whether the read finishing now is one of those to fail (the lease table asks, once per read)."""
        with self._lock:
            if self._expire_reads <= 0:
                return False
            self._expire_reads -= 1
            return True

    def expire_lease(self, lease_id: str, scrub: Callable[[list[int]], None] | None = None) -> LeaseState:
        if self._force_expire is None:
            raise RuntimeError("these fault hooks belong to no connector")
        return self._force_expire(lease_id, scrub)

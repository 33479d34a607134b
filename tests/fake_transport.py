"""A fake in-memory transport behind kvconnect's `Transport` interface, driven by the test.

Both connectors live in the test's process (their side channels, handshakes and lease tables are real);
only the data path is replaced: a pull's blocks are copied from the prefill's cache to the decode's when
the test lets its transfer end. `Wire` is the test's hand on every transfer posted through it:

- `hold`: transfers stay in flight (PROC) until `land()`; a held transfer that the decode abandons at its
  deadline still copies when it lands, as a NIXL READ that cannot be cancelled would;
- `fail`: the next transfers end in ERR; `gone`: polling them raises PeerGoneError (the peer's connection
  went away mid-transfer).

So deadlines, quarantine, peer loss, pins and confirmations, lease tokens and incarnations run through the
decode state machine in milliseconds; tests/test_pull.py keeps doing the same over real NIXL.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvconnect.core.agent import XferState
from kvconnect.core.cache import KVCache
from kvconnect.core.errors import PeerGoneError
from kvconnect.core.plan.descriptors import PairPlan, PullPlan
from kvconnect.core.plan.hetero import SourcePlan
from kvconnect.core.transports.base import Posted, Transport, TransportKind
from kvconnect.core.wire import protocol as p


def copy_blocks(dst: KVCache, dst_ids: np.ndarray, src: KVCache, src_ids: np.ndarray) -> None:
    """What a READ of these block pairs leaves in `dst` (layouts may differ: K/V views per layer)."""
    for layer in range(src.spec.num_layers):
        for d_view, s_view in zip(dst.kv(layer), src.kv(layer), strict=True):
            for d, s in zip(dst_ids.tolist(), src_ids.tolist(), strict=True):
                d_view[d].copy_(s_view[s])


@dataclass
class Wire:
    """The test's controls over every transfer of the transports it made."""

    caches: dict[str, KVCache] = field(default_factory=dict)  # prefill agent name -> its cache
    hold: bool = False
    fail: int = 0  # the next `fail` transfers end in ERR
    gone: bool = False
    posted: list[FakePosted] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def serve(self, prefill_agent_name: str, cache: KVCache) -> None:
        self.caches[prefill_agent_name] = cache

    def land(self) -> None:
        """Let every held transfer end (copying its blocks)."""
        with self.lock:
            self.hold = False

    def path(self) -> type[Transport]:
        """The fake as a fast path (`KVConnector(fast_paths=...)`) for a decode connector: it opens to any peer
        that offers it (a prefill built with `fast_paths=(FakeTransport,)`) whose cache this wire serves."""
        wire = self

        class OnThisWire(FakeTransport):
            @classmethod
            def open(cls, offer: bytes, info: p.PeerInfo, plan: SourcePlan, cache: KVCache) -> Transport:
                return FakeTransport(wire, cache, wire.caches[info.agent_name], plan.pair)

        return OnThisWire


class FakePosted(Posted):
    abandonable = True

    def __init__(self, wire: Wire, copy: Callable[[], None], fails: bool) -> None:
        self._wire = wire
        self._copy = copy
        self._fails = fails
        self.copied = False

    def state(self) -> XferState:
        with self._wire.lock:
            if self._wire.gone:
                raise PeerGoneError("fake transport: the peer's connection went away")
            if self._fails:
                return XferState.ERR
            if self._wire.hold:
                return XferState.PROC
        if not self.copied:
            self._copy()
            self.copied = True
        return XferState.DONE

    def release(self) -> None:
        pass


class FakeTransport(Transport):
    kind = TransportKind.MEMORY
    notifies = False  # (the prefill learns of a read only from the decode's confirmation)

    @classmethod
    def offer(cls, cache: KVCache) -> bytes:
        return b"in-process"  # (what a prefill built with this path offers; `Wire.path` opens it)

    def __init__(self, wire: Wire, local: KVCache, remote: KVCache, pair: PairPlan) -> None:
        self._wire, self._local, self._remote, self._pair = wire, local, remote, pair

    def order(self, local_ids: np.ndarray, remote_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self._pair.order_checked(local_ids, remote_ids)

    def post(
        self, local_ids: np.ndarray, remote_ids: np.ndarray, num_tokens: int | None, notif: bytes
    ) -> tuple[Posted, XferState, PullPlan]:
        plan = self._pair.plan_validated(local_ids, remote_ids, num_tokens)
        with self._wire.lock:
            fails = self._wire.fail > 0
            self._wire.fail -= int(fails)
        local, remote = np.array(local_ids), np.array(remote_ids)
        posted = FakePosted(self._wire, lambda: copy_blocks(self._local, local, self._remote, remote), fails)
        self._wire.posted.append(posted)
        return posted, posted.state(), plan

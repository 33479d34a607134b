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
from dataclasses import dataclass, field

import numpy as np

from kvconnect.core.agent import NixlAgent, XferState
from kvconnect.core.cache import KVCache
from kvconnect.core.errors import PeerGoneError, TransportUnavailableError
from kvconnect.core.plan.descriptors import PairPlan, PullPlan
from kvconnect.core.plan.hetero import SourcePlan
from kvconnect.core.transports.base import Link, Move, Transport
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
    posted: list[FakeMove] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def serve(self, prefill_agent_name: str, cache: KVCache) -> None:
        self.caches[prefill_agent_name] = cache

    def land(self) -> None:
        """Let every held transfer end (copying its blocks)."""
        with self.lock:
            self.hold = False

    def path(self) -> type[Transport]:
        """The fake as a transport (`KVConnector(transports=...)`) for a decode connector: it opens to any peer
        that offers it (a prefill built with `transports=(FakeTransport,)`) whose cache this wire serves."""
        wire = self

        class OnThisWire(FakeTransport):
            def open(self, offer: bytes, info: p.PeerInfo, plan: SourcePlan) -> Link:
                if not offer:
                    raise TransportUnavailableError("not offered by the peer")
                assert self.cache is not None
                return FakeLink(wire, self.cache, wire.caches[info.agent_name], plan.pair)

        return OnThisWire


class FakeMove(Move):
    abandonable = True

    def __init__(
        self, wire: Wire, local: KVCache, remote: KVCache, pair: PairPlan, ids: tuple[np.ndarray, ...]
    ) -> None:
        self._wire, self._local, self._remote, self._pair = wire, local, remote, pair
        self.local_ids, self.remote_ids, self._num_tokens = ids[0], ids[1], None
        self._fails = False
        self.copied = False

    def post(self, notif: bytes) -> tuple[XferState, PullPlan]:
        plan = self._pair.plan_validated(self.local_ids, self.remote_ids, self._num_tokens)
        with self._wire.lock:
            self._fails = self._wire.fail > 0
            self._wire.fail -= int(self._fails)
        self._wire.posted.append(self)
        return self.state(), plan

    def state(self) -> XferState:
        with self._wire.lock:
            if self._wire.gone:
                raise PeerGoneError("fake transport: the peer's connection went away")
            if self._fails:
                return XferState.ERR
            if self._wire.hold:
                return XferState.PROC
        if not self.copied:
            copy_blocks(self._local, np.array(self.local_ids), self._remote, np.array(self.remote_ids))
            self.copied = True
        return XferState.DONE


class FakeLink(Link):
    def __init__(self, wire: Wire, local: KVCache, remote: KVCache, pair: PairPlan) -> None:
        self._wire, self._local, self._remote, self._pair = wire, local, remote, pair

    def prepare(
        self,
        local_ids: np.ndarray,
        remote_ids: np.ndarray,
        num_tokens: int | None,
        remote_offset: int = 0,
        state_ids: np.ndarray | None = None,
    ) -> Move | None:
        assert remote_offset == 0 and state_ids is None, "the fake transport copies whole blocks"
        ordered = self._pair.order_checked(local_ids, remote_ids)
        move = FakeMove(self._wire, self._local, self._remote, self._pair, ordered)
        move._num_tokens = num_tokens
        return move


class FakeTransport(Transport):
    kind = "memory"
    notifies = False  # (the prefill learns of a read only from the decode's confirmation)

    def __init__(self) -> None:
        self.cache: KVCache | None = None

    def start(self, cache: KVCache, agent: NixlAgent) -> bytes:
        self.cache = cache
        return b"in-process"  # (what a prefill built with this transport offers; `Wire.path` opens it)

    def open(self, offer: bytes, info: p.PeerInfo, plan: SourcePlan) -> Link:
        raise TransportUnavailableError("a prefill's fake: only a wire's (`Wire.path`) opens")

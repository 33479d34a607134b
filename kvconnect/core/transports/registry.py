"""Which transports a connector may take: NIXL's READ always, the fast paths where allowed and able.

`FAST_PATHS` lists the paths tried before NIXL, in order of preference; adding a transport is a module in
this folder and one entry here (and a `TransportChoice` value if users should be able to require it).
`FastPaths.start` runs every allowed path's start-up half on the calling thread, which is the thread that
builds the connector (`transports/base.py` says why); `FastPaths.open` is the decode's handshake step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvconnect.core.cache import KVCache
from kvconnect.core.config import TransportChoice
from kvconnect.core.errors import TransportUnavailableError
from kvconnect.core.plan.hetero import SourcePlan
from kvconnect.core.transports.base import Transport
from kvconnect.core.transports.ipc_gather import IpcTransport
from kvconnect.core.wire.protocol import PeerInfo

log = logging.getLogger(__name__)

FAST_PATHS: tuple[type[Transport], ...] = (IpcTransport,)


@dataclass
class FastPaths:
    """The fast paths one connector may take, what it offers its peers, and why any cannot run here."""

    allowed: tuple[type[Transport], ...]
    required: bool  # the configuration names one fast path: a peer it cannot serve is refused, not read over NIXL
    problems: dict[str, str] = field(default_factory=dict)  # kind -> why it cannot run in this process
    offers: dict[str, bytes] = field(default_factory=dict)  # kind -> what peers need to open it to us

    @classmethod
    def start(
        cls, cache: KVCache, choice: TransportChoice, candidates: Sequence[type[Transport]] = FAST_PATHS
    ) -> FastPaths:
        """Warm up and offer every path `choice` allows that applies to `cache` (on the calling thread)."""
        if choice is TransportChoice.NIXL:
            return cls((), False)
        allowed = tuple(
            t
            for t in candidates
            if (choice is TransportChoice.AUTO or t.kind.value == choice.value) and t.applies(cache)
        )
        paths = cls(allowed, choice is not TransportChoice.AUTO)
        for t in allowed:
            t0 = time.monotonic()
            try:
                t.warm_up(cache)
                offer = t.offer(cache)
            except TransportUnavailableError as e:
                paths.problems[t.kind.value] = str(e)
                log.warning("%s transport unavailable here (%s); peers will use NIXL", t.kind.value, e)
                continue
            log.info(
                "%s transport ready (start-up %.0f ms, on the building thread)",
                t.kind.value,
                1e3 * (time.monotonic() - t0),
            )
            if offer:
                paths.offers[t.kind.value] = offer
        return paths

    def open(self, info: PeerInfo, plan: SourcePlan, cache: KVCache, peer: str) -> Transport | None:
        """The first allowed path that the peer offers and that opens for `plan`; None: read over NIXL.
        TransportUnavailableError when the configuration requires a path that cannot serve this peer."""
        why = []
        for t in self.allowed:
            kind = t.kind.value
            if kind in self.problems:
                why.append(f"{kind}: unavailable here ({self.problems[kind]})")
                continue
            offer = info.offers.get(kind)
            if offer is None:
                why.append(f"{kind}: not offered by the peer")
                continue
            try:
                return t.open(offer, info, plan, cache)
            except TransportUnavailableError as e:
                why.append(f"{kind}: {e}")
        if why:
            if self.required:
                raise TransportUnavailableError(
                    f"peer {peer}: the required transport cannot serve it: {'; '.join(why)}"
                )
            log.info("peer %s: using NIXL (%s)", peer, "; ".join(why))
        return None

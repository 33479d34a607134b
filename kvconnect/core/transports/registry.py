"""Which transports a connector takes, in which order, and why any of them cannot run here.

`TRANSPORTS` lists them in order of preference; NIXL's READ is always last and always started, because its
prefill half (the cache registered with NIXL) is what any peer can read, and its decode half is the path every
peer can take. Adding a transport is a module in this folder and one entry here (and a `TransportChoice` value
if users should be able to require it). `Transports.start` runs every allowed transport's `start` on the
calling thread, the one that builds the connector (`base.py` says why); `Transports.open` is a decode's
handshake step.

The configuration (`transport`): `auto` opens the first transport that can serve a peer, NIXL otherwise;
`nixl` starts NIXL alone; a named other transport (`ipc`) is required: a peer it cannot serve is refused, not
read over NIXL (NIXL's prefill half still runs, so peers that read over NIXL can still read from this
connector).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvconnect.core.agent import NixlAgent
from kvconnect.core.cache import KVCache
from kvconnect.core.config import TransportChoice
from kvconnect.core.errors import TransportUnavailableError
from kvconnect.core.plan.hetero import SourcePlan
from kvconnect.core.transports.base import Link, Transport
from kvconnect.core.transports.ipc_gather import IpcTransport
from kvconnect.core.transports.nixl_read import NixlRead
from kvconnect.core.wire.logs import loggable
from kvconnect.core.wire.protocol import PeerInfo

log = logging.getLogger(__name__)

TRANSPORTS: tuple[type[Transport], ...] = (IpcTransport, NixlRead)
READY = "ready"


@dataclass
class Transports:
    """The transports one connector started, what it offers its peers, and why any other cannot run."""

    started: list[Transport] = field(default_factory=list)  # in order of preference, NIXL last
    required: str = ""  # the configuration names one transport: a peer it cannot serve is refused
    status: dict[str, str] = field(default_factory=dict)  # kind -> READY, or why it does not run here
    offers: dict[str, bytes] = field(default_factory=dict)  # kind -> what peers need to open it to us

    @classmethod
    def start(
        cls, cache: KVCache, agent: NixlAgent, choice: TransportChoice, candidates: Sequence[type[Transport]] = ()
    ) -> Transports:
        """Start every transport `choice` allows that applies to `cache`, on the calling thread: `candidates`
        (default `TRANSPORTS`) in order, then NIXL's READ if they do not include it."""
        kinds = list(candidates or TRANSPORTS)
        if NixlRead not in kinds:
            kinds.append(NixlRead)
        out = cls(required="" if choice in (TransportChoice.AUTO, TransportChoice.NIXL) else choice.value)
        for kind in kinds:
            if kind is not NixlRead and choice is not TransportChoice.AUTO and kind.kind != choice.value:
                out.status[kind.kind] = f"off (transport={choice.value})"
                continue
            if not kind.applies(cache):
                out.status[kind.kind] = f"not for a {cache.spec.device} cache"
                continue
            transport, t0 = kind(), time.monotonic()
            try:
                offer = transport.start(cache, agent)
            except TransportUnavailableError as e:
                if kind is NixlRead:
                    raise
                out.status[kind.kind] = f"unavailable here ({e})"
                log.warning("%s transport unavailable here (%s); peers will use NIXL", kind.kind, e)
                continue
            log.info(
                "%s transport ready (start-up %.0f ms, on the building thread)",
                kind.kind,
                1e3 * (time.monotonic() - t0),
            )
            out.started.append(transport)
            out.status[kind.kind] = READY
            if offer:
                out.offers[kind.kind] = offer
        return out

    def describe(self) -> str:
        """One line for the start-up log: each transport and whether it runs."""
        return "; ".join(f"{kind} {why}" for kind, why in self.status.items())

    def open(self, info: PeerInfo, plan: SourcePlan, peer: str) -> Link:
        """A link to the peer that answered `info`: the first started transport that opens for `plan` (NIXL's
        READ last). TransportUnavailableError when the required transport cannot serve this peer."""
        why = []
        for transport in self.started:
            kind = transport.kind
            if self.required and kind != self.required:
                continue
            try:
                link = transport.open(info.offers.get(kind, b""), info, plan)
            except TransportUnavailableError as e:
                why.append(f"{kind}: {e}")
                continue
            link.kind, link.notifies = kind, transport.notifies
            if why:
                log.info("peer %s: using %s (%s)", peer, kind, loggable("; ".join(why), 400))
            return link
        if self.required and self.status.get(self.required, READY) != READY:
            why.append(f"{self.required}: {self.status[self.required]}")
        raise TransportUnavailableError(f"peer {peer}: the required transport cannot serve it: {'; '.join(why)}")

    def close(self) -> None:
        for transport in self.started:
            transport.close()

"""The transport interface: how a peer's planned blocks reach the local cache, both halves of it.

A connector builds one object of each transport it may take (`registry.py`) and keeps it for its life. The
object owns everything of its path, in three layers:

- `Transport`, per connector: `start(cache, agent)` runs on the thread that builds the connector, before its
  threads start (an engine may capture CUDA graphs right after registering its cache, and a kernel launched by
  another thread of the process then invalidates the capture). It does the path's one-time set-up (register
  the cache with NIXL, compile a kernel) and its prefill half: the offer a peer needs to open this path to us
  (`PeerInfo.offers[kind]`, b"": nothing beyond the handshake). What it shares between peers (prepared lists,
  staging caches) lives here. `open(offer, info, plan)` is its decode half at a peer's handshake: a `Link`, or
  TransportUnavailableError naming why this peer cannot be served this way;
- `Link`, per peer: `prepare(local_ids, remote_ids, num_tokens)` checks one pull's (already validated) ids
  against the peer and reserves what the transfer needs, returning a `Move` (None: no room now, ask again at a
  later tick);
- `Move`, per pull: `post(notif)` starts it; `state()` is polled until it leaves PROC; `land()` finishes
  placing the data after a good end (a staged read's scatter); `release()` frees the transfer's handle;
  `settle()` gives back everything the move reserved once no transfer can write into its blocks any more.

The pull state machine (`decode/`) never asks which transport it drives; it reads three facts:

- `Transport.notifies`: the transfer itself tells the prefill that it finished (a NIXL notification), so a
  read without confirmation can still end the lease;
- `Move.abandonable`: the transfer can be given up at its deadline but may still write into its blocks
  afterwards (NIXL cannot cancel a posted READ), so its blocks are quarantined until it ends; a local kernel
  always finishes and is simply waited for;
- `Move.issued_descs()`: descriptors the transport really issued, when it can tell (NIXL telemetry).
"""

from __future__ import annotations

import abc
import enum
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from kvconnect.core.agent import NixlAgent, XferState
from kvconnect.core.plan.descriptors import PullPlan

# a move's states: the decode reads them here
__all__ = ["Link", "Move", "Transport", "TransportKind", "XferState"]

if TYPE_CHECKING:
    from kvconnect.core.cache import KVCache
    from kvconnect.core.plan.hetero import SourcePlan
    from kvconnect.core.wire.protocol import PeerInfo


class TransportKind(str, enum.Enum):
    """The product's transports (`TransportChoice` names the ones a configuration may require)."""

    NIXL = "nixl"  # one NIXL READ over prepared descriptor lists (every peer can take it)
    IPC = "ipc"  # same-host GPUs: the peer's cache mapped with CUDA IPC, one gather kernel


class Move(abc.ABC):
    """One pull's transfer through a link, from its reservation to its settling."""

    abandonable: ClassVar[bool] = True

    @abc.abstractmethod
    def post(self, notif: bytes) -> tuple[XferState, PullPlan]:
        """Start the transfer; its state right after posting, and what it moves. `notif`: what the prefill
        receives when it ends (transports that notify). Raises a kvconnect error (PeerGoneError: the peer's
        connection is gone); a move whose post raised holds no transfer."""

    @abc.abstractmethod
    def state(self) -> XferState:
        """PROC while running, DONE or ERR once ended; raises a kvconnect error (PeerGoneError when the peer's
        connection is gone)."""

    def issued_descs(self) -> int | None:
        """Descriptors actually issued after merging, when the transport reports them (ask before `release`)."""
        return None

    def land(self) -> float:
        """The transfer ended well: put its data where the pull's blocks are (synchronised); the seconds it took."""
        return 0.0

    def release(self) -> None:  # noqa: B027 - most moves hold no handle
        """Free the transfer's handle: once it ended, or when it is given up for good (idempotent)."""

    def settle(self) -> None:
        """No transfer can write into the pull's blocks any more: free the handle and give back what the move
        reserved (idempotent)."""
        self.release()


class Link(abc.ABC):
    """One peer's path, opened at its handshake: moves that peer's pulls. `kind` and `notifies` are those of the
    transport that opened it (`registry.Transports.open` sets them)."""

    kind: str = ""
    notifies: bool = False

    @abc.abstractmethod
    def prepare(
        self,
        local_ids: np.ndarray,
        remote_ids: np.ndarray,
        num_tokens: int | None,
        remote_offset: int = 0,
        state_ids: np.ndarray | None = None,
    ) -> Move | None:
        """One pull's move: its ids checked against both caches and put in the order the transfer issues them,
        what it needs reserved (None while there is no room: ask again later). `remote_offset`: the remote
        blocks' first tokens to leave out (pieces of blocks only); `state_ids`: the local blocks that hold state
        (`PairPlan.state_from`). Raises InvalidRequestError."""

    def close(self) -> None:  # noqa: B027 - most links hold nothing of their own
        """The peer is being dropped: free what the link holds for it (moves still in flight keep what they use
        until they settle)."""


class Transport(abc.ABC):
    """One connector's path: its start-up and prefill half (`start`), its decode half (`open`)."""

    kind: ClassVar[str]
    notifies: ClassVar[bool] = False

    @classmethod
    def applies(cls, cache: KVCache) -> bool:
        """Whether the path can serve a cache like `cache` at all (a GPU path and a CPU cache: no, and that is no
        problem to report)."""
        return True

    def start(self, cache: KVCache, agent: NixlAgent) -> bytes:
        """Once, on the thread that builds the connector: set up, and return what peers need to open this path to
        `cache` (b"": nothing). TransportUnavailableError if this process cannot take the path at all."""
        return b""

    @abc.abstractmethod
    def open(self, offer: bytes, info: PeerInfo, plan: SourcePlan) -> Link:
        """The decode half: this path to the peer that answered `info`, whose offer for it is `offer` (b"":
        none), for pulls planned by `plan`; TransportUnavailableError naming why it cannot serve this peer."""

    def close(self) -> None:  # noqa: B027 - most transports hold nothing once their links are closed
        """The connector is closing (every link is closed)."""

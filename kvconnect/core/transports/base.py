"""The transport interface: how one peer's planned blocks reach the local cache, both halves of it.

A transport class owns everything about its path:

- the prefill half, `offer(cache)`: what a peer needs to open this path to this worker (IPC handles, say),
  carried in the handshake answer under the transport's kind (`PeerInfo.offers`); b"" offers nothing;
- start-up, `warm_up(cache)`: what must happen once per process before a peer can be opened (compiling a
  kernel). The connector calls it on the thread that builds it, before its own threads start: an engine
  may capture CUDA graphs right after registering its cache, and a kernel launched by another thread of
  the process then invalidates the capture;
- the decode half, `open(offer, info, plan, cache)`: a `Transport` for one peer, built at handshake, which
  owns what it prepared for that peer (NIXL lists, mapped memory, kernels) and posts one transfer per pull.

What it posts is a `Posted`, polled by the decode loop until it leaves PROC. The pull state machine
(`decode/side.py`) never asks which transport it drives; it reads three facts:

- `notifies`: the transfer itself tells the prefill side that it finished (a NIXL notification), so a
  read without confirmation can still end the lease;
- `Posted.abandonable`: the transfer can be given up at its deadline, but may still write into its
  blocks afterwards (NIXL cannot cancel a posted READ), so its blocks are quarantined until it ends;
  a local kernel always finishes and is simply waited for;
- `Posted.issued_descs`: descriptors the transport really issued, when it can tell (NIXL telemetry).

NIXL's READ (`nixl_read.py`) is the path every peer can take; others are fast paths registered in
`registry.py`, tried first where the configuration allows them.
"""

from __future__ import annotations

import abc
import enum
from typing import TYPE_CHECKING

import numpy as np

from kvconnect.core.agent import XferState
from kvconnect.core.errors import TransportUnavailableError
from kvconnect.core.plan.descriptors import PullPlan

if TYPE_CHECKING:
    from kvconnect.core.cache import KVCache
    from kvconnect.core.plan.hetero import SourcePlan
    from kvconnect.core.wire.protocol import PeerInfo


class TransportKind(str, enum.Enum):
    NIXL = "nixl"  # one NIXL READ over prepared descriptor lists
    IPC = "ipc"  # same-host GPUs: the peer's cache mapped with CUDA IPC, one gather kernel
    MEMORY = "memory"  # a copy between two caches of one process (tests: a transport the test drives)


class Posted(abc.ABC):
    """One transfer in flight."""

    abandonable: bool = True

    @abc.abstractmethod
    def state(self) -> XferState:
        """PROC while running, DONE or ERR once ended; raises a kvconnect error (PeerGoneError when the
        peer's connection is gone)."""

    @abc.abstractmethod
    def release(self) -> None:
        """Free what the transfer holds; once it ended, or when it is given up for good."""

    def issued_descs(self) -> int | None:
        """Descriptors actually issued after merging, when the transport reports them."""
        return None


class Transport(abc.ABC):
    """What one peer's pulls are posted through (an instance), and the path's start-up halves (the class)."""

    kind: TransportKind
    notifies: bool = False

    # --- the class: both halves of the path ---------------------------------------------------------

    @classmethod
    def applies(cls, cache: KVCache) -> bool:
        """Whether the path can serve a cache like `cache` at all (a GPU path and a CPU cache: no, and that is
        no problem to report)."""
        return True

    @classmethod
    def warm_up(cls, cache: KVCache) -> None:
        """Once per process, on the thread that builds the connector; TransportUnavailableError if this
        process cannot take the path at all. Most paths need nothing."""
        return None

    @classmethod
    def offer(cls, cache: KVCache) -> bytes:
        """Prefill half: what a peer needs to open this path to `cache` (b"": nothing offered)."""
        return b""

    @classmethod
    def open(cls, offer: bytes, info: PeerInfo, plan: SourcePlan, cache: KVCache) -> Transport:
        """Decode half: this path to the peer that answered `info` with `offer`, for pulls planned by `plan`
        into `cache`; TransportUnavailableError naming why it cannot serve this peer."""
        raise TransportUnavailableError(f"{cls.kind.value}: no decode half")

    # --- an instance: one peer's pulls --------------------------------------------------------------

    @abc.abstractmethod
    def order(self, local_ids: np.ndarray, remote_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The remaining checks on a pull's (already validated) block ids, and the pairs in the order this
        transport issues them; raises InvalidRequestError."""

    @abc.abstractmethod
    def post(
        self, local_ids: np.ndarray, remote_ids: np.ndarray, num_tokens: int | None, notif: bytes
    ) -> tuple[Posted, XferState, PullPlan]:
        """Start moving the ordered pairs; returns the transfer, its state right after posting, and what it
        moves. `notif` is what the prefill side receives when the transfer ends (if `notifies`)."""

    def close(self) -> None:  # noqa: B027 - most transports hold nothing of their own
        """Free what the transport holds for its peer (the peer is being dropped)."""

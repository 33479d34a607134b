"""The transport interface: how one peer's planned blocks reach the local cache.

A `Transport` is built once per peer at handshake (it owns what it prepared for that peer: NIXL lists,
mapped memory, kernels) and posts one transfer per pull. What it posts is a `Posted`, polled by the
decode loop until it leaves PROC. The pull state machine (`decode.py`) never asks which transport it
drives; it reads the three facts below:

- `notifies`: the transfer itself tells the prefill side that it finished (a NIXL notification), so a
  read without confirmation can still end the lease;
- `Posted.abandonable`: the transfer can be given up at its deadline, but may still write into its
  blocks afterwards (NIXL cannot cancel a posted READ), so its blocks are quarantined until it ends;
  a local kernel always finishes and is simply waited for;
- `Posted.issued_descs`: descriptors the transport really issued, when it can tell (NIXL telemetry).

A new path (pack/bulk/unpack, an RDMA-specific one) is a new module implementing these two classes.
"""

from __future__ import annotations

import abc
import enum

import numpy as np

from kvconnect.core.agent import XferState
from kvconnect.core.plan.descriptors import PullPlan


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
    """What one peer's pulls are posted through."""

    kind: TransportKind
    notifies: bool = False

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

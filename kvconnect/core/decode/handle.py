"""A pull as its caller sees it: the handle it polls or waits on (any thread), and the stats of what it moved.

The connector's ticks own the pull itself (`pull.py`) and finish the handle exactly once; only a finish
without an error means the bytes in the local blocks are the remote ones, read while the remote lease was
held. A failed pull's blocks may be reused only once `settled()` (a given-up NIXL READ may still write into
them).
"""

from __future__ import annotations

import threading

import msgspec

from kvconnect.core.errors import KVConnectError, TransferTimeoutError


class PullStats(msgspec.Struct):
    """What one pull moved and how long each part took (seconds)."""

    request_id: str
    remote_engine_id: str
    num_blocks: int = 0
    bytes: int = 0
    num_descs: int = 0
    num_descs_merged: int = 0
    granularity: str = ""
    handshake_s: float = 0.0  # first contact only: metadata fetch + remote agent + list preparation
    post_s: float = 0.0  # plan + make_prepped_xfer + transfer() on the loop thread
    transfer_s: float = 0.0  # posted -> READ complete
    confirm_s: float = 0.0
    total_s: float = 0.0  # pull requested -> blocks usable
    transport: str = ""  # the transport's kind: "nixl" or "ipc"
    validate_s: float = 0.0  # the part of post_s spent checking block ids
    pin_s: float = 0.0  # the part of post_s spent sending the PIN (0: none sent)
    launch_s: float = 0.0  # the part of post_s inside the transport's post (the READ or the gather launch)
    pin_rtt_s: float = 0.0  # the PIN sent -> its answer here (0: none answered)
    queued_s: float = 0.0  # pull() returned -> the loop thread picked the pull up
    path: str = ""  # "block", "direct" or "staging" (hetero.py); "+"-joined over several sources
    num_sources: int = 1  # prefill ranks read (heterogeneous TP)
    scatter_s: float = 0.0  # staging path: staging -> decode cache on the device
    digest_s: float = 0.0  # kv_digest: summing the pulled blocks on this side (0: not checked)
    # the transfer ended -> usable: the lease's answer, the digest (0: no transfer ended)
    after_read_s: float = 0.0
    # usable once the prefill's lease board showed the lease held, before the PIN's answer
    on_board: bool = False
    num_descs_issued: int = 0  # descriptors NIXL reported issuing (0 unless the `telemetry` setting is on)
    # the thread that posted it: "engine" (a caller's `drive`, e.g. vLLM's step) or "loop" (the connector's own,
    # which then takes the GIL from whatever Python the engine runs at each blocking call of the post)
    posted_on: str = ""

    @property
    def gbps(self) -> float:
        span = self.transfer_s + self.post_s
        return self.bytes / span / 1e9 if span > 0 else 0.0


class PullHandle:
    """The caller's view of a pull; thread-safe."""

    def __init__(self, request_id: str, remote_engine_id: str) -> None:
        self.request_id = request_id
        self.stats = PullStats(request_id, remote_engine_id)
        self._event = threading.Event()
        self._error: KVConnectError | None = None
        # an abandoned READ may still land (`AbandonedReads`); polled, never waited on
        self._unsettled = False
        self._cancel = False
        self.parts: list[PullHandle] = []  # one per source rank when several are read

    @property
    def cancel_requested(self) -> bool:
        return self._cancel

    def done(self) -> bool:
        return self._event.is_set()

    def poll(self) -> bool:
        """False while in flight, True once the blocks are usable; raises the pull's error."""
        if not self._event.is_set():
            return False
        if self._error is not None:
            raise self._error
        return True

    def wait(self, timeout_s: float | None = None) -> PullStats:
        if not self._event.wait(timeout_s):
            raise TransferTimeoutError(f"pull {self.request_id}: caller gave up after {timeout_s}s")
        if self._error is not None:
            raise self._error
        return self.stats

    @property
    def error(self) -> KVConnectError | None:
        return self._error

    def cancel(self) -> None:
        """Ask the loop to abandon the pull (its blocks must not be used)."""
        self._cancel = True
        for part in self.parts:
            part.cancel()

    def settled(self) -> bool:
        """False while an abandoned READ may still write into the local blocks: a failed pull's blocks
        may be reused (freed, recomputed into) only once this is True. See `AbandonedReads`."""
        return not self._unsettled and all(part.settled() for part in self.parts)

    def _finish(self, error: KVConnectError | None) -> None:
        self._error = error
        self._event.set()

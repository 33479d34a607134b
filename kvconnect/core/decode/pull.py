"""One pull from request to usable blocks: phases, deadline, stats, and the caller's handle.

The connector's ticks (on its loop thread, or on a thread driving it) own `Pull` objects and move them
through `PullPhase`; callers on any thread hold a `PullHandle` and either poll it or wait on it. A pull
reaches exactly one terminal phase, and only DONE means the bytes in the local blocks are the remote
ones, read while the remote lease was held.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec
import numpy as np

from kvconnect.core.agent import XferState
from kvconnect.core.errors import KVConnectError, PeerGoneError, TransferTimeoutError
from kvconnect.core.plan.groups import GroupedBlocks
from kvconnect.core.plan.hetero import Source
from kvconnect.core.plan.layout import CacheSpec
from kvconnect.core.plan.params import KVTransferParams, validated_pull
from kvconnect.core.transports.base import Posted
from kvconnect.core.wire.logs import loggable
from kvconnect.core.wire.protocol import encode_notif

log = logging.getLogger(__name__)
BlockIds = Sequence[int] | np.ndarray  # block ids as a caller gives them (checked into an int64 array)


class PullPhase(str, enum.Enum):
    WAIT_PEER = "wait_peer"  # handshake with the remote engine in progress
    POSTED = "posted"  # READ in flight
    CONFIRMING = "confirming"  # data here; asking the prefill side whether its lease held
    DONE = "done"
    FAILED = "failed"


class PinState(str, enum.Enum):
    """Where a pull's pin of the prefill lease stands (see lease.py)."""

    NONE = "none"  # not asked for
    SENT = "sent"  # asked, no answer yet
    HELD = "held"  # the prefill keeps the blocks until we confirm
    LOST = "lost"  # refused, or the lease had ended: `Pull.pin_error` says how


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
    transport: str = ""  # "nixl" or "ipc"
    validate_s: float = 0.0  # the part of post_s spent checking block ids
    pin_s: float = 0.0  # the part of post_s spent sending the PIN (0: none sent)
    launch_s: float = 0.0  # the part of post_s inside the transport's post (the READ or the gather launch)
    pin_rtt_s: float = 0.0  # the PIN sent -> its answer here (0: none answered)
    queued_s: float = 0.0  # pull() returned -> the loop thread picked the pull up
    path: str = ""  # "block", "direct" or "staging" (hetero.py); "+"-joined over several sources
    num_sources: int = 1  # prefill ranks read (heterogeneous TP)
    scatter_s: float = 0.0  # staging path: staging -> decode cache on the device
    digest_s: float = 0.0  # kv_digest: summing the pulled blocks on this side (0: not checked)
    after_read_s: float = 0.0  # the transfer ended -> usable: the lease's answer, the digest (0: no transfer ended)
    on_board: bool = False  # usable once the prefill's lease board showed the lease held, before the PIN's answer
    num_descs_issued: int = 0  # descriptors NIXL reported issuing (0 unless the `telemetry` setting is on)

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
        self._unsettled = False  # an abandoned READ may still land (`AbandonedReads`); polled, never waited on
        self._cancel = False
        self.parts: list[PullHandle] = []  # one per source rank when several are read

    @property
    def cancel_requested(self) -> bool:
        return self._cancel

    def done(self) -> bool:
        return self._event.is_set()

    def poll(self) -> bool | None:
        """None while in flight, True when the blocks are usable; raises the pull's error."""
        if not self._event.is_set():
            return None
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


@dataclass
class Pull:
    """Loop-side state of one pull."""

    handle: PullHandle
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_request_id: str  # the prefill request's label (logs)
    lease_id: str  # the prefill's lease of the blocks: what PIN, CONFIRM, RELEASE and the notification name
    remote_block_ids: np.ndarray  # int64, validated (see from_params), in token order
    local_block_ids: np.ndarray
    expected_incarnation: str | None
    requested_s: float
    deadline_s: float
    phase: PullPhase = PullPhase.WAIT_PEER
    posted: Posted | None = None  # the transfer in flight (the transport's handle)
    posted_s: float = 0.0
    read_done_s: float = 0.0
    remote_tp: int = 1
    num_tokens: int | None = None  # tokens the blocks hold, when the prefill said (block-size conversion)
    source: Source | None = None  # the prefill rank and heads this pull reads (set by the decode side)
    group: PullGroup | None = None  # the request this pull is one source of
    staging_ids: list[int] | None = None  # staging blocks the READ lands in (staging path)
    on_settled: Callable[[], None] | None = None  # runs once no READ can write into this pull's blocks
    pin: PinState = PinState.NONE
    pin_error: str = ""  # PinState.LOST: the refusal, or the state the lease had ended in
    pin_until_s: float = 0.0  # our (conservative) end of the pin
    not_granted_since_s: float = 0.0  # when the prefill first said it had never seen the lease (confirm.py)
    ask_again_s: float = 0.0  # when to repeat that PIN or CONFIRM (while confirm.py has it waiting)
    asked: int = 0  # how many times it was repeated
    # this pull's own claim on the lease (lease.py): a replay of the same params by another pull has another
    read_token: bytes = field(default_factory=lambda: secrets.token_bytes(16))
    remote_digest: bytes = b""  # the prefill's digest of the blocks read, from its lease answer (kv_digest)
    prompt_digest: bytes = b""  # the prompt this decode serves (`params.prompt_digest`): a bound lease checks it
    pin_sent_s: float = 0.0  # when the PIN left: the prefill's pin lasts at least its granted length from then
    group_sizes: tuple[int, ...] = ()  # blocks per KV cache group of a hybrid model (plan/groups.py); (n,): one
    leased: GroupedBlocks | None = None  # all the lease's blocks, these being their tail (the lease board's binding)
    board_binding: bytes | None = None  # what the board must show for its lease (confirm.py; None: not worked out)

    def notif(self, incarnation_id: str) -> bytes:
        """The notification this pull's READ carries to the prefill (it completes the lease for this reader)."""
        assert self.source is not None
        return encode_notif(
            self.lease_id,
            incarnation_id,
            self.source.reader,
            self.source.readers,
            self.remote_block_ids.tolist(),
            self.read_token,
            self.prompt_digest,
            self.group_sizes,
        )

    def failure_line(self, error: KVConnectError) -> str:
        """This pull's failure as a log line (ids from params made printable)."""
        rank = self.source.rank if self.source is not None else 0
        where = f" (prefill rank {rank})" if rank else ""
        who = f"pull {loggable(self.handle.request_id)} from {loggable(self.remote_engine_id)}"
        return f"{who} failed: {loggable(error, 400)}{where}"

    def run_on_settled(self) -> None:
        """Run the `on_settled` hook once: no READ can write into this pull's blocks any more."""
        hook, self.on_settled = self.on_settled, None
        if hook is not None:
            hook()

    @property
    def peer_key(self) -> str:
        rank = self.source.rank if self.source is not None else 0
        return f"{self.remote_engine_id}#{rank}"

    @classmethod
    def from_params(
        cls,
        params: KVTransferParams,
        local_block_ids: BlockIds,
        request_id: str | None,
        spec: CacheSpec,
        timeout_s: float,
        prompt_digest: bytes = b"",
        requested_s: float | None = None,
        leased: GroupedBlocks | None = None,
    ) -> Pull:
        """Validate a pull request (any thread); InvalidRequestError names the field, nothing is posted.
        `requested_s`: when the caller asked for it (monotonic; default now), where its timeline starts. `leased`:
        the lease's blocks when the params name only their tail (default: the params name them all)."""
        target = validated_pull(params, local_block_ids, spec.num_blocks, spec.model_kv_heads)
        now = time.monotonic() if requested_s is None else requested_s
        return cls(
            handle=PullHandle(request_id or target.request_id, target.engine_id),
            remote_engine_id=target.engine_id,
            remote_host=target.host,
            remote_port=target.port,
            remote_request_id=target.request_id,
            lease_id=target.lease_id,
            remote_block_ids=target.remote_block_ids,
            local_block_ids=target.local_block_ids,
            expected_incarnation=target.incarnation_id,
            requested_s=now,
            deadline_s=now + timeout_s,
            remote_tp=target.tp_size,
            num_tokens=target.num_tokens,
            prompt_digest=prompt_digest,
            group_sizes=target.group_sizes,
            leased=leased or GroupedBlocks(target.remote_block_ids, target.group_sizes),
        )

    def parts_for(self, reads: Sequence[Source]) -> list[Pull]:
        """This pull as one pull per prefill rank it reads (several are joined by a `PullGroup`)."""
        if len(reads) == 1:
            self.source = reads[0]
            self.remote_port += self.source.rank
            if self.source.rank:
                self.expected_incarnation = None  # the params name rank 0's incarnation
            return [self]
        group = PullGroup(self, len(reads))
        return [self.part(source, group) for source in reads]

    def part(self, source: Source, group: PullGroup) -> Pull:
        """The pull of one source rank of a request read from several (ranks listen on base port + rank)."""
        handle = PullHandle(f"{self.handle.request_id}@{source.rank}", self.remote_engine_id)
        self.handle.parts.append(handle)
        return dataclasses.replace(
            self,
            handle=handle,
            remote_port=self.remote_port + source.rank,
            source=source,
            group=group,
            expected_incarnation=self.expected_incarnation if source.rank == 0 else None,
        )

    def finish(self, error: KVConnectError | None) -> None:
        now = time.monotonic()
        self.phase = PullPhase.FAILED if error else PullPhase.DONE
        self.handle.stats.total_s = now - self.requested_s
        if self.read_done_s:
            self.handle.stats.after_read_s = now - self.read_done_s
        self.handle._finish(error)


class PullGroup:
    """A request read from several prefill ranks: done when every part is, failed at the first failure."""

    def __init__(self, parent: Pull, parts: int) -> None:
        self.parent = parent
        self.pending = parts
        self.finished = False

    def part_done(self, part: Pull, error: KVConnectError | None) -> bool:
        """Record one part's end; True when this ends the request (the caller then reports the parent)."""
        self.pending -= 1
        if self.finished:
            return False
        if error is None and self.pending:
            return False
        self.finished = True
        stats = self.parent.handle.stats
        parts = [h.stats for h in self.parent.handle.parts]
        stats.num_sources = len(parts)
        for name in ("bytes", "num_descs", "num_descs_merged", "num_descs_issued", "post_s", "validate_s", "scatter_s"):
            setattr(stats, name, sum(getattr(x, name) for x in parts))  # (one after another on the loop)
        for name in ("handshake_s", "transfer_s", "confirm_s", "queued_s", "after_read_s"):
            setattr(stats, name, max(getattr(x, name) for x in parts))
        for name in ("path", "granularity", "transport"):
            setattr(stats, name, "+".join(sorted({getattr(x, name) for x in parts if getattr(x, name)})))
        stats.num_blocks = len(self.parent.local_block_ids)
        self.parent.finish(error)
        return True


class AbandonedReads:
    """Transfers given up on (deadline, cancellation, peer dropped) that may still write into their blocks.

    NIXL cannot cancel a posted READ: over UCX/TCP a hung peer that resumes still delivers the data,
    after `release_xfer_handle` and even after `remove_remote_agent` (probed; see tests/test_faults.py).
    So an abandoned transfer keeps its handle and is polled until it ends (done, error, or the peer is
    gone); until then its `PullHandle.settled()` is False and the owner must not reuse the blocks.
    """

    def __init__(self) -> None:
        self._pulls: list[tuple[Pull, str]] = []

    def add(self, pull: Pull, agent_name: str) -> None:
        if pull.posted is None:
            return
        pull.handle._unsettled = True
        self._pulls.append((pull, agent_name))

    def __len__(self) -> int:
        return len(self._pulls)

    def uses(self, agent_name: str) -> bool:
        return any(name == agent_name for _, name in self._pulls)

    @property
    def num_blocks(self) -> int:
        return sum(len(pull.local_block_ids) for pull, _ in list(self._pulls))  # (read from any thread)

    def poll(self) -> None:
        for item in list(self._pulls):
            pull = item[0]
            assert pull.posted is not None
            try:
                state = pull.posted.state()
            except PeerGoneError:
                state = XferState.ERR  # the connection is gone: nothing more can land
            except KVConnectError as e:
                log.warning(
                    "abandoned pull %s: cannot poll its transfer (%s); treating it as ended", pull.handle.request_id, e
                )
                state = XferState.ERR
            if state is XferState.PROC:
                continue
            self._pulls.remove(item)
            _settle(pull)
            log.info(
                "abandoned pull %s: its transfer ended (%s); %d local blocks are safe again",
                pull.handle.request_id,
                state.value,
                len(pull.local_block_ids),
            )

    def close(self) -> None:
        for pull, _ in self._pulls:
            _settle(pull)
        self._pulls.clear()


def release_posted(pull: Pull) -> None:
    """Free the pull's transfer handle, if it still has one."""
    if pull.posted is not None:
        pull.posted.release()
        pull.posted = None


def _settle(pull: Pull) -> None:
    release_posted(pull)
    pull.handle._unsettled = False
    pull.run_on_settled()

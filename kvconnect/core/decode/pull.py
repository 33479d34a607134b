"""One pull from request to usable blocks, as the connector's ticks hold it: its phase, deadline and lease state.

The ticks (on the loop thread, or on a thread driving it) own `Pull` objects and move them through
`PullPhase`, only by `Pull.enter` (the transitions it allows are `NEXT`); callers on any thread hold the
pull's `PullHandle` (`handle.py`). A pull reaches exactly one terminal phase, and only DONE means the bytes in
the local blocks are the remote ones, read while the remote lease was held. A request read from several
prefill ranks (heterogeneous TP) runs as one pull per rank, joined by a `PullGroup`.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvconnect.core.decode.handle import PullHandle
from kvconnect.core.errors import KVConnectError
from kvconnect.core.plan.groups import GroupedBlocks
from kvconnect.core.plan.hetero import Source
from kvconnect.core.plan.layout import CacheSpec
from kvconnect.core.plan.params import KVTransferParams, validated_pull
from kvconnect.core.transports.base import Move
from kvconnect.core.wire.logs import loggable
from kvconnect.core.wire.protocol import encode_notif

log = logging.getLogger(__name__)
BlockIds = Sequence[int] | np.ndarray  # block ids as a caller gives them (checked into an int64 array)


class PullPhase(str, enum.Enum):
    WAIT_PEER = "wait_peer"  # waiting for its peer's handshake, or for room on its peer's link
    POSTED = "posted"  # its transfer in flight
    CONFIRMING = "confirming"  # data here; the prefill's lease must be shown to have held through the read
    DONE = "done"
    FAILED = "failed"


ENDED = (PullPhase.DONE, PullPhase.FAILED)
NEXT = {  # the phases a pull may enter from each phase
    PullPhase.WAIT_PEER: (PullPhase.POSTED, *ENDED),
    PullPhase.POSTED: (PullPhase.CONFIRMING, *ENDED),
    PullPhase.CONFIRMING: ENDED,
    PullPhase.DONE: (),
    PullPhase.FAILED: (),
}


class PinState(str, enum.Enum):
    """Where a pull's pin of the prefill lease stands (see lease.py)."""

    NONE = "none"  # not asked for
    SENT = "sent"  # asked, no answer yet
    HELD = "held"  # the prefill keeps the blocks until we confirm
    LOST = "lost"  # refused, or the lease had ended: `Pull.pin_error` says how


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
    move: Move | None = None  # its transfer through its peer's link (transports/base.py), once prepared
    posted_s: float = 0.0
    read_done_s: float = 0.0
    remote_tp: int = 1
    num_tokens: int | None = None  # tokens the blocks hold, when the prefill said (block-size conversion)
    source: Source | None = None  # the prefill rank and heads this pull reads (set by the decode side)
    group: PullGroup | None = None  # the request this pull is one source of
    pin: PinState = PinState.NONE
    pin_error: str = ""  # PinState.LOST: the refusal, or the state the lease had ended in
    pin_until_s: float = 0.0  # our (conservative) end of the pin
    not_granted_since_s: float = 0.0  # when the prefill first said it had never seen the lease (confirm.py)
    ask_again_s: float = 0.0  # when to repeat that PIN or CONFIRM (while confirm.py has it waiting)
    asked: int = 0  # how many times it was repeated
    # this pull's own claim on the lease (lease.py): a replay of the same params by another pull has another
    read_token: bytes = field(default_factory=lambda: secrets.token_bytes(16))
    remote_digest: bytes = b""  # the prefill's digest of the blocks read, from its lease answer (kv_digest)
    # the prompt this decode serves (`params.prompt_digest`): a bound lease checks it
    prompt_digest: bytes = b""
    # when the PIN left: the prefill's pin lasts at least its granted length from then
    pin_sent_s: float = 0.0
    # blocks per KV cache group of a hybrid model (plan/groups.py); (n,): one
    group_sizes: tuple[int, ...] = ()
    # all the lease's blocks, these being their tail (the lease board's binding)
    leased: GroupedBlocks | None = None
    # what the board must show for its lease (confirm.py; None: not worked out)
    board_binding: bytes | None = None
    # the lease's first tokens the decode's own prefix cache holds: `remote_block_ids` are then all the lease's,
    # until the peer's block size says which of them to read (peers.py, `prepare`)
    skip_tokens: int = 0
    # set from skip_tokens when the decode's hit ends inside a prefill block: that block's tokens held here
    remote_offset: int = 0
    # a Mamba2 hybrid's local blocks that hold state (the plug-in knows its groups): a pair of different TP
    # sizes moves them as state runs, the others as runs of heads (hetero.state_pair)
    state_ids: np.ndarray | None = None

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

    def enter(self, phase: PullPhase) -> None:
        """Move to `phase`: the one place a pull's phase changes (AssertionError for a transition `NEXT` lacks)."""
        assert phase in NEXT[self.phase], f"pull {self.handle.request_id}: {self.phase.value} -> {phase.value}"
        self.phase = phase

    @property
    def ended(self) -> bool:
        return self.phase in ENDED

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
        `requested_s`: when the caller asked for it (monotonic; default now), where its timeline starts.
        `leased`: the lease's blocks when the params name only their tail (default: the params name them all).
        """
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
        self.enter(PullPhase.FAILED if error else PullPhase.DONE)
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
        for name in ("path", "granularity", "transport", "posted_on"):
            setattr(stats, name, "+".join(sorted({getattr(x, name) for x in parts if getattr(x, name)})))
        stats.num_blocks = len(self.parent.local_block_ids)
        self.parent.finish(error)
        return True

"""Request bookkeeping of the engine: a queue per state, admission against the block allocator, KV-load
polling, what each step computes, and where a finished request's blocks go (a KVKeeper or the pool).

Every request is computed the same way, local or not: a prefill of prompt tokens [0, n-1) on its own,
then the last prompt token as a decode step, then decode steps. A KVLoader replaces only the prefill.
Used from the engine thread only; the allocator it draws on is the thread-safe part.
"""

from __future__ import annotations

import logging
from collections import deque

from kvconnect.core.config import FailurePolicy
from kvconnect.core.errors import KVConnectError
from kvconnect.engine.allocator import BlockAllocator, OutOfBlocksError
from kvconnect.engine.sequence import FinishReason, SeqStatus, Sequence

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, allocator: BlockAllocator, *, block_size: int, max_num_seqs: int) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()  # FIFO; the head waits for blocks
        self.loading: list[Sequence] = []
        self.prefilling: deque[Sequence] = deque()
        self.decoding: list[Sequence] = []
        self.draining: list[Sequence] = []  # finished while a load was writing into their blocks
        self._by_id: dict[str, Sequence] = {}

    # --- queries ---------------------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.loading) + len(self.prefilling) + len(self.decoding)

    @property
    def num_loading(self) -> int:
        return len(self.loading)

    @property
    def has_loads_in_flight(self) -> bool:
        return bool(self.loading or self.draining)

    def get(self, request_id: str) -> Sequence | None:
        return self._by_id.get(request_id)

    def live(self) -> list[Sequence]:
        return list(self._by_id.values())

    # --- transitions -----------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)
        self._by_id[seq.request_id] = seq

    def admit(self) -> list[tuple[Sequence, str]]:
        """Give blocks to waiting requests in arrival order; start their loads. Returns the requests
        whose load failed at start under the "fail" policy, with the message to finish them with."""
        failures = []
        while self.waiting and self.num_running < self.max_num_seqs:
            seq = self.waiting[0]
            try:
                seq.block_ids = self.allocator.allocate(seq.num_blocks_needed(self.block_size))
            except OutOfBlocksError:
                break  # head-of-line waits; a free wakes the engine
            self.waiting.popleft()
            if seq.kv_loader is None:
                self._to_compute(seq)
                continue
            seq.status = SeqStatus.LOADING
            try:
                seq.load_handle = seq.kv_loader.start(
                    seq.request_id, seq.prompt_block_ids(self.block_size), seq.num_prompt_tokens
                )
            except Exception as e:
                message = self._load_failed(seq, e)
                if message is not None:
                    failures.append((seq, message))
                continue
            self.loading.append(seq)
        return failures

    def poll_loads(self) -> list[tuple[Sequence, str]]:
        """Poll every in-flight load once; finished loads join the decode queue. Returns failures as
        `admit` does. Also frees the blocks of drained (aborted) loads."""
        failures = []
        for seq in list(self.loading):
            assert seq.load_handle is not None
            try:
                done = seq.load_handle.poll()
            except Exception as e:
                self.loading.remove(seq)
                message = self._load_failed(seq, e)
                if message is not None:
                    failures.append((seq, message))
                continue
            if done:
                self.loading.remove(seq)
                seq.load_handle = None
                seq.num_computed_tokens = seq.num_prompt_tokens - 1
                seq.status = SeqStatus.DECODE
                self.decoding.append(seq)
        for seq in list(self.draining):
            assert seq.load_handle is not None
            try:
                done = seq.load_handle.poll()
            except Exception:
                done = True
            if done:
                self.draining.remove(seq)
                seq.load_handle = None
                self._free(seq)
        return failures

    def next_prefill(self) -> Sequence | None:
        return self.prefilling.popleft() if self.prefilling else None

    def prefilled(self, seq: Sequence) -> None:
        seq.num_computed_tokens = seq.num_prompt_tokens - 1
        seq.status = SeqStatus.DECODE
        self.decoding.append(seq)

    def decode_batch(self) -> list[Sequence]:
        return list(self.decoding)

    def release(self, seq: Sequence, reason: FinishReason) -> None:
        """Take a finished request out of its queue and hand its blocks to its keeper or the pool."""
        self._by_id.pop(seq.request_id, None)
        queue = {
            SeqStatus.WAITING: self.waiting,
            SeqStatus.LOADING: self.loading,
            SeqStatus.PREFILL: self.prefilling,
            SeqStatus.DECODE: self.decoding,
        }.get(seq.status)
        if queue is not None and seq in queue:
            queue.remove(seq)
        in_flight = seq.status is SeqStatus.LOADING and seq.load_handle is not None
        seq.status = SeqStatus.FINISHED
        if in_flight:
            self.draining.append(seq)  # the load may still write into these blocks
            return
        if seq.block_ids and reason in (FinishReason.STOP, FinishReason.LENGTH) and seq.kv_keeper is not None:
            try:
                kept = bool(seq.kv_keeper.keep(seq.request_id, list(seq.block_ids), seq.num_prompt_tokens))
            except Exception:
                logger.exception("%s: KVKeeper.keep raised; freeing its blocks", seq.request_id)
                kept = False
            if kept:
                seq.block_ids = []
                return
        self._free(seq)

    # --- helpers ---------------------------------------------------------------------------------------

    def _to_compute(self, seq: Sequence) -> None:
        seq.num_computed_tokens = 0
        if seq.num_prompt_tokens > 1:
            seq.status = SeqStatus.PREFILL
            self.prefilling.append(seq)
        else:
            seq.status = SeqStatus.DECODE
            self.decoding.append(seq)

    def _load_failed(self, seq: Sequence, exc: BaseException) -> str | None:
        """Recompute under the "recompute" policy (returns None), else the message to fail with."""
        seq.load_handle = None
        message = f"KV load failed: {type(exc).__name__}: {exc}"
        if not isinstance(exc, KVConnectError):
            logger.error("%s: KV loader raised a foreign exception", seq.request_id, exc_info=exc)
        policy = getattr(seq.kv_loader, "policy", FailurePolicy.FAIL)
        if policy == FailurePolicy.RECOMPUTE:
            logger.warning("%s: %s; computing the prompt locally", seq.request_id, message)
            self._to_compute(seq)
            return None
        return message

    def _free(self, seq: Sequence) -> None:
        if seq.block_ids:
            ids, seq.block_ids = seq.block_ids, []
            self.allocator.free(ids)

"""The demo engine: owns the model, the paged KV cache, the block allocator and the tokenizer, and runs
the scheduler loop on its own thread.

Each loop iteration: take new requests and aborts from the inbox, poll KV loads, admit waiting
requests, run at most one prefill (one request, prompt tokens [0, n-1)), then one decode step for
every request in the decode state, batched. Events go to each request's `on_event` from this thread;
callbacks must be quick and must not block (hand off to an event loop).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from kvconnect.core.cache import TORCH_DTYPES, KVCache
from kvconnect.core.errors import InvalidRequestError, LocalError
from kvconnect.engine.allocator import BlockAllocator
from kvconnect.engine.attention import (
    AttentionBackend,
    BatchItem,
    build_batch,
    flash_attn_kernel,
    select_backend,
)
from kvconnect.engine.config import EngineConfig
from kvconnect.engine.hooks import KVKeeper, KVLoader
from kvconnect.engine.model import LlamaModel
from kvconnect.engine.sampling import SamplingParams, sample
from kvconnect.engine.scheduler import Scheduler
from kvconnect.engine.sequence import FinishReason, Sequence, TokenEvent
from kvconnect.engine.tokenizer import GENERATED_FIRST, ByteTokenizer

logger = logging.getLogger(__name__)


class EngineStateError(LocalError):
    """The engine was used outside its running state (not started, stopped, started twice)."""


class Engine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config if config is not None else EngineConfig()
        cfg = self.config
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda" and self.device.index is None:  # pin "cuda" to one device for good
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.tokenizer = ByteTokenizer()
        self.spec = cfg.cache_spec()
        self.cache = KVCache.allocate(self.spec, device=self.device)
        self.allocator = BlockAllocator(cfg.num_blocks)
        dtype = TORCH_DTYPES[cfg.dtype]
        backend = select_backend(
            cfg.attention_backend,
            device_kind=cfg.device_kind,
            dtype=dtype,
            kv_cache_dtype=TORCH_DTYPES[cfg.kv_cache_dtype],
            block_size=cfg.block_size,
        )
        self.attention_backend = backend
        flash_kernel = flash_attn_kernel() if backend is AttentionBackend.FLASH_ATTN else None
        self.model = LlamaModel(cfg.model, device=self.device, dtype=dtype, flash_kernel=flash_kernel)
        self.model.check_cache(self.cache)
        self.num_running = 0  # admitted: loading, prefilling or decoding
        self.num_waiting = 0  # queued for blocks
        self.num_loading = 0
        self.num_steps = 0  # loop iterations that computed something
        self.peak_decode_batch = 0  # most requests in one decode step so far
        self._scheduler = Scheduler(self.allocator, block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: list[Sequence | str] = []  # a Sequence to add, or a request id to abort
        self._live_ids: set[str] = set()
        self._thread: threading.Thread | None = None
        self._accepting = True  # requests may be queued before start(); none after stop()
        self._stopping = False
        self.allocator.add_free_listener(self._wake.set)

    # --- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> None:
        with self._lock:
            if self._thread is not None:
                raise EngineStateError("engine already started")
            if not self._accepting:
                raise EngineStateError("engine was stopped; build a new one")
            self._thread = threading.Thread(target=self._loop, name="kvconnect-engine", daemon=True)
            self._thread.start()
        spec = self.spec
        logger.info(
            "engine started: %s cache, %d blocks of %d tokens, attention %s",
            spec.kind.value,
            spec.num_blocks,
            spec.block_size,
            self.attention_backend.value,
        )

    def stop(self, timeout_s: float = 30.0) -> None:
        """Abort every live request (finish "abort") and join the engine thread."""
        with self._lock:
            self._accepting = False
            if self._stopping:
                return
            self._stopping = True
            thread = self._thread
        if thread is None:  # never started: finish what was queued, here
            self._shutdown()
            return
        self._wake.set()
        if thread is threading.current_thread():  # stop() from an on_event callback: the loop exits itself
            return
        thread.join(timeout_s)
        if thread.is_alive():
            logger.error("engine thread did not stop within %.1f s", timeout_s)

    def __enter__(self) -> Engine:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- requests --------------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        on_event: Callable[[TokenEvent], None],
        *,
        kv_loader: KVLoader | None = None,
        kv_keeper: KVKeeper | None = None,
    ) -> None:
        """Queue a request (also before start()); raises InvalidRequestError (bad input, id in use) or
        EngineStateError (after stop())."""
        model = self.config.model
        prompt = tuple(int(t) for t in prompt_ids)
        if not prompt:
            raise InvalidRequestError("prompt", "must contain at least one token")
        if any(not 0 <= t < model.vocab_size for t in prompt):
            raise InvalidRequestError("prompt", f"token ids must lie in [0, {model.vocab_size})")
        if len(prompt) > model.max_position:
            raise InvalidRequestError("prompt", f"{len(prompt)} tokens exceed {model.max_position} positions")
        stop_ids = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop_ids.add(self.tokenizer.eos_id)
        seq = Sequence(
            request_id=request_id,
            prompt_ids=prompt,
            sampling=sampling,
            on_event=on_event,
            kv_loader=kv_loader,
            kv_keeper=kv_keeper,
            max_new_tokens=min(sampling.max_tokens, model.max_position - len(prompt) + 1),
            stop_ids=frozenset(stop_ids),
            generator=sampling.make_generator(),
        )
        need = seq.num_blocks_needed(self.spec.block_size)
        if need > self.allocator.num_total:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt plus max_tokens need {need} blocks, the cache holds {self.allocator.num_total}",
            )
        with self._lock:
            if not self._accepting:
                raise EngineStateError("engine is stopped")
            if request_id in self._live_ids:
                raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
            self._live_ids.add(request_id)
            self._inbox.append(seq)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Finish a live request with "abort" (asynchronously); unknown ids are ignored."""
        with self._lock:
            if request_id not in self._live_ids:
                return
            self._inbox.append(request_id)
        self._wake.set()

    # --- engine thread ---------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            with torch.inference_mode():
                while not self._stopping:
                    self._iterate()
        except Exception:
            logger.exception("engine loop crashed")
        finally:
            self._shutdown()

    def _iterate(self) -> None:
        sched = self._scheduler
        self._drain_inbox()
        for seq, message in sched.poll_loads():
            self._finish(seq, FinishReason.ERROR, message)
        for seq, message in sched.admit():
            self._finish(seq, FinishReason.ERROR, message)
        worked = self._prefill_step()
        worked = self._decode_step() or worked
        self._update_counters()
        if worked:
            self.num_steps += 1
        else:
            self._wake.wait(self.config.load_poll_interval_s if sched.has_loads_in_flight else None)
            self._wake.clear()

    def _drain_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for item in inbox:
            if isinstance(item, Sequence):
                self._scheduler.add(item)
            else:
                seq = self._scheduler.get(item)
                if seq is not None:
                    self._finish(seq, FinishReason.ABORT, None)

    def _prefill_step(self) -> bool:
        seq = self._scheduler.next_prefill()
        if seq is None:
            return False
        n = seq.num_prompt_tokens
        try:
            batch = build_batch(
                [BatchItem(seq.prompt_ids[: n - 1], 0, seq.block_ids)], self.spec.block_size, self.device
            )
            self.model.forward(batch, self.cache, compute_logits=False)
        except Exception as e:
            logger.exception("%s: prefill failed", seq.request_id)
            self._finish(seq, FinishReason.ERROR, f"prefill failed: {type(e).__name__}: {e}")
            return True
        self._scheduler.prefilled(seq)
        return True

    def _decode_step(self) -> bool:
        seqs = self._scheduler.decode_batch()
        if not seqs:
            return False
        self.peak_decode_batch = max(self.peak_decode_batch, len(seqs))
        try:
            items = [BatchItem([s.token_at(s.num_computed_tokens)], s.num_computed_tokens, s.block_ids) for s in seqs]
            logits = self.model.forward(build_batch(items, self.spec.block_size, self.device), self.cache)
            assert logits is not None
            logits = logits.cpu()
        except Exception as e:
            logger.exception("decode step of %d requests failed", len(seqs))
            for s in seqs:
                self._finish(s, FinishReason.ERROR, f"decode failed: {type(e).__name__}: {e}")
            return True
        for row, seq in enumerate(seqs):
            seq.num_computed_tokens += 1
            token, logprob = sample(logits[row, GENERATED_FIRST:], seq.sampling, seq.generator)
            token += GENERATED_FIRST  # (the model speaks in words: tokenizer.py)
            seq.output_ids.append(token)
            if token in seq.stop_ids:
                self._finish(seq, FinishReason.STOP, None)
                continue
            self._emit(
                seq,
                TokenEvent(
                    seq.request_id,
                    token,
                    logprob,
                    num_prompt_tokens=seq.num_prompt_tokens,
                    num_output_tokens=len(seq.output_ids),
                ),
            )
            if len(seq.output_ids) >= seq.max_new_tokens:
                self._finish(seq, FinishReason.LENGTH, None)
        return True

    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None) -> None:
        self._scheduler.release(seq, reason)
        with self._lock:
            self._live_ids.discard(seq.request_id)
        self._emit(
            seq, TokenEvent(seq.request_id, None, None, reason, error, seq.num_prompt_tokens, len(seq.output_ids))
        )

    def _emit(self, seq: Sequence, event: TokenEvent) -> None:
        try:
            seq.on_event(event)
        except Exception:
            logger.exception("%s: on_event raised", seq.request_id)

    def _update_counters(self) -> None:
        sched = self._scheduler
        self.num_running = sched.num_running
        self.num_waiting = sched.num_waiting
        self.num_loading = sched.num_loading

    def _shutdown(self) -> None:
        with self._lock:
            self._accepting = False
            inbox, self._inbox = self._inbox, []
        for item in inbox:
            if isinstance(item, Sequence):
                self._scheduler.add(item)
        for seq in self._scheduler.live():
            self._finish(seq, FinishReason.ABORT, "engine stopped")
        if self._scheduler.draining:
            logger.warning(
                "engine stopped with %d KV loads in flight; their blocks stay allocated", len(self._scheduler.draining)
            )
        self._update_counters()

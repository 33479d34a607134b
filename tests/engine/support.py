"""Shared helpers of the engine tests: event collection with deadlines, small configs, a dense
(no-cache) reference forward, and in-process KVKeeper/KVLoader implementations that copy blocks
between two engines' caches through `cache.kv(layer)` views."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from kvconnect.core.errors import KVConnectError
from kvconnect.core.plan.layout import LayoutKind
from kvconnect.engine import Engine, EngineConfig, ModelConfig, SamplingParams, TokenEvent
from kvconnect.engine.model import LlamaModel, apply_rope, rms_norm

DEADLINE_S = 30.0
LAYOUTS = list(LayoutKind)


def small_config(layout: LayoutKind = LayoutKind.BLOCKS_FIRST, **kw: object) -> EngineConfig:
    kw.setdefault("num_blocks", 96)
    kw.setdefault("model", ModelConfig(max_position=512))
    return EngineConfig(layout=layout, **kw)  # type: ignore[arg-type]


def wait_until(predicate: Callable[[], bool], timeout_s: float = DEADLINE_S, what: str = "condition") -> None:
    """Poll `predicate` until true or the deadline passes (then fail)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.001)


class Collector:
    """An `on_event` callback that records events and signals the final one."""

    def __init__(self) -> None:
        self.events: list[TokenEvent] = []
        self._done = threading.Event()

    def __call__(self, event: TokenEvent) -> None:
        assert not self._done.is_set(), f"event after the final one: {event}"
        self.events.append(event)
        if event.finished:
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float = DEADLINE_S) -> Collector:
        assert self._done.wait(timeout_s), f"request did not finish within {timeout_s} s: {self.events[-3:]}"
        return self

    @property
    def tokens(self) -> list[int]:
        return [e.token_id for e in self.events if e.token_id is not None]

    @property
    def logprobs(self) -> list[float]:
        return [e.logprob for e in self.events if e.token_id is not None]  # type: ignore[misc]

    @property
    def final(self) -> TokenEvent:
        assert self.done
        return self.events[-1]


def submit(engine: Engine, request_id: str, prompt_ids: list[int], max_tokens: int, **kw: object) -> Collector:
    sampling = kw.pop("sampling", None) or SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    collector = Collector()
    engine.add_request(request_id, prompt_ids, sampling, collector, **kw)  # type: ignore[arg-type]
    return collector


def generate(
    engine: Engine, prompt_ids: list[int], max_tokens: int, request_id: str = "req", **kw: object
) -> Collector:
    return submit(engine, request_id, prompt_ids, max_tokens, **kw).wait()


def prompt(i: int, length: int) -> list[int]:
    """A reproducible prompt: BOS then `length - 1` pseudo-random bytes."""
    gen = torch.Generator().manual_seed(1000 + i)
    return [256, *torch.randint(0, 256, (length - 1,), generator=gen).tolist()]


# --- dense reference ---------------------------------------------------------------------------------


def dense_logits(model: LlamaModel, token_ids: list[int], kv_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Logits (T, vocab) of a plain causal forward over the whole sequence, no cache, in float64
    (K and V rounded through the cache dtype, as the paged path stores them)."""
    c = model.config
    f64 = torch.float64
    ids = torch.tensor(token_ids)
    t = len(token_ids)
    x = model.embed[ids].to(f64)
    cos, sin = model.cos[:t].to(f64), model.sin[:t].to(f64)
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    for lw in model.layers:
        qkv = rms_norm(x, lw.attn_norm.to(f64), c.rms_norm_eps) @ lw.wqkv.to(f64).T
        q = apply_rope(qkv[:, :q_dim].reshape(t, c.num_heads, c.head_dim), cos, sin)
        k = apply_rope(qkv[:, q_dim : q_dim + kv_dim].reshape(t, c.num_kv_heads, c.head_dim), cos, sin)
        v = qkv[:, q_dim + kv_dim :].reshape(t, c.num_kv_heads, c.head_dim)
        k, v = k.to(kv_dtype).to(f64), v.to(kv_dtype).to(f64)
        group = c.num_heads // c.num_kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        attn = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
        ).transpose(0, 1)
        x = x + attn.reshape(t, q_dim) @ lw.wo.to(f64).T
        gate, up = (rms_norm(x, lw.mlp_norm.to(f64), c.rms_norm_eps) @ lw.w_gate_up.to(f64).T).chunk(2, -1)
        x = x + (torch.nn.functional.silu(gate) * up) @ lw.w_down.to(f64).T
    return rms_norm(x, model.final_norm.to(f64), c.rms_norm_eps) @ model.lm_head.to(f64).T


# --- in-process P/D hooks ----------------------------------------------------------------------------


class RecordingKeeper:
    """A KVKeeper that records what it was offered and keeps it when `accept` says so."""

    def __init__(self, accept: bool = True, raises: bool = False) -> None:
        self.accept = accept
        self.raises = raises
        self.kept: dict[str, tuple[list[int], int]] = {}

    def keep(self, request_id: str, block_ids: list[int], num_prompt_tokens: int) -> bool:
        if self.raises:
            raise RuntimeError("keeper failed")
        self.kept[request_id] = (list(block_ids), num_prompt_tokens)
        return self.accept


class CopyHandle:
    def __init__(self, loader: CopyLoader, dst_block_ids: list[int]) -> None:
        self.loader = loader
        self.dst_block_ids = dst_block_ids
        self.num_polls = 0
        self.finished = False

    def poll(self) -> bool | None:
        lo = self.loader
        self.num_polls += 1
        if not lo.gate.is_set() or self.num_polls <= lo.polls_before_done:
            return None
        self.finished = True
        if lo.error is not None:
            raise lo.error
        src_ids = torch.tensor(lo.src_block_ids[: len(self.dst_block_ids)])
        dst_ids = torch.tensor(self.dst_block_ids)
        for layer in range(lo.dst.spec.num_layers):
            for src_view, dst_view in zip(lo.src.cache.kv(layer), lo.dst.cache.kv(layer), strict=True):
                dst_view[dst_ids] = src_view[src_ids]
        if lo.free_source:
            lo.src.allocator.free(lo.src_block_ids)  # the "notification": the prefill side lets go
        return True


class CopyLoader:
    """A KVLoader that copies `src_block_ids` of engine `src` into the blocks engine `dst` gives it,
    layer by layer through `cache.kv()` views (so any two layouts work), after `polls_before_done`
    polls and once `gate` is set; or raises `error` (at poll, or at start with `fail_at_start`)."""

    def __init__(
        self,
        src: Engine,
        dst: Engine,
        src_block_ids: list[int],
        *,
        policy: str = "fail",
        polls_before_done: int = 2,
        error: KVConnectError | None = None,
        fail_at_start: bool = False,
        free_source: bool = True,
    ) -> None:
        self.src, self.dst, self.src_block_ids = src, dst, list(src_block_ids)
        self.policy = policy
        self.polls_before_done = polls_before_done
        self.error = error
        self.fail_at_start = fail_at_start
        self.free_source = free_source
        self.gate = threading.Event()
        self.gate.set()
        self.started: list[tuple[str, list[int], int]] = []
        self.handles: list[CopyHandle] = []

    def start(self, request_id: str, block_ids: list[int], num_prompt_tokens: int) -> CopyHandle:
        self.started.append((request_id, list(block_ids), num_prompt_tokens))
        if self.fail_at_start and self.error is not None:
            raise self.error
        handle = CopyHandle(self, list(block_ids))
        self.handles.append(handle)
        return handle

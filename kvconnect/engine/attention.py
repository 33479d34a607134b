"""Paged attention over a `KVCache`: the packed batch, K/V writes through the slot mapping, attention.

A batch packs the new tokens of several sequences row after row; each sequence carries its block table
and its length in the cache after this step. K/V of the new tokens are written into the cache first,
then every query attends to its own sequence's keys read back *from the cache* through the block table
(so a prefix that another worker wrote into our blocks behaves exactly like one we computed).

Backends: a torch reference that works on every device, dtype and block size, and flash-attn's
`flash_attn_with_kvcache` (paged, `block_table`) on CUDA when it imports, the dtypes are 16-bit and the
block size is a multiple of 256 (upstream FA2's limit). Both compute one sequence per kernel call, so a
sequence's result never depends on which others share the batch.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvconnect.core.errors import ConfigError, LocalError

logger = logging.getLogger(__name__)

FA2_BLOCK_MULTIPLE = 256
_logged_choices: set[tuple[str, str]] = set()


class PagedBatchError(LocalError):
    """A batch asks for cache slots its sequence's blocks do not cover."""


class AttentionBackend(str, enum.Enum):
    REFERENCE = "reference"
    FLASH_ATTN = "flash_attn"


@dataclass(frozen=True)
class BatchItem:
    """One sequence's share of a step: its new tokens, where they start, and its blocks."""

    token_ids: Sequence[int]
    start_position: int  # tokens of this sequence already in the cache
    block_ids: Sequence[int]


@dataclass(frozen=True)
class SeqSlice:
    query_start: int  # first row of this sequence in the packed batch
    query_len: int
    seq_len: int  # tokens in the cache once this step's K/V are written
    block_table: torch.Tensor  # (blocks covering seq_len,) int64

    @property
    def rows(self) -> tuple[int, int]:
        return self.query_start, self.query_start + self.query_len


@dataclass(frozen=True)
class PagedBatch:
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    slot_block_ids: torch.Tensor  # (T,) int64: where each new token's K/V go
    slot_offsets: torch.Tensor  # (T,) int64
    seqs: tuple[SeqSlice, ...]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def segments(self) -> list[tuple[int, int]]:
        return [s.rows for s in self.seqs]

    @property
    def last_rows(self) -> list[int]:
        return [s.query_start + s.query_len - 1 for s in self.seqs]


def build_batch(items: Sequence[BatchItem], block_size: int, device: torch.device | str) -> PagedBatch:
    input_ids: list[int] = []
    positions: list[int] = []
    slot_blocks: list[int] = []
    slot_offsets: list[int] = []
    seqs = []
    for item in items:
        n_new = len(item.token_ids)
        seq_len = item.start_position + n_new
        n_blocks = -(-seq_len // block_size)
        if n_new < 1 or item.start_position < 0 or n_blocks > len(item.block_ids):
            raise PagedBatchError(
                f"{n_new} new tokens at position {item.start_position} need {n_blocks} blocks of "
                f"{block_size}, the sequence holds {len(item.block_ids)}"
            )
        seqs.append(
            SeqSlice(
                len(input_ids),
                n_new,
                seq_len,
                torch.tensor(list(item.block_ids[:n_blocks]), dtype=torch.int64, device=device),
            )
        )
        for i, tok in enumerate(item.token_ids):
            pos = item.start_position + i
            input_ids.append(int(tok))
            positions.append(pos)
            slot_blocks.append(int(item.block_ids[pos // block_size]))
            slot_offsets.append(pos % block_size)

    def as_tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return PagedBatch(
        as_tensor(input_ids), as_tensor(positions), as_tensor(slot_blocks), as_tensor(slot_offsets), tuple(seqs)
    )


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: PagedBatch) -> None:
    """Store the new tokens' K/V (T, H_kv, D) into (num_blocks, block_size, H_kv, D) cache views."""
    k_cache[batch.slot_block_ids, batch.slot_offsets] = k.to(k_cache.dtype)
    v_cache[batch.slot_block_ids, batch.slot_offsets] = v.to(v_cache.dtype)


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, seq: SeqSlice) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `seq.seq_len` keys and values of one sequence, (S, H_kv, D) each, read via its blocks."""
    _, block_size, h_kv, d = k_cache.shape
    k = k_cache[seq.block_table].reshape(-1, h_kv, d)[: seq.seq_len]
    v = v_cache[seq.block_table].reshape(-1, h_kv, d)[: seq.seq_len]
    return k, v


def aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` itself if contiguous and 64-byte aligned, else a fresh copy: BLAS reductions may group
    differently for differently aligned inputs, and batch invariance must not hinge on a row's offset."""
    if t.is_contiguous() and t.data_ptr() % 64 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _reference_one(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq: SeqSlice, scale: float
) -> torch.Tensor:
    k, v = gather_kv(k_cache, v_cache, seq)
    k, v = k.to(q.dtype), v.to(q.dtype)
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.transpose(0, 1), k.permute(1, 2, 0)) * scale  # (H, Tq, S)
    t_q, s = q.shape[0], seq.seq_len
    if t_q > 1:  # query i sits at position s - t_q + i and sees keys [0, that position]
        allowed = torch.ones(t_q, s, dtype=torch.bool, device=q.device).tril(diagonal=s - t_q)
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs, v.transpose(0, 1)).transpose(0, 1)  # (Tq, H, D)


def _flash_one(
    fn: Callable[..., Any], q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq: SeqSlice, scale: float
) -> torch.Tensor:
    out = fn(
        q.unsqueeze(0),
        k_cache,
        v_cache,
        cache_seqlens=torch.tensor([seq.seq_len], dtype=torch.int32, device=q.device),
        block_table=seq.block_table.to(torch.int32).unsqueeze(0),
        # num_splits=1: no split-KV, whose heuristic would make the result depend on the batch
        softmax_scale=scale,
        causal=True,
        num_splits=1,
    )
    return out.squeeze(0)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedBatch,
    *,
    scale: float,
    flash_kernel: Callable[..., Any] | None = None,
) -> torch.Tensor:
    """Causal attention of the batch's queries (T, H_q, D) over their sequences' cached K/V -> (T, H_q, D).

    `flash_kernel` is `flash_attn_kernel()` when the FLASH_ATTN backend was selected, else None.
    """
    fn = flash_kernel
    outs = []
    for seq in batch.seqs:
        start, end = seq.rows
        q_seq = aligned(q[start:end])
        if fn is not None:
            outs.append(_flash_one(fn, q_seq, k_cache, v_cache, seq, scale))
        else:
            outs.append(_reference_one(q_seq, k_cache, v_cache, seq, scale))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def flash_attn_kernel() -> Callable[..., Any] | None:
    try:
        from flash_attn import flash_attn_with_kvcache  # optional; only ever on CUDA
    except Exception:  # ImportError, or a wheel built against another CUDA/torch
        return None
    return flash_attn_with_kvcache  # type: ignore[no-any-return]


def select_backend(
    requested: str, *, device_kind: str, dtype: torch.dtype, kv_cache_dtype: torch.dtype, block_size: int
) -> AttentionBackend:
    """Pick the attention path for an engine and log the choice (once per process and reason)."""
    reason = "requested"
    if requested == "reference":
        chosen = AttentionBackend.REFERENCE
    else:
        problems = []
        if device_kind != "cuda":
            problems.append("device is not CUDA")
        elif flash_attn_kernel() is None:
            problems.append("flash_attn is not importable")
        if block_size % FA2_BLOCK_MULTIPLE:
            problems.append(f"block_size {block_size} is not a multiple of {FA2_BLOCK_MULTIPLE} (FA2)")
        if dtype not in (torch.float16, torch.bfloat16) or kv_cache_dtype != dtype:
            problems.append(f"dtypes {dtype}/{kv_cache_dtype} are not one shared 16-bit float type")
        if problems and requested == "flash_attn":
            raise ConfigError("attention_backend flash_attn is unusable: " + "; ".join(problems))
        chosen = AttentionBackend.REFERENCE if problems else AttentionBackend.FLASH_ATTN
        reason = "; ".join(problems) if problems else "available"
    if (chosen.value, reason) not in _logged_choices:
        _logged_choices.add((chosen.value, reason))
        logger.info("paged attention: %s (%s)", chosen.value, reason)
    return chosen

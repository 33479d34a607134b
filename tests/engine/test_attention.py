"""Paged attention through block tables equals dense attention over the same K/V, in every layout."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvconnect.core.cache import KVCache
from kvconnect.core.errors import ConfigError
from kvconnect.core.plan.layout import CacheSpec, LayoutKind
from kvconnect.engine.attention import (
    AttentionBackend,
    BatchItem,
    PagedBatchError,
    build_batch,
    gather_kv,
    paged_attention,
    select_backend,
    write_kv,
)

from .support import LAYOUTS

BLOCK = 8
H_Q, H_KV, D = 4, 2, 16
# (sequence length after the step, new query tokens): decode rows, whole prefills, partial prefills,
# lengths on and off block boundaries
SEQS = [(1, 1), (5, 5), (8, 3), (17, 1), (40, 40), (33, 7), (16, 1)]


def make_case(layout: LayoutKind, kv_dtype: str, seed: int = 0):
    spec = CacheSpec(
        kind=layout, dtype=kv_dtype, num_layers=2, num_blocks=64, block_size=BLOCK, num_kv_heads=H_KV, head_dim=D
    )
    cache = KVCache.allocate(spec)
    cache.fill_pattern(seed)  # garbage (NaNs included) everywhere a sequence must not read
    gen = torch.Generator().manual_seed(seed)
    free = torch.randperm(64, generator=gen).tolist()  # scattered block ids
    seqs = []
    for seq_len, q_len in SEQS:
        n_blocks = -(-seq_len // BLOCK)
        blocks, free = free[:n_blocks], free[n_blocks:]
        k = torch.randn(seq_len, H_KV, D, generator=gen)
        v = torch.randn(seq_len, H_KV, D, generator=gen)
        q = torch.randn(q_len, H_Q, D, generator=gen)
        seqs.append((blocks, k, v, q))
    return cache, seqs


def write_all(cache: KVCache, layer: int, seqs) -> None:
    k_cache, v_cache = cache.kv(layer)
    for blocks, k, v, _ in seqs:
        batch = build_batch([BatchItem([0] * k.shape[0], 0, blocks)], BLOCK, "cpu")
        write_kv(k_cache, v_cache, k, v, batch)


def query_batch(seqs):
    return build_batch(
        [BatchItem([0] * q.shape[0], k.shape[0] - q.shape[0], blocks) for blocks, k, _, q in seqs], BLOCK, "cpu"
    )


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    t_q, s = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    mask = torch.ones(t_q, s, dtype=torch.bool).tril(diagonal=s - t_q)
    out = F.scaled_dot_product_attention(
        q.double().transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_paged_equals_dense(layout: LayoutKind, kv_dtype: str) -> None:
    cache, seqs = make_case(layout, kv_dtype)
    write_all(cache, 1, seqs)
    k_cache, v_cache = cache.kv(1)
    batch = query_batch(seqs)
    q_all = torch.cat([q for *_, q in seqs])
    out = paged_attention(q_all, k_cache, v_cache, batch, scale=D**-0.5)
    assert out.shape == q_all.shape and torch.isfinite(out).all()
    cache_dtype = k_cache.dtype
    for (_, k, v, q), s in zip(seqs, batch.seqs, strict=True):
        k_stored, v_stored = k.to(cache_dtype), v.to(cache_dtype)
        got_k, got_v = gather_kv(k_cache, v_cache, s)
        assert torch.equal(got_k, k_stored) and torch.equal(got_v, v_stored)
        want = dense(q, k_stored.float(), v_stored.float())
        a, b = s.rows
        torch.testing.assert_close(out[a:b].double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_writes_touch_only_their_layer_and_slots(layout: LayoutKind) -> None:
    cache, seqs = make_case(layout, "float32")
    before = cache.logical().view(torch.int32).clone()  # compare bits: the garbage holds NaNs
    write_all(cache, 1, seqs)
    after = cache.logical().view(torch.int32)
    changed = (after != before).nonzero()
    assert changed.shape[0] > 0
    assert set(changed[:, 1].tolist()) == {1}, "a write leaked into another layer"
    written = {
        (b, off) for blocks, k, *_ in seqs for b, off in ((blocks[p // BLOCK], p % BLOCK) for p in range(k.shape[0]))
    }
    assert {(int(r[0]), int(r[3])) for r in changed} <= written, "a write landed outside its slots"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_sequence_is_independent_of_the_batch(layout: LayoutKind) -> None:
    cache, seqs = make_case(layout, "float32", seed=3)
    write_all(cache, 0, seqs)
    k_cache, v_cache = cache.kv(0)
    batch = query_batch(seqs)
    together = paged_attention(torch.cat([q for *_, q in seqs]), k_cache, v_cache, batch, scale=0.25)
    for i, (s, item) in enumerate(zip(batch.seqs, seqs, strict=True)):
        alone = paged_attention(item[3], k_cache, v_cache, query_batch([item]), scale=0.25)
        a, b = s.rows
        assert torch.equal(together[a:b], alone), f"sequence {i} changed with its batch"


def test_batch_needs_enough_blocks() -> None:
    with pytest.raises(PagedBatchError):
        build_batch([BatchItem([1, 2, 3], 14, [0])], BLOCK, "cpu")  # positions 14..16 need 3 blocks
    with pytest.raises(PagedBatchError):
        build_batch([BatchItem([], 0, [0])], BLOCK, "cpu")
    batch = build_batch([BatchItem([1, 2, 3], 7, [5, 9])], BLOCK, "cpu")
    assert batch.slot_block_ids.tolist() == [5, 9, 9]
    assert batch.slot_offsets.tolist() == [7, 0, 1]
    assert batch.positions.tolist() == [7, 8, 9]
    assert batch.seqs[0].seq_len == 10


def test_backend_selection_on_cpu() -> None:
    def pick(requested: str) -> AttentionBackend:
        return select_backend(
            requested, device_kind="cpu", dtype=torch.bfloat16, kv_cache_dtype=torch.bfloat16, block_size=256
        )

    assert pick("auto") is AttentionBackend.REFERENCE
    assert pick("reference") is AttentionBackend.REFERENCE
    with pytest.raises(ConfigError, match="not CUDA"):
        pick("flash_attn")

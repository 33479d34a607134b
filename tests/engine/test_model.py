"""The model over the paged cache: equal to a dense no-cache forward, bitwise independent of the
batch it shares a step with, and bitwise the same in every cache layout."""

from __future__ import annotations

import pytest
import torch

from kvconnect.core.cache import KVCache
from kvconnect.core.plan.layout import CacheSpec, LayoutKind
from kvconnect.engine import ModelConfig
from kvconnect.engine.attention import BatchItem, build_batch
from kvconnect.engine.model import LlamaModel

from .support import LAYOUTS, dense_logits, prompt

BLOCK = 16
CONFIG = ModelConfig(max_position=512)


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return LlamaModel(CONFIG)


def new_cache(layout: LayoutKind = LayoutKind.BLOCKS_FIRST, dtype: str = "float32") -> KVCache:
    spec = CacheSpec(
        kind=layout,
        dtype=dtype,
        num_layers=CONFIG.num_layers,
        num_blocks=64,
        block_size=BLOCK,
        num_kv_heads=CONFIG.num_kv_heads,
        head_dim=CONFIG.head_dim,
    )
    return KVCache.allocate(spec)


class Seq:
    """A sequence driven the engine's way: prefill [0, n-1) alone, then one token per decode step."""

    def __init__(self, ids: list[int], block_ids: list[int]) -> None:
        self.ids = list(ids)
        self.block_ids = block_ids
        self.num_computed = 0

    def prefill(self, model: LlamaModel, cache: KVCache) -> None:
        n = len(self.ids) - 1
        model.forward(
            build_batch([BatchItem(self.ids[:n], 0, self.block_ids)], BLOCK, "cpu"), cache, compute_logits=False
        )
        self.num_computed = n

    def item(self) -> BatchItem:
        return BatchItem([self.ids[self.num_computed]], self.num_computed, self.block_ids)


def decode(model: LlamaModel, cache: KVCache, seqs: list[Seq], *, advance: bool = True) -> torch.Tensor:
    logits = model.forward(build_batch([s.item() for s in seqs], BLOCK, "cpu"), cache)
    assert logits is not None and logits.dtype == torch.float32
    if advance:
        for s, row in zip(seqs, logits, strict=True):
            s.num_computed += 1
            s.ids.append(int(row.argmax()))
    return logits


def blocks(i: int, n: int = 4) -> list[int]:
    return [(7 * (i * n + j)) % 64 for j in range(n)]  # scattered, distinct for i < 16


def test_paged_prefill_and_decode_match_dense_forward(model: LlamaModel) -> None:
    cache = new_cache()
    seq = Seq(prompt(0, 21), blocks(0))
    seq.prefill(model, cache)
    for _ in range(14):  # crosses into the third block
        context = list(seq.ids)
        logits = decode(model, cache, [seq])[0]
        want = dense_logits(model, context)[-1]
        torch.testing.assert_close(logits.double(), want, atol=2e-4, rtol=1e-4)
        assert seq.ids[-1] == int(want.argmax())
    assert len(set(seq.ids[21:])) > 1, "the demo model should not be constant"


def test_prefill_logits_match_dense_on_every_row(model: LlamaModel) -> None:
    ids = prompt(1, 37)
    cache = new_cache(LayoutKind.KV_FIRST)
    batch = build_batch([BatchItem(ids, 0, blocks(1))], BLOCK, "cpu")
    last = model.forward(batch, cache)
    assert last is not None
    torch.testing.assert_close(last[0].double(), dense_logits(model, ids)[-1], atol=2e-4, rtol=1e-4)


def test_bfloat16_cache_matches_dense_with_rounded_kv(model: LlamaModel) -> None:
    cache = new_cache(dtype="bfloat16")
    seq = Seq(prompt(2, 19), blocks(2))
    seq.prefill(model, cache)
    context = list(seq.ids)
    logits = decode(model, cache, [seq])[0]
    torch.testing.assert_close(logits.double(), dense_logits(model, context, torch.bfloat16)[-1], atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_decode_is_bitwise_independent_of_the_batch(model: LlamaModel, layout: LayoutKind) -> None:
    cache = new_cache(layout)
    lengths = [9, 17, 30, 2, 45, 13, 16, 24]
    seqs = [Seq(prompt(10 + i, length), blocks(i)) for i, length in enumerate(lengths)]
    for s in seqs:
        if len(s.ids) > 1:
            s.prefill(model, cache)
    target = seqs[0]
    for step in range(3):
        alone = decode(model, cache, [target], advance=False)[0]
        kv_alone = cache.logical()[target.block_ids].clone()
        others = seqs[1:]
        for batch in ([*others[:2], target, others[2]], [target, *others], [*others, target]):
            logits = decode(model, cache, batch, advance=False)
            row = logits[batch.index(target)]
            assert torch.equal(row.view(torch.int32), alone.view(torch.int32)), f"step {step}: logits differ"
            assert torch.equal(cache.logical()[target.block_ids], kv_alone), f"step {step}: K/V differ"
        decode(model, cache, seqs)  # everyone advances one token together


def test_every_layout_computes_the_same_bits(model: LlamaModel) -> None:
    results = []
    for layout in LAYOUTS:
        cache = new_cache(layout)
        seqs = [Seq(prompt(20 + i, length), blocks(i)) for i, length in enumerate([5, 18, 33])]
        for s in seqs:
            s.prefill(model, cache)
        logits = torch.stack([decode(model, cache, seqs) for _ in range(6)])
        used = sorted(b for s in seqs for b in s.block_ids)
        results.append((logits, cache.logical()[used], [s.ids for s in seqs]))
    for logits, kv, ids in results[1:]:
        assert ids == results[0][2]
        assert torch.equal(logits, results[0][0])
        assert torch.equal(kv, results[0][1])


def test_weights_are_a_function_of_the_seed() -> None:
    a, b = LlamaModel(CONFIG), LlamaModel(CONFIG)
    c = LlamaModel(ModelConfig(max_position=512, seed=1))
    assert torch.equal(a.layers[2].w_down, b.layers[2].w_down) and torch.equal(a.lm_head, b.lm_head)
    assert not torch.equal(a.lm_head, c.lm_head)

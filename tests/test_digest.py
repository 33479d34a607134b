"""The KV digest (kv_digest; core/digest.py): the same content gives the same sums in every layout and token
order, and any change of a byte, or of which block sits where, changes the digest."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconnect.core.cache import KVCache
from kvconnect.core.digest import applies, block_sums, digest
from kvconnect.core.plan.layout import CacheSpec, LayoutKind


def cache_of(kind: LayoutKind, token_layout: str, logical: torch.Tensor, dtype: str = "float16") -> KVCache:
    """A cache of `kind` holding `logical` ((blocks, layers, 2, block_size, H, D), NHD) in its own layout."""
    blocks, layers, _, bs, heads, dim = logical.shape
    spec = CacheSpec(
        kind=kind,
        dtype=dtype,
        num_layers=layers,
        num_blocks=blocks,
        block_size=bs,
        num_kv_heads=heads,
        head_dim=dim,
        token_layout=token_layout,
    )
    cache = KVCache.allocate(spec)
    for layer in range(layers):
        k, v = cache.kv(layer)  # (NHD views also of an HND cache)
        k.copy_(logical[:, layer, 0])
        v.copy_(logical[:, layer, 1])
    return cache


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), head_dim=st.sampled_from([4, 6, 8, 64]), heads=st.integers(1, 3))
def test_every_layout_and_token_order_gives_the_same_sums(seed: int, head_dim: int, heads: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    logical = torch.randint(-(2**15), 2**15, (6, 2, 2, 4, heads, head_dim), generator=gen, dtype=torch.int16)
    logical = logical.view(torch.float16)
    ids = [5, 0, 3]
    sums = {(kind, tl): block_sums(cache_of(kind, tl, logical), ids) for kind in LayoutKind for tl in ("NHD", "HND")}
    assert len(set(map(tuple, sums.values()))) == 1, sums  # (head_dim 6 fp16 = 12 bytes: the byte-wise path)


def test_one_changed_byte_or_two_swapped_blocks_change_the_digest() -> None:
    logical = torch.randn(8, 3, 2, 16, 2, 32, generator=torch.Generator().manual_seed(3)).half()
    cache = cache_of(LayoutKind.CROSS_LAYER, "NHD", logical)
    ids = [1, 4, 6]
    before = digest(block_sums(cache, ids))
    assert digest(block_sums(cache, [1, 6, 4])) != before  # the order of the blocks counts
    cache.regions[0].view(torch.uint8)[4].view(-1)[1234] ^= 1  # one bit of block 4
    assert digest(block_sums(cache, ids)) != before
    assert len(before) == 16 and digest([]) != digest([0])


def test_layers_swapped_k_and_v_swapped_or_tokens_reordered_change_the_sums() -> None:
    """Security review: the digest was a plain sum of words, so a byte path that reversed the layers and
    swapped K with V passed the check: the bug class it exists for. Every word is now weighted by its
    canonical position."""
    logical = torch.randn(4, 3, 2, 16, 2, 32, generator=torch.Generator().manual_seed(11)).half()
    ids = [0, 2]
    want = block_sums(cache_of(LayoutKind.BLOCKS_FIRST, "NHD", logical), ids)
    for name, moved in {
        "layers reversed, K and V swapped": logical.flip(1).flip(2),
        "layers reversed": logical.flip(1),
        "K and V swapped": logical.flip(2),
        "two tokens swapped": logical[:, :, :, [1, 0, *range(2, 16)]],
        "two heads swapped": logical.flip(4),
    }.items():
        assert block_sums(cache_of(LayoutKind.BLOCKS_FIRST, "NHD", moved), ids) != want, name


def test_engine_pages_are_summed_whole() -> None:
    spec = CacheSpec(
        kind=LayoutKind.BLOCKS_FIRST,
        dtype="bfloat16",
        num_layers=2,
        num_blocks=4,
        block_size=16,
        num_kv_heads=2,
        head_dim=64,
        page="vllm:cpu-vec",
    )
    cache = KVCache.allocate(spec)
    cache.fill_pattern(9)
    sums = block_sums(cache, [2, 3])

    def weighted(b: int) -> int:  # words times odd weights from (layer, word in the page), modulo 2**64
        total = 0
        for layer, region in enumerate(cache.regions):
            words = region[b].numpy().view(np.int64)
            n = words.size
            for i, w in enumerate(words.tolist()):
                total += w * ((((layer * n + i) * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) % 2**64) | 1)
        return ((total + 2**63) % 2**64) - 2**63  # as a signed int64

    assert sums == [weighted(2), weighted(3)]


@pytest.mark.parametrize(
    ("change", "ok"),
    [
        ({}, True),
        ({"block_size": 32}, False),
        ({"num_kv_heads": 1}, False),
        ({"kind": LayoutKind.KV_FIRST, "token_layout": "HND"}, True),
    ],
)
def test_applies_only_where_a_block_holds_one_remote_blocks_words(change: dict, ok: bool) -> None:
    base = CacheSpec(
        kind=LayoutKind.CROSS_LAYER,
        dtype="float16",
        num_layers=2,
        num_blocks=4,
        block_size=16,
        num_kv_heads=2,
        head_dim=64,
    )
    other = CacheSpec(**{**{f: getattr(base, f) for f in base.__struct_fields__}, **change})
    assert applies(base, other, True, True) is ok
    assert not applies(base, base, False, True) and not applies(base, base, True, False)

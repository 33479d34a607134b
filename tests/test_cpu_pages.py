"""vLLM CPU pages of different block sizes: the plan's descriptors, applied to caches laid out as vLLM's CPU
attention lays out each instruction set's pages (as `kvconnect/core/plan/cpu_pages.py` describes them), rebuild
every token's K and V in the decode's layout. The real-vLLM check of the same layouts is tests/test_vllm_block_ratio.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvconnect.core.errors import InvalidRequestError, LayoutMismatchError
from kvconnect.core.plan.descriptors import token_span
from kvconnect.core.plan.hetero import ReadPath, plan_source, plan_sources
from kvconnect.core.plan.layout import CacheSpec, LayoutKind

LAYERS, HEADS, HEAD_DIM = 2, 4, 32
DTYPES = {"vllm:cpu-vec": ("float32", np.float32), "vllm:cpu-amx": ("bfloat16", np.uint16)}
REGION_BITS = 40  # fake base addresses: region r starts at r << REGION_BITS


def spec(page: str, block: int, num_blocks: int, tp: int = 1, rank: int = 0) -> CacheSpec:
    return CacheSpec(
        kind=LayoutKind.BLOCKS_FIRST,
        dtype=DTYPES[page][0],
        num_layers=LAYERS,
        num_blocks=num_blocks,
        block_size=block,
        num_kv_heads=HEADS // tp,
        head_dim=HEAD_DIM,
        token_layout="HND",
        page=page,
        tp_size=tp,
        tp_rank=rank,
        total_kv_heads=HEADS,
    )


def index(page: str, block: int, kv: int, t: int, d: int) -> int:
    """Element index of K (kv 0) or V (kv 1) of token t, head-dim element d, inside one head's slab."""
    if page == "vllm:cpu-vec":
        return d * block + t if kv == 0 else block * HEAD_DIM + t * HEAD_DIM + d
    if kv == 0:  # amx: [B/16][hd/2][16 tokens][2 dims]
        return (t // 16) * 16 * HEAD_DIM + (d // 2) * 32 + (t % 16) * 2 + d % 2
    return block * HEAD_DIM + (d // 16) * 16 * block + (t // 2) * 32 + (d % 16) * 2 + t % 2  # [hd/16][B/2][16][2]


def lay_out(s: CacheSpec, ref: np.ndarray, ids: list[int], heads: tuple[int, int]) -> list[np.ndarray]:
    """Per layer, the cache's elements with the reference's tokens (ref[layer, kv, token, head, d]) written into
    blocks `ids`, heads `heads` of the spec's."""
    slab = 2 * s.block_size * HEAD_DIM
    cache = [np.zeros(s.num_blocks * s.num_kv_heads * slab, DTYPES[s.page][1]) for _ in range(LAYERS)]
    t = np.arange(ref.shape[2])
    for layer in range(LAYERS):
        for kv in range(2):
            for h in range(heads[0], heads[1]):
                for d in range(HEAD_DIM):
                    block = np.asarray(ids)[t // s.block_size]
                    where = (block * s.num_kv_heads + h - s.head_range()[0]) * slab
                    where = where + np.array([index(s.page, s.block_size, kv, x % s.block_size, d) for x in t])
                    cache[layer][where] = ref[layer, kv, :, h, d]
    return cache


def pulled(
    page: str, blocks: tuple[int, int], num_tokens: int, tp: tuple[int, int] = (1, 1), hit: int = 0
) -> tuple[int, bool]:
    """Pull `num_tokens` from a prefill of block size blocks[0] into a decode of blocks[1] whose prefix cache holds
    the first `hit` tokens (its blocks get the rest, read from the prefill's block holding token `hit`, from that
    token on): (descriptors, whether the decode's layout then holds every token past the hit of its heads as the
    prefill's held them, and nothing anywhere else)."""
    rng = np.random.default_rng(num_tokens)
    ref = rng.integers(1, 60000, (LAYERS, 2, num_tokens, HEADS, HEAD_DIM)).astype(DTYPES[page][1])
    local = spec(page, blocks[1], 32, tp[1])
    remote = spec(page, blocks[0], 48, tp[0])
    src = plan_sources(local, tp[0]).reads[0]
    plan = plan_source(local, remote, src)
    assert plan.path is ReadPath.DIRECT
    r_ids = list(range(47, 47 - remote.blocks_for_tokens(num_tokens), -1))  # (scattered, descending)
    l_ids = [3 + 2 * i for i in range(local.blocks_for_tokens(num_tokens - hit))]
    mem_r, mem_l = lay_out(remote, ref, r_ids, src.heads), lay_out(local, ref[:, :, hit:] * 0, l_ids, (0, 0))
    pair = plan.pair
    read = r_ids[hit // remote.block_size :]
    pull = pair.plan_validated(*pair.order_checked(l_ids, read), num_tokens - hit, hit % remote.block_size)
    bases = [layer << REGION_BITS for layer in range(LAYERS)]
    l_descs, r_descs = pair.local_descs(bases, 0), pair.remote_descs(bases, 0)
    isz = np.dtype(DTYPES[page][1]).itemsize
    for li, ri in zip(pull.local_indices, pull.remote_indices, strict=True):
        (la, n, _), (ra, _, _) = l_descs[li], r_descs[ri]
        lo, ro = (int(la) & ((1 << REGION_BITS) - 1)) // isz, (int(ra) & ((1 << REGION_BITS) - 1)) // isz
        mem_l[int(la) >> REGION_BITS][lo : lo + int(n) // isz] = mem_r[int(ra) >> REGION_BITS][ro : ro + int(n) // isz]
    want = lay_out(local, ref[:, :, hit:], l_ids, src.heads)
    return pull.num_descs, all(np.array_equal(a, b) for a, b in zip(mem_l, want, strict=True))


@pytest.mark.parametrize("page", sorted(DTYPES))
@pytest.mark.parametrize("blocks", [(32, 128), (128, 32), (64, 96), (96, 32)])
@pytest.mark.parametrize("num_tokens", [1, 31, 32, 33, 200, 257])
def test_a_pull_between_cpu_pages_of_different_block_sizes_rebuilds_every_token(page, blocks, num_tokens) -> None:
    descs, equal = pulled(page, blocks, num_tokens)
    assert equal
    pieces = HEAD_DIM if page == "vllm:cpu-vec" else HEAD_DIM // 16  # per (layer, head, K/V, 32-token segment)
    assert descs == LAYERS * HEADS * 2 * pieces * -(-num_tokens // 32)


@pytest.mark.parametrize("page", sorted(DTYPES))
@pytest.mark.parametrize(("blocks", "hit"), [((128, 32), 32), ((128, 32), 288), ((96, 32), 64), ((128, 64), 192)])
@pytest.mark.parametrize("num_tokens", [300, 385])
def test_a_prefix_hit_that_ends_inside_a_prefill_block_reads_that_block_from_the_token_after_it(
    page, blocks, hit, num_tokens
) -> None:
    descs, equal = pulled(page, blocks, num_tokens, hit=hit)
    assert equal
    pieces = HEAD_DIM if page == "vllm:cpu-vec" else HEAD_DIM // 16
    seg = math.gcd(*blocks)  # (tokens per segment)
    assert descs == LAYERS * HEADS * 2 * pieces * -(-(num_tokens - hit) // seg)


def test_an_offset_that_is_no_segment_start_is_refused_by_name() -> None:
    local, remote = spec("vllm:cpu-vec", 32, 8), spec("vllm:cpu-vec", 128, 8)
    pair = plan_source(local, remote, plan_sources(local, 1).reads[0]).pair
    for offset, why in ((16, "token 16 of a remote block is no segment start"), (128, "token 128")):
        with pytest.raises(InvalidRequestError, match=why):
            pair.plan_validated(*pair.order_checked([1, 2], [5, 6]), 40, offset)
    with pytest.raises(InvalidRequestError, match="cannot hold 100 tokens"):  # (96 of block 5's 128, then 0)
        pair.plan_validated(*pair.order_checked([1, 2, 3, 4], [5]), 100, 32)
    with pytest.raises(InvalidRequestError, match="do not hold the same tokens"):  # (no local block: no tokens)
        token_span(0, 32, 1, 128, None, 32)


def test_with_tensor_parallelism_as_well_each_rank_gets_its_heads() -> None:
    assert pulled("vllm:cpu-amx", (32, 128), 100, tp=(1, 2))[1]
    assert pulled("vllm:cpu-vec", (128, 32), 100, tp=(2, 1))[1]


def test_other_pages_stay_refused_by_name() -> None:
    for page, why in (("vllm:cpu-neon", "equal block sizes only"), ("vllm:cuda", "equal block sizes only")):
        local = CacheSpec(
            kind=LayoutKind.BLOCKS_FIRST,
            dtype="float16",
            num_layers=1,
            num_blocks=4,
            block_size=32,
            num_kv_heads=2,
            head_dim=32,
            token_layout="HND",
            page=page,
        )
        remote = CacheSpec(
            kind=LayoutKind.BLOCKS_FIRST,
            dtype="float16",
            num_layers=1,
            num_blocks=4,
            block_size=128,
            num_kv_heads=2,
            head_dim=32,
            token_layout="HND",
            page=page,
        )
        with pytest.raises(LayoutMismatchError, match=why):
            plan_source(local, remote, plan_sources(local, 1).reads[0])

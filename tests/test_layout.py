"""Layout math: an oracle executes every plan as memcpy and compares with dst[local] = src[remote]."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvconnect.core.cache import KVCache
from kvconnect.core.errors import InvalidRequestError, LayoutError, LayoutMismatchError
from kvconnect.core.plan.descriptors import PairPlan, strided_descriptor_array
from kvconnect.core.plan.layout import DTYPE_BYTES, CacheSpec, Granularity, LayoutKind, check_compatible
from tests.oracle import merge_runs, validated
from tests.oracle import plan as full_plan

KINDS = list(LayoutKind)


def spec(kind: LayoutKind, **kw: object) -> CacheSpec:
    base = dict(dtype="float16", num_layers=3, num_blocks=10, block_size=4, num_kv_heads=2, head_dim=8)
    base.update(kw)
    return CacheSpec(kind=kind, **base)  # type: ignore[arg-type]


@st.composite
def scenarios(draw: st.DrawFn):
    geometry = dict(
        dtype=draw(st.sampled_from(sorted(DTYPE_BYTES))),
        num_layers=draw(st.integers(1, 4)),
        block_size=draw(st.sampled_from([1, 2, 4, 16])),
        num_kv_heads=draw(st.integers(1, 3)),
        head_dim=draw(st.sampled_from([1, 2, 8])),
    )
    nb_local, nb_remote = draw(st.integers(1, 24)), draw(st.integers(1, 24))
    local = CacheSpec(kind=draw(st.sampled_from(KINDS)), num_blocks=nb_local, **geometry)
    remote = CacheSpec(kind=draw(st.sampled_from(KINDS)), num_blocks=nb_remote, **geometry)
    n = draw(st.integers(1, min(nb_local, nb_remote)))
    style = draw(st.sampled_from(["scattered", "sorted", "contiguous"]))
    if style == "contiguous":
        a, b = draw(st.integers(0, nb_local - n)), draw(st.integers(0, nb_remote - n))
        local_ids, remote_ids = list(range(a, a + n)), list(range(b, b + n))
    else:
        local_ids = draw(st.permutations(range(nb_local)))[:n]
        remote_ids = draw(st.permutations(range(nb_remote)))[:n]
        if style == "sorted":  # partly consecutive runs
            local_ids, remote_ids = sorted(local_ids), sorted(remote_ids)
    return local, remote, local_ids, remote_ids


def region_of(pair_units, num_blocks: int) -> np.ndarray:
    return np.repeat(pair_units.region, num_blocks)


def execute(pair: PairPlan, dst: KVCache, src: KVCache, local_ids, remote_ids):
    """Run the plan as memcpy; return the merged descriptors it executed."""
    plan = full_plan(pair, local_ids, remote_ids)
    ldesc, rdesc = pair.local_descs(dst.base_addrs(), 0), pair.remote_descs(src.base_addrs(), 0)
    lreg = region_of(pair.local_units, pair.local_spec.num_blocks)
    rreg = region_of(pair.remote_units, pair.remote_spec.num_blocks)
    d, s = merge_runs(
        ldesc[plan.local_indices], rdesc[plan.remote_indices], lreg[plan.local_indices], rreg[plan.remote_indices]
    )
    for (daddr, length, _), (saddr, _, _) in zip(d, s, strict=True):
        ctypes.memmove(int(daddr), int(saddr), int(length))
    return plan, d, s


def inside_regions(descs: np.ndarray, cache: KVCache) -> bool:
    bounds = [(a, a + cache.spec.region_bytes) for a in cache.base_addrs()]
    return all(any(lo <= a and a + n <= hi for lo, hi in bounds) for a, n, _ in descs)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_plan_executes_as_block_copy(scenario) -> None:
    local, remote, local_ids, remote_ids = scenario
    src, dst = KVCache.allocate(remote), KVCache.allocate(local)
    src.fill_pattern(7)
    pair = PairPlan.build(local, remote)
    plan, d, s = execute(pair, dst, src, local_ids, remote_ids)

    want = torch.zeros_like(dst.logical().view(torch.uint8))
    want[local_ids] = src.logical().view(torch.uint8)[remote_ids]
    assert torch.equal(dst.logical().view(torch.uint8), want)  # copied blocks equal, others untouched
    assert plan.num_descs == len(local_ids) * {0: 1, 1: local.num_layers, 2: 2 * local.num_layers}[pair.granularity]
    assert plan.num_descs_merged == len(d) <= plan.num_descs
    assert int(d[:, 1].sum()) == plan.total_bytes == len(local_ids) * local.block_bytes
    starts = np.sort(d[:, 0])
    ends = starts + d[np.argsort(d[:, 0]), 1]
    assert np.all(starts[1:] >= ends[:-1])  # merged runs never overlap
    assert inside_regions(d, dst) and inside_regions(s, src)
    assert inside_regions(pair.local_descs(dst.base_addrs(), 0), dst)
    assert inside_regions(pair.remote_descs(src.base_addrs(), 0), src)


@pytest.mark.parametrize("kind", KINDS)
def test_strided_form_expands_to_the_dense_list(kind: LayoutKind) -> None:
    s = spec(kind)
    pair = PairPlan.build(s, s)
    bases = [1 << 20 * (i + 1) for i in range(s.num_regions)]
    rows = strided_descriptor_array(pair.local_units, s.num_blocks, bases, 3)
    expanded = np.concatenate(
        [np.stack([a + np.arange(c) * stride, np.full(c, n), np.full(c, dev)], axis=1) for a, n, dev, stride, c in rows]
    )
    assert np.array_equal(expanded, pair.local_descs(bases, 3))


@pytest.mark.parametrize(
    ("kind", "per_request", "contiguous_merged"),
    [(LayoutKind.KV_FIRST, 16384, 64), (LayoutKind.BLOCKS_FIRST, 8192, 32), (LayoutKind.CROSS_LAYER, 256, 1)],
)
def test_descriptor_counts_llama8b_4096_tokens(kind, per_request, contiguous_merged) -> None:
    s = CacheSpec(
        kind=kind, dtype="bfloat16", num_layers=32, num_blocks=1024, block_size=16, num_kv_heads=8, head_dim=128
    )
    pair = PairPlan.build(s, s)
    rng = np.random.default_rng(0)
    scattered = full_plan(pair, rng.permutation(1024)[:256], rng.permutation(1024)[:256])
    assert scattered.num_descs == per_request
    assert scattered.total_bytes == 256 * 2 * 2**20  # 2 MiB per block across 32 layers
    assert scattered.num_descs_merged <= per_request
    contiguous = full_plan(pair, np.arange(100, 356), np.arange(500, 756))
    assert contiguous.num_descs == per_request
    assert contiguous.num_descs_merged == contiguous_merged


@pytest.mark.parametrize(
    ("a", "b", "gran"),
    [
        (LayoutKind.CROSS_LAYER, LayoutKind.CROSS_LAYER, Granularity.BLOCK),
        (LayoutKind.CROSS_LAYER, LayoutKind.BLOCKS_FIRST, Granularity.LAYER),
        (LayoutKind.BLOCKS_FIRST, LayoutKind.KV_FIRST, Granularity.HALF),
        (LayoutKind.KV_FIRST, LayoutKind.CROSS_LAYER, Granularity.HALF),
    ],
)
def test_pair_uses_finest_common_granularity(a, b, gran) -> None:
    assert PairPlan.build(spec(a), spec(b)).granularity is gran


def test_mismatch_names_every_field() -> None:
    a = spec(LayoutKind.BLOCKS_FIRST)
    b = spec(LayoutKind.BLOCKS_FIRST, dtype="bfloat16", num_layers=4, head_dim=16, block_size=8, tp_size=2)
    with pytest.raises(LayoutMismatchError) as e:
        check_compatible(a, b)
    assert set(e.value.fields) == {"dtype", "num_layers", "head_dim", "model_kv_heads"}
    assert "same model shape" in str(e.value)
    check_compatible(a, spec(LayoutKind.KV_FIRST, num_blocks=99))  # kind and num_blocks may differ
    # TP, block size and token layout may differ too (hetero.py plans them), but not block for block
    other = spec(LayoutKind.KV_FIRST, block_size=8, token_layout="HND", num_kv_heads=1, tp_size=2)
    check_compatible(a, other)
    with pytest.raises(LayoutError, match="hetero"):
        PairPlan.build(a, other)


def test_invalid_spec_is_refused() -> None:
    with pytest.raises(LayoutError, match="dtype"):
        spec(LayoutKind.KV_FIRST, dtype="float64")
    with pytest.raises(LayoutError, match="num_layers"):
        spec(LayoutKind.KV_FIRST, num_layers=0)


@pytest.mark.parametrize("bad", [[1, 1], [-1], [10], [], [0.5]])
def test_bad_block_ids_are_refused_before_planning(bad) -> None:
    s = spec(LayoutKind.BLOCKS_FIRST)
    pair = PairPlan.build(s, s)
    with pytest.raises(InvalidRequestError) as e:
        full_plan(pair, bad, list(range(len(bad))))
    assert e.value.field == "local_block_ids"
    with pytest.raises(InvalidRequestError, match="2 remote blocks for 1 local"):
        full_plan(pair, [0], [0, 1])


@pytest.mark.parametrize("kind", KINDS)
def test_flash_attention_views_and_stride_check(kind: LayoutKind) -> None:
    s = spec(kind)
    cache = KVCache.allocate(s)
    for layer in range(s.num_layers):
        k, v = cache.kv(layer)
        assert k.shape == v.shape == (s.num_blocks, s.block_size, s.num_kv_heads, s.head_dim)
        assert k.stride(-1) == 1 and v.stride(-1) == 1  # FlashAttention needs a contiguous last dim
        assert k.data_ptr() != v.data_ptr()
    if kind is not LayoutKind.CROSS_LAYER:
        padded = [
            torch.zeros(*s.region_shape()[:-1], s.head_dim * 2, dtype=torch.float16)[..., : s.head_dim]
            for _ in range(s.num_regions)
        ]
        with pytest.raises(LayoutError, match="strides"):
            KVCache.from_tensors(s, padded)
    wrong = [torch.zeros(s.region_shape(), dtype=torch.float32) for _ in range(s.num_regions)]
    with pytest.raises(LayoutError, match="dtype"):
        KVCache.from_tensors(s, wrong)


def test_order_checked_agrees_with_validate_and_bounds_both_sides() -> None:
    s = spec(LayoutKind.BLOCKS_FIRST)
    pair = PairPlan.build(s, spec(LayoutKind.CROSS_LAYER, num_blocks=6))
    fast, full = pair.order_checked([7, 1, 3], [5, 0, 2]), validated(pair, [7, 1, 3], [5, 0, 2])
    assert all(np.array_equal(a, b) for a, b in zip(fast, full, strict=True))
    with pytest.raises(InvalidRequestError) as e:
        pair.order_checked([1], [6])
    assert e.value.field == "remote_block_ids"
    with pytest.raises(InvalidRequestError) as e:
        pair.order_checked([10], [1])
    assert e.value.field == "local_block_ids"

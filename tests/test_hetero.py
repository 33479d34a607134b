"""Heterogeneous pairs (TP both ways, head replication, block sizes 16<->64, NHD<->HND, all layout kinds).

Oracle: one reference KV cache of the whole model (every head, token order) is sharded into the prefill
ranks' caches; every decode rank then executes its plans (the descriptors as memcpy, plus the staging
scatter) and must hold exactly the reference tokens of its own heads, with no other block touched.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvconnect.core.cache import KVCache
from kvconnect.core.errors import InvalidRequestError, LayoutMismatchError
from kvconnect.core.plan.hetero import ReadPath, plan_source, plan_sources
from kvconnect.core.plan.layout import CacheSpec, LayoutKind
from kvconnect.core.transports.staging import scatter
from tests.oracle import execute
from tests.oracle import plan as full_plan

KINDS = list(LayoutKind)
TP_PAIRS = [(1, 2), (2, 1), (1, 4), (4, 1), (2, 4), (4, 2)]  # (prefill, decode)
LAYERS, HEAD_DIM = 2, 4


def rank_spec(kind, tp, rank, model_heads, block, layout, num_blocks, dtype="float16") -> CacheSpec:
    return CacheSpec(
        kind=kind,
        dtype=dtype,
        num_layers=LAYERS,
        num_blocks=num_blocks,
        block_size=block,
        num_kv_heads=max(model_heads // tp, 1),
        head_dim=HEAD_DIM,
        tp_size=tp,
        tp_rank=rank,
        token_layout=layout,
        total_kv_heads=model_heads,
    )


def fill_from_reference(cache: KVCache, ref: torch.Tensor, ids: list[int], num_tokens: int) -> None:
    """ref: (tokens, layers, 2, model heads, D); write tokens [0, n) of this rank's heads into `ids`."""
    lo, hi = cache.spec.head_range()
    bs = cache.spec.block_size
    for t in range(num_tokens):
        for layer in range(LAYERS):
            for kv, view in enumerate(cache.kv(layer)):
                view[ids[t // bs], t % bs] = ref[t, layer, kv, lo:hi]


def run_pair(
    tp_p, tp_d, model_heads, kinds_p, kinds_d, bs_p, bs_d, lay_p, lay_d, num_tokens, seed, path="auto", dtype="float16"
):
    """Execute every decode rank's plans; return the number of distinct paths used."""
    gen = torch.Generator().manual_seed(seed)
    ref = torch.randn(num_tokens, LAYERS, 2, model_heads, HEAD_DIM, generator=gen).to(torch.float16)
    if dtype != "float16":
        ref = ref.to(getattr(torch, dtype))
    nb_p, nb_d = -(-num_tokens // bs_p), -(-num_tokens // bs_d)
    rng = np.random.default_rng(seed)
    p_ids = rng.permutation(nb_p + 3)[:nb_p].tolist()  # scattered, with spare blocks that must stay zero
    d_ids = rng.permutation(nb_d + 3)[:nb_d].tolist()
    prefill = []
    for r in range(tp_p):
        cache = KVCache.allocate(
            rank_spec(kinds_p[r % len(kinds_p)], tp_p, r, model_heads, bs_p, lay_p, nb_p + 3, dtype)
        )
        fill_from_reference(cache, ref, p_ids, num_tokens)
        prefill.append(cache)
    read_by: dict[int, list[int]] = {}
    released: list[int] = []
    paths = set()
    for d in range(tp_d):
        spec = rank_spec(kinds_d[d % len(kinds_d)], tp_d, d, model_heads, bs_d, lay_d, nb_d + 3, dtype)
        dst = KVCache.allocate(spec)
        sources = plan_sources(spec, tp_p)
        released.extend(sources.release_only)
        for src in sources.reads:
            read_by.setdefault(src.rank, []).append(d)
            remote = prefill[src.rank]
            sp = plan_source(spec, remote.spec, src, path, staging_blocks=nb_p + 1)
            paths.add(sp.path)
            if sp.path is ReadPath.STAGING:
                assert sp.staging_spec is not None
                stage = KVCache.allocate(sp.staging_spec)
                stage_ids = list(range(nb_p + 1))[::-1][:nb_p]
                execute(sp.pair, stage, remote, stage_ids, p_ids)
                scatter(stage, stage_ids, dst, d_ids, num_tokens, src.heads)
            else:
                plan = execute(sp.pair, dst, remote, d_ids, p_ids, num_tokens)
                assert plan.num_descs_merged <= plan.num_descs
        lo, hi = spec.head_range()
        for layer in range(LAYERS):
            for kv, view in enumerate(dst.kv(layer)):
                got = view[d_ids].reshape(nb_d * bs_d, hi - lo, HEAD_DIM)[:num_tokens]
                assert torch.equal(got.view(torch.uint8), ref[:, layer, kv, lo:hi].contiguous().view(torch.uint8)), (
                    f"decode rank {d} layer {layer} kv {kv}"
                )
                spare = [b for b in range(nb_d + 3) if b not in d_ids]
                assert not view[spare].view(torch.uint8).any(), "a block outside the request was written"
    # every prefill rank is read, or released by exactly one decode rank; reader counts agree
    assert sorted(set(read_by) | set(released)) == list(range(tp_p))
    assert len(released) == len(set(released)) and not set(released) & set(read_by)
    for r, ds in read_by.items():
        for d in ds:
            spec = rank_spec(kinds_d[0], tp_d, d, model_heads, bs_d, lay_d, 1)
            src = next(s for s in plan_sources(spec, tp_p).reads if s.rank == r)
            assert src.readers == len(ds) and src.reader == ds.index(d)
    return paths


@pytest.mark.parametrize(("tp_p", "tp_d"), TP_PAIRS)
@pytest.mark.parametrize("replicated", [False, True])
@pytest.mark.parametrize(("bs_p", "bs_d"), [(16, 16), (16, 64), (64, 16)])
@pytest.mark.parametrize(("lay_p", "lay_d"), list(itertools.product(["NHD", "HND"], repeat=2)))
def test_tp_block_and_token_layout_pairs(tp_p, tp_d, replicated, bs_p, bs_d, lay_p, lay_d) -> None:
    model_heads = 2 if replicated else 4  # with 4 ranks on a side, 2 heads means each head on 2 ranks
    shift = TP_PAIRS.index((tp_p, tp_d))
    kinds_p, kinds_d = KINDS[shift % 3 :] + KINDS[: shift % 3], KINDS[::-1]  # every kind on both sides
    run_pair(tp_p, tp_d, model_heads, kinds_p, kinds_d, bs_p, bs_d, lay_p, lay_d, num_tokens=100, seed=shift)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(TP_PAIRS + [(1, 1), (2, 2)]),
    st.sampled_from([1, 2, 4, 8]),
    st.lists(st.sampled_from(KINDS), min_size=1, max_size=4),
    st.lists(st.sampled_from(KINDS), min_size=1, max_size=4),
    st.sampled_from([(16, 64), (64, 16), (4, 16), (16, 16), (8, 4), (4, 6)]),
    st.sampled_from(["NHD", "HND"]),
    st.sampled_from(["NHD", "HND"]),
    st.integers(1, 150),
    st.sampled_from(["auto", "direct", "staging"]),
    st.sampled_from(["float16", "float32", "uint8"]),
)
def test_any_pair_assembles_the_reference(tps, heads, kinds_p, kinds_d, blocks, lay_p, lay_d, n, path, dtype) -> None:
    tp_p, tp_d = tps
    run_pair(tp_p, tp_d, heads, kinds_p, kinds_d, blocks[0], blocks[1], lay_p, lay_d, n, seed=n, path=path, dtype=dtype)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(TP_PAIRS + [(1, 1)]),
    st.sampled_from([(64, 16), (16, 4), (12, 8), (6, 4), (32, 8)]),
    st.sampled_from(["NHD", "HND"]),
    st.sampled_from(["NHD", "HND"]),
    st.integers(2, 150),
    st.integers(1, 40),
)
def test_a_direct_pull_past_a_decode_prefix_hit_writes_only_the_rest(tps, blocks, lay_p, lay_d, n, hit_blocks) -> None:
    """The decode's prefix cache holds its first `hit` tokens (whole decode blocks, ending inside a prefill block
    where the sizes say so): the pull reads the prefill's blocks from the one holding token `hit`, from that token
    on (`remote_offset`), into the decode's blocks for the rest. Every decode rank then holds tokens [hit, n) of
    its heads; the hit's blocks and every spare block stay untouched."""
    (tp_p, tp_d), (bs_p, bs_d) = tps, blocks
    hit = min(hit_blocks, (n - 1) // bs_d) * bs_d
    gen = torch.Generator().manual_seed(n)
    ref = torch.randn(n, LAYERS, 2, 4, HEAD_DIM, generator=gen).to(torch.float16)
    nb_p, nb_d = -(-n // bs_p), -(-(n - hit) // bs_d)
    rng = np.random.default_rng(n)
    p_ids = rng.permutation(nb_p + 3)[:nb_p].tolist()
    d_ids = rng.permutation(nb_d + 3 + hit // bs_d)[:nb_d].tolist()  # (the rest: the hit's blocks and spares)
    prefill = []
    for r in range(tp_p):
        cache = KVCache.allocate(rank_spec(LayoutKind.BLOCKS_FIRST, tp_p, r, 4, bs_p, lay_p, nb_p + 3))
        fill_from_reference(cache, ref, p_ids, n)
        prefill.append(cache)
    for d in range(tp_d):
        spec = rank_spec(LayoutKind.CROSS_LAYER, tp_d, d, 4, bs_d, lay_d, nb_d + 3 + hit // bs_d)
        dst = KVCache.allocate(spec)
        for src in plan_sources(spec, tp_p).reads:
            sp = plan_source(spec, prefill[src.rank].spec, src, "direct")
            assert sp.path is ReadPath.DIRECT
            execute(sp.pair, dst, prefill[src.rank], d_ids, p_ids[hit // bs_p :], n - hit, hit % bs_p)
        lo, hi = spec.head_range()
        for layer in range(LAYERS):
            for kv, view in enumerate(dst.kv(layer)):
                got = view[d_ids].reshape(nb_d * bs_d, hi - lo, HEAD_DIM)[: n - hit]
                assert torch.equal(got, ref[hit:, layer, kv, lo:hi]), (d, layer, kv)
                others = [b for b in range(spec.num_blocks) if b not in d_ids]
                assert not view[others].view(torch.uint8).any(), "a block outside the pull was written"


def test_path_choice_follows_the_cost_model() -> None:
    """Llama-3-8B shapes. On DRAM the scatter is the slow part, so contiguous pieces go direct; on a GPU the
    per-descriptor cost dominates, so 16 KiB HND head slices stage (measured: ~16x faster, results/gpu)."""

    def choose(lay_p, lay_d, bs_p, bs_d, tp_p=1, tp_d=2, device="cpu", path="auto", staging=256):
        def spec8b(tp, layout, bs):
            return CacheSpec(
                kind=LayoutKind.CROSS_LAYER,
                dtype="bfloat16",
                num_layers=32,
                num_blocks=512,
                block_size=bs,
                num_kv_heads=8 // tp,
                head_dim=128,
                tp_size=tp,
                token_layout=layout,
                device=device,
            )

        local, remote = spec8b(tp_d, lay_d, bs_d), spec8b(tp_p, lay_p, bs_p)
        return plan_source(local, remote, plan_sources(local, tp_p).reads[0], path, staging_blocks=staging)

    hnd = choose("HND", "HND", 16, 16)
    assert hnd.path is ReadPath.DIRECT and hnd.pair.chunks == 1 and hnd.pair.unit_bytes == 16 * 1024
    assert hnd.descs_per_block == 2 * 32  # one head slice per K/V half
    gpu = choose("HND", "HND", 16, 16, device="cuda")
    assert gpu.path is ReadPath.STAGING and gpu.descs_per_block == 1 and "direct 29" in gpu.reason
    assert choose("HND", "HND", 16, 16, device="cuda", path="direct").path is ReadPath.DIRECT  # forced
    assert choose("HND", "HND", 16, 16, device="cuda", staging=0).path is ReadPath.DIRECT  # staging off
    assert choose("NHD", "NHD", 16, 16).path is ReadPath.STAGING  # 1 KiB pieces
    assert choose("NHD", "HND", 16, 16, tp_p=2).path is ReadPath.STAGING  # 256 B pieces
    tokens = choose("NHD", "NHD", 64, 16, tp_p=2)
    assert tokens.path is ReadPath.DIRECT and tokens.descs_per_block == 2 * 32 * 4  # 4 segments per big block
    same = choose("NHD", "NHD", 16, 16, tp_p=2)
    assert same.path is ReadPath.BLOCK and same.descs_per_block == 1  # cross_layer: one descriptor per block
    assert "heads" in choose("NHD", "NHD", 16, 16).reason


def test_refusals_name_the_reason() -> None:
    local = rank_spec(LayoutKind.CROSS_LAYER, 2, 0, 4, 16, "NHD", 8)
    with pytest.raises(LayoutMismatchError, match="tp_size 3 does not divide"):
        plan_sources(local, 3)
    other_model = CacheSpec(
        kind=LayoutKind.CROSS_LAYER,
        dtype="float16",
        num_layers=LAYERS + 1,
        num_blocks=8,
        block_size=16,
        num_kv_heads=4,
        head_dim=HEAD_DIM,
    )
    with pytest.raises(LayoutMismatchError, match="num_layers"):
        plan_source(local, other_model, plan_sources(local, 1).reads[0])
    remote = rank_spec(LayoutKind.CROSS_LAYER, 1, 0, 4, 16, "HND", 8)
    with pytest.raises(LayoutMismatchError, match="staging is disabled"):
        plan_source(local, remote, plan_sources(local, 1).reads[0], staging_blocks=0)
    wrong_rank = rank_spec(LayoutKind.CROSS_LAYER, 2, 1, 4, 16, "NHD", 8)
    with pytest.raises(LayoutMismatchError, match="holds heads"):
        plan_source(local, wrong_rank, plan_sources(local, 2).reads[0])
    with pytest.raises(Exception, match="num_kv_heads 3"):
        CacheSpec(
            kind=LayoutKind.CROSS_LAYER,
            dtype="float16",
            num_layers=1,
            num_blocks=1,
            block_size=1,
            num_kv_heads=3,
            head_dim=1,
            tp_size=2,
            total_kv_heads=4,
        )


def test_token_counts_are_checked() -> None:
    local = rank_spec(LayoutKind.BLOCKS_FIRST, 1, 0, 4, 16, "NHD", 16)
    remote = rank_spec(LayoutKind.BLOCKS_FIRST, 1, 0, 4, 64, "NHD", 16)
    sp = plan_source(local, remote, plan_sources(local, 1).reads[0])
    with pytest.raises(InvalidRequestError, match="do not hold the same tokens"):
        full_plan(sp.pair, [0, 1], [0, 1])  # 2 small blocks vs 2 big ones
    with pytest.raises(InvalidRequestError, match="cannot hold 40 tokens"):
        full_plan(sp.pair, [0, 1], [3], num_tokens=40)
    plan = full_plan(sp.pair, [5, 1, 2], [3], num_tokens=40)
    assert plan.total_bytes == 3 * 16 * 4 * HEAD_DIM * 2 * 2 * LAYERS  # three 16-token segments

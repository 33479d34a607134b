"""vLLM-shaped KV caches (no vLLM needed): per-layer [B, H, N, C] views laid out by vLLM 0.32's stride
permutations, and 5-D tensors with K and V as a dimension of size 2, described by their strides, planned and
moved as memcpy (the oracle) and by real NIXL."""

from __future__ import annotations

import ctypes

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconnect.core.connector import KVConnector
from kvconnect.core.errors import LayoutError, LayoutMismatchError
from kvconnect.core.plan.hetero import ReadPath, plan_source, plan_sources
from kvconnect.core.plan.layout import LayoutKind
from kvconnect.harness.prefill import PrefillProcess
from kvconnect.harness.vllm_shapes import packed_views, split_views
from kvconnect.vllm.layout import describe
from tests.helpers import config_for_tests
from tests.oracle import execute

PAGE = "vllm:cpu-vec"


def vllm_views(
    order: str,
    layers: int,
    blocks: int,
    heads: int,
    tokens: int,
    head_dim: int,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    return packed_views(order, layers, blocks, heads, tokens, head_dim, dtype, seed)


def page_of(view: torch.Tensor, block: int) -> bytes:
    """The block's page in this layer as it lies in memory (one contiguous run from its first element)."""
    page = view[block]
    return ctypes.string_at(page.data_ptr(), page.numel() * page.element_size())


def described(order: str, heads: int = 4, tp: int = 1, rank: int = 0, blocks: int = 12, seed: int = 0, **kw):
    views, raw = vllm_views(order, 3, blocks, heads, 32, 32, seed=seed)
    d = describe(
        views,
        num_blocks=blocks,
        block_size=32,
        tp_size=tp,
        tp_rank=rank,
        total_kv_heads=heads * tp,
        page=kw.get("page", PAGE),
    )
    return d, views, raw


@pytest.mark.parametrize(
    "order,kind,token_layout",
    [
        ("LBHNC", LayoutKind.BLOCKS_FIRST, "HND"),
        ("LBNHC", LayoutKind.BLOCKS_FIRST, "NHD"),
        ("BLHNC", LayoutKind.CROSS_LAYER, "HND"),
        ("BLNHC", LayoutKind.CROSS_LAYER, "NHD"),
    ],
)
def test_compact_layouts_are_described_from_their_strides(order: str, kind: LayoutKind, token_layout: str) -> None:
    d, views, _ = described(order)
    spec = d.cache.spec
    assert (spec.kind, spec.token_layout, spec.num_layers, spec.num_kv_heads, spec.head_dim) == (
        kind,
        token_layout,
        3,
        4,
        32,
    )
    assert d.layout == order and d.layer_names == tuple(sorted(views, key=lambda n: int(n.split(".")[2])))
    assert d.cache.base_addrs()[0] == views[d.layer_names[0]].data_ptr()  # no copy: the engine's own memory
    for block in (0, 5, 11):  # a block's bytes are each layer's page, as the engine wrote them
        assert d.cache.block_bytes(block) == b"".join(page_of(views[n], block) for n in d.layer_names)
    regions = [(a, a + spec.region_bytes) for a in d.cache.base_addrs()]
    for view in views.values():  # every page lies inside a registered region
        first, last = view[0].data_ptr(), view[-1].data_ptr() + spec.layer_block_bytes
        assert any(lo <= first and last <= hi for lo, hi in regions)


class FlashAttnLike:
    """What vLLM 0.26's FLASH_ATTN backend says of its cross-layer tensor: logical (L, B, H, N, 2*D), laid out
    (B, L, N, H, 2*D) with NHD, (B, H, L, N, 2*D) with HND (`get_kv_cache_stride_order`)."""

    def __init__(self, order: tuple[int, ...]) -> None:
        self.order = order

    def get_kv_cache_stride_order(self, include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        assert include_num_layers_dimension
        return self.order


@pytest.mark.parametrize(("order", "kind"), [((1, 0, 3, 2, 4), LayoutKind.CROSS_LAYER), ((1, 2, 0, 3, 4), None)])
def test_vllms_cross_layer_tensor_is_described_as_one_region_from_its_views(order, kind) -> None:
    """vLLM 0.26 with `prefer_cross_layer_blocks` allocates one tensor for every layer, in the backend's order,
    and hands the plug-in that tensor (`register_cross_layers_kv_cache`): its per-layer views, undone from
    that order, describe one cross_layer region with NHD (a block's layers side by side: one descriptor per
    block for every layer); with HND the heads are outside the layers and a block is not one run: refused."""
    from kvconnect.vllm.layout import cross_layer_views

    layers, blocks, heads, tokens, content = 3, 8, 2, 16, 2 * 32
    logical = (layers, blocks, heads, tokens, content)
    physical = torch.arange(np.prod(logical), dtype=torch.float32).to(torch.bfloat16)
    tensor = physical.view(tuple(logical[i] for i in order))
    views = cross_layer_views(tensor, FlashAttnLike(order))
    assert list(views) == [f"cross_layer.{i}" for i in range(layers)]
    assert all(tuple(v.shape) == (blocks, heads, tokens, content) for v in views.values())
    args = dict(num_blocks=blocks, block_size=tokens, tp_size=1, tp_rank=0, total_kv_heads=heads, page="vllm:cuda")
    if kind is None:
        with pytest.raises(LayoutError):
            describe(views, **args)
        return
    d = describe(views, **args)
    assert d.cache.spec.kind is kind and len(d.cache.regions) == 1
    assert d.cache.base_addrs()[0] == tensor.data_ptr()  # the engine's own memory, no copy
    for block in (0, 5):  # a block is every layer's page, layer after layer, as vLLM laid them out
        assert d.cache.block_bytes(block) == tensor[block].contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("order", ["LHBNC", "BHLNC"])
def test_layouts_that_split_a_page_are_refused_naming_why(order: str) -> None:
    with pytest.raises(LayoutError, match="not one contiguous run"):
        described(order)


def test_bad_tensors_are_refused_naming_what_is_wrong() -> None:
    views, _ = vllm_views("LBHNC", 2, 8, 4, 32, 32)
    with pytest.raises(LayoutError, match="scheduler blocks"):
        describe(views, num_blocks=4, block_size=32, tp_size=1, tp_rank=0, total_kv_heads=4, page=PAGE)
    with pytest.raises(LayoutError, match="divide the block size"):
        describe(views, num_blocks=8, block_size=16, tp_size=1, tp_rank=0, total_kv_heads=4, page=PAGE)
    odd = {k: v[..., :63] for k, v in views.items()}  # (also no longer contiguous per page)
    with pytest.raises(LayoutError, match=r"not K \+ V of one head size"):
        describe(odd, num_blocks=8, block_size=32, tp_size=1, tp_rank=0, total_kv_heads=4, page=PAGE)
    padded, _ = vllm_views("LBHNC", 2, 9, 4, 32, 32)
    gapped = {k: v[::3] for k, v in padded.items()}  # blocks 3 pages apart
    with pytest.raises(LayoutError, match="padded pages"):
        describe(gapped, num_blocks=3, block_size=32, tp_size=1, tp_rank=0, total_kv_heads=4, page=PAGE)
    with pytest.raises(LayoutError, match="differ"):
        mixed = dict(views)
        mixed["model.layers.1.self_attn.attn"] = views["model.layers.1.self_attn.attn"].float()
        describe(mixed, num_blocks=8, block_size=32, tp_size=1, tp_rank=0, total_kv_heads=4, page=PAGE)
    with pytest.raises(LayoutError, match="no KV cache"):
        describe({}, num_blocks=8, block_size=32, tp_size=1, tp_rank=0, total_kv_heads=4, page=PAGE)


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(["LBHNC", "BLHNC"]), st.sampled_from(["LBHNC", "BLHNC"]), st.data())
def test_pages_move_block_for_block_between_compact_layouts(remote_order: str, local_order: str, data) -> None:
    src, src_views, _ = described(remote_order, seed=1)
    dst, dst_views, _ = described(local_order, seed=2)
    n = data.draw(st.integers(1, 12))
    remote_ids = data.draw(st.permutations(range(12)))[:n]
    local_ids = data.draw(st.permutations(range(12)))[:n]
    sp = plan_source(dst.cache.spec, src.cache.spec, plan_sources(dst.cache.spec, 1).reads[0])
    assert sp.path is ReadPath.BLOCK
    p = execute(sp.pair, dst.cache, src.cache, local_ids, remote_ids)
    assert p.num_descs == n * (1 if (remote_order, local_order) == ("BLHNC", "BLHNC") else 3)
    for lid, rid in zip(local_ids, remote_ids, strict=True):
        for name in src.layer_names:
            assert page_of(dst_views[name], lid) == page_of(src_views[name], rid)


def test_tensor_parallel_pairs_move_runs_of_heads() -> None:
    """TP 1 -> 2 and 2 -> 1 between heads-outermost pages: each block moves as one run of heads per layer."""
    one, one_views, _ = described("LBHNC", heads=8, seed=3)
    halves = [described("BLHNC", heads=4, tp=2, rank=r, seed=10 + r) for r in range(2)]
    ids = [3, 7, 1]
    head_page = 32 * 2 * 32 * 2  # tokens x (K + V of one head) x bf16
    for rank, (half, half_views, _) in enumerate(halves):  # 1 -> 2
        (src,) = plan_sources(half.cache.spec, 1).reads
        sp = plan_source(half.cache.spec, one.cache.spec, src)
        assert sp.path is ReadPath.DIRECT and sp.descs_per_block == 3
        execute(sp.pair, half.cache, one.cache, [0, 1, 2], ids)
        for name in one.layer_names:
            for lid, rid in enumerate(ids):
                whole = page_of(one_views[name], rid)
                assert page_of(half_views[name], lid) == whole[rank * 4 * head_page : (rank + 1) * 4 * head_page]
    back, back_views, _ = described("LBHNC", heads=8, seed=4)  # 2 -> 1: both ranks fill one page
    for rank, (half, _, _) in enumerate(halves):
        src = [s for s in plan_sources(back.cache.spec, 2).reads if s.rank == rank][0]
        execute(plan_source(back.cache.spec, half.cache.spec, src).pair, back.cache, half.cache, ids, [0, 1, 2])
    for name in one.layer_names:
        for lid, rid in zip(ids, [0, 1, 2], strict=True):
            assert page_of(back_views[name], lid) == b"".join(page_of(h[1][name], rid) for h in halves)


def test_pages_that_cannot_pair_are_refused_at_planning_naming_the_field() -> None:
    cpu, _, _ = described("LBHNC")
    other, _, _ = described("LBHNC", page="vllm:cuda")
    with pytest.raises(LayoutMismatchError, match="page"):
        plan_source(cpu.cache.spec, other.cache.spec, plan_sources(cpu.cache.spec, 1).reads[0])
    tokens_outer = [described("LBNHC", heads=4, tp=2, rank=r)[0] for r in range(2)]
    whole, _, _ = described("LBNHC", heads=8)
    with pytest.raises(LayoutMismatchError, match="whole heads"):
        plan_source(tokens_outer[0].cache.spec, whole.cache.spec, plan_sources(tokens_outer[0].cache.spec, 1).reads[0])
    with pytest.raises(LayoutError, match="cannot be split"):  # nothing finer than a page: no K/V halves
        from kvconnect.core.plan.layout import Granularity, unit_table

        unit_table(cpu.cache.spec, Granularity.HALF)


def test_a_vllm_shaped_cache_is_pulled_over_nixl_byte_exact() -> None:
    """Real NIXL between two processes: the prefill holds a block-outermost (BLHNC) page cache, the decode
    pulls into per-layer (LBHNC) views of its own engine-shaped memory."""
    dst, dst_views, raw = described("LBHNC", blocks=16, seed=5)
    spec = dst.cache.spec
    pre = PrefillProcess.launch()
    try:
        pre.wait_started()  # the prefill's tensors are engine-shaped too, registered through describe
        pre.setup_views("BLHNC", dict(layers=3, blocks=16, heads=4, tokens=32, head_dim=32, page=PAGE), 9)
        pre.wait_setup()
        params = pre.lease("vllm-shaped", [4, 9, 2])
        with KVConnector(dst.cache, config_for_tests()) as dec:
            stats = dec.pull(params, [0, 1, 15]).wait(60)
        assert stats.num_blocks == 3 and stats.bytes == 3 * spec.block_bytes and stats.path == "block"
        for lid, rid in zip([0, 1, 15], [4, 9, 2], strict=True):
            assert dst.cache.block_bytes(lid) == pre.ask("block", rid)
        assert pre.ask("state", "vllm-shaped") == "completed"
        assert np.count_nonzero(raw.view(torch.uint8).numpy()) > 0
    finally:
        pre.stop()


@pytest.mark.parametrize(
    "form,kind",
    [
        ("blocks_first", LayoutKind.BLOCKS_FIRST),
        ("kv_first", LayoutKind.KV_FIRST),
        ("cross_layer", LayoutKind.CROSS_LAYER),
    ],
)
def test_split_kv_tensors_are_kvconnects_own_layouts(form: str, kind: LayoutKind) -> None:
    """5-D tensors with K and V as a dimension of size 2 (FlashInfer, older vLLM): described from their strides
    as kvconnect's native layouts (no page format), over the engine's memory, K and V where the engine has them."""
    views, raw = split_views(form, 3, 12, 4, 16, 32, seed=6)
    d = describe(views, num_blocks=12, block_size=16, tp_size=1, tp_rank=0, total_kv_heads=4, page=PAGE)
    spec = d.cache.spec
    assert (spec.kind, spec.page, spec.token_layout, spec.num_layers, spec.head_dim) == (kind, "", "NHD", 3, 32)
    assert d.cache.base_addrs()[0] == raw.data_ptr()
    for layer, name in enumerate(d.layer_names):
        k, v = d.cache.kv(layer)
        engine = views[name] if form != "kv_first" else views[name].transpose(0, 1)  # (B, 2, N, H, D)
        assert torch.equal(k, engine[:, 0]) and torch.equal(v, engine[:, 1])
        assert k.data_ptr() == engine[:, 0].data_ptr()


def test_split_kv_tensors_that_kvconnect_cannot_describe_are_refused() -> None:
    views, _ = split_views("blocks_first", 2, 12, 4, 16, 32)
    with pytest.raises(LayoutError, match="neither"):
        describe(views, num_blocks=6, block_size=16, tp_size=1, tp_rank=0, total_kv_heads=4, page=PAGE)
    gapped = {k: v[::2] for k, v in views.items()}  # blocks two blocks apart
    with pytest.raises(LayoutError, match="padded blocks"):
        describe(gapped, num_blocks=6, block_size=16, tp_size=1, tp_rank=0, total_kv_heads=4, page=PAGE)
    two, _ = split_views("kv_first", 2, 2, 4, 16, 32)  # (2, 2, ...): its strides also fit (B, 2, ...)
    with pytest.raises(LayoutError, match="cannot tell blocks from K/V"):
        describe(two, num_blocks=2, block_size=16, tp_size=1, tp_rank=0, total_kv_heads=4, page=PAGE)
    swapped = {k: v.transpose(3, 4) for k, v in views.items()}  # (B, 2, N, D, H): heads not contiguous
    with pytest.raises(LayoutError, match="head dimension"):
        describe(swapped, num_blocks=12, block_size=16, tp_size=1, tp_rank=0, total_kv_heads=32, page=PAGE)


def test_a_split_kv_cache_pulls_from_a_kvconnect_engine_over_nixl() -> None:
    """FlashInfer-shaped per-layer tensors (B, 2, N, H, D) on the decode, kvconnect's own cross_layer cache on
    the prefill: the layouts plan as kvconnect's own (K/V halves), byte-exact over real NIXL."""
    views, _ = split_views("blocks_first", 3, 16, 4, 16, 32, seed=7)
    d = describe(views, num_blocks=16, block_size=16, tp_size=1, tp_rank=0, total_kv_heads=4, page=PAGE)
    remote = msgspec.structs.replace(d.cache.spec, kind=LayoutKind.CROSS_LAYER)
    pre = PrefillProcess.start(remote, seed=4)
    try:
        with KVConnector(d.cache, config_for_tests()) as dec:
            dec.pull(pre.lease("split", [5, 0, 11]), [2, 9, 3]).wait(60)
        for lid, rid in zip([2, 9, 3], [5, 0, 11], strict=True):
            assert d.cache.block_bytes(lid) == pre.ask("block", rid)
    finally:
        pre.stop()

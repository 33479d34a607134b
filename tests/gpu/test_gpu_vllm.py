"""vLLM-shaped CUDA caches (built as vLLM's GPU attention backends allocate them, registered through the vLLM
plug-in's `describe`), pulled byte-exact over NIXL and the IPC gather, and read in place by FlashAttention's
paged kernel (FlashAttention-4, `flash_attn.cute`) through the decode's block table. Run on a CUDA machine:
`pytest -m gpu tests/gpu`."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch

from kvconnect.core.connector import KVConnector
from kvconnect.core.faults import FaultHooks
from kvconnect.harness.net import poll_until
from kvconnect.harness.prefill import PrefillProcess
from kvconnect.harness.vllm_shapes import make_views
from kvconnect.vllm.layout import describe
from tests.helpers import config_for_tests

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GEO = dict(layers=4, blocks=64, heads=8, tokens=16, head_dim=128)
SPLIT = ("split:blocks_first", "split:cross_layer", "split:kv_first")


def devices() -> tuple[str, str]:
    return ("cuda:0", "cuda:1") if torch.cuda.device_count() > 1 else ("cuda:0", "cuda:0")


def views_for(shape: str, device: str, blocks: int, seed: int, **geo: int):
    g = {**GEO, **geo, "blocks": blocks}
    return make_views(shape, g["layers"], g["blocks"], g["heads"], g["tokens"], g["head_dim"], seed=seed, device=device)


def decode_side(shape: str, device: str, blocks: int = 48, seed: int = 0, **config):
    views, raw = views_for(shape, device, blocks, seed)
    raw.zero_()
    d = describe(
        views,
        num_blocks=blocks,
        block_size=GEO["tokens"],
        tp_size=1,
        tp_rank=0,
        total_kv_heads=GEO["heads"],
        page="vllm:cuda",
    )
    return views, d, KVConnector(d.cache, config_for_tests(**config), faults=FaultHooks())


def start_prefill(shape: str, device: str, transport: str, seed: int = 5, **geo: int) -> PrefillProcess:
    pre = PrefillProcess.launch(device=device, transport=transport)
    try:
        pre.wait_started()
        pre.setup_views(shape, {**GEO, **geo}, seed)
        pre.wait_setup()
    except BaseException:
        pre.stop()
        raise
    return pre


FAMILIES = {"packed-NHD": ("LBNHC", "BLNHC"), "packed-HND": ("LBHNC", "BLHNC"), "split": SPLIT}


@pytest.mark.parametrize("transport", ["nixl", "ipc"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_vllm_shaped_vram_caches_pull_byte_exact(transport: str, family: str) -> None:
    """Every vLLM-shaped layout into every other of its family (opaque pages pair with pages of the same token
    order, per-layer or block-outermost; K/V-split tensors with each other), scattered ids, on the GPUs there
    are. (Pages of different token orders are refused at planning: tests/test_vllm_pages.py.)"""
    shapes = FAMILIES[family]
    prefill_dev, decode_dev = devices()
    rng = np.random.default_rng(11)
    for remote in shapes:
        pre = start_prefill(remote, prefill_dev, transport)
        try:
            for local in shapes:
                torch.cuda.set_device(torch.device(decode_dev))
                views, d, dec = decode_side(local, decode_dev, transport=transport)
                with dec:
                    remote_ids = [int(x) for x in rng.permutation(60)[:20]] + [60, 61, 62]
                    local_ids = [int(x) for x in rng.permutation(40)[:20]] + [40, 41, 42]
                    request_id = f"v-{uuid.uuid4().hex[:8]}"
                    stats = dec.pull(pre.lease(request_id, remote_ids), local_ids).wait(60)
                    assert stats.transport == transport and stats.bytes == 23 * d.cache.spec.block_bytes
                    for lid, rid in zip(local_ids, remote_ids, strict=True):
                        assert d.cache.block_bytes(lid) == pre.ask("block", rid), (remote, local)
                    zero = bytes(d.cache.spec.block_bytes)
                    assert all(d.cache.block_bytes(b) == zero for b in sorted(set(range(48)) - set(local_ids))[:4])
                    assert pre.ask("state", request_id) == "completed"
        finally:
            pre.stop()


def _pages(block: bytes, layers: int, tokens: int, heads: int, head_dim: int) -> torch.Tensor:
    """One block's bytes of an LBNHC/BLNHC cache as (layers, tokens, heads, 2 * head_dim) bf16."""
    t = torch.frombuffer(bytearray(block), dtype=torch.bfloat16)
    return t.view(layers, tokens, heads, 2 * head_dim)


@pytest.mark.parametrize("transport", ["nixl", "ipc"])
@pytest.mark.parametrize("block_size", [16, 64])
def test_flash_attention_reads_the_pulled_cache_in_place(transport: str, block_size: int) -> None:
    """FlashAttention-4's paged decode kernel reads K and V straight out of the pulled vLLM cache (LBNHC: K and
    V packed per head, the kernel gets `cache[..., :D]` and `cache[..., D:]`, no copy) through the decode's
    block table. Its output equals, bit for bit, the same kernel over the prefill's original pages at the
    prefill's block ids, and matches exact attention over the original K/V in float32."""
    cute = pytest.importorskip("flash_attn.cute", reason="FlashAttention-4 (flash-attn-4) is not installed")
    prefill_dev, decode_dev = devices()
    L, H, D, q_heads = GEO["layers"], GEO["heads"], GEO["head_dim"], 32
    seq_lens = [3 * block_size - 5, 5 * block_size, block_size + 1]  # three sequences, ragged last blocks
    per_seq = [-(-n // block_size) for n in seq_lens]
    blocks = 64
    rng = np.random.default_rng(block_size)
    remote_ids = [int(x) for x in rng.permutation(blocks)[: sum(per_seq)]]
    local_ids = [int(x) for x in rng.permutation(40)[: sum(per_seq)]]
    pre = start_prefill("LBNHC", prefill_dev, transport, seed=9, tokens=block_size, blocks=blocks)
    try:
        torch.cuda.set_device(torch.device(decode_dev))
        views, raw = views_for("LBNHC", decode_dev, 48, 0, tokens=block_size)
        raw.zero_()
        d = describe(
            views, num_blocks=48, block_size=block_size, tp_size=1, tp_rank=0, total_kv_heads=H, page="vllm:cuda"
        )
        with KVConnector(d.cache, config_for_tests(transport=transport)) as dec:
            dec.pull(pre.lease("fa", remote_ids), local_ids).wait(60)
        original = {rid: _pages(pre.ask("block", rid), L, block_size, H, D) for rid in remote_ids}
    finally:
        pre.stop()

    def table(ids: list[int]) -> torch.Tensor:
        rows, at = [], 0
        for n in per_seq:
            rows.append(ids[at : at + n] + [0] * (max(per_seq) - n))
            at += n
        return torch.tensor(rows, dtype=torch.int32, device=decode_dev)

    # the prefill's pages at the prefill's ids, in a cache shaped like its own (the reference kernel input)
    ref_views, ref_raw = views_for("LBNHC", decode_dev, blocks, 0, tokens=block_size)
    ref_raw.zero_()
    for rid, page in original.items():
        for layer, name in enumerate(sorted(ref_views, key=lambda n: int(n.split(".")[2]))):
            ref_views[name][rid].copy_(page[layer].transpose(0, 1).to(decode_dev))  # [H, N, C] view of (N, H, C)
    gen = torch.Generator(device="cpu").manual_seed(block_size)
    used = torch.tensor(seq_lens, dtype=torch.int32, device=decode_dev)
    for layer, name in enumerate(d.layer_names):
        q = torch.randn(len(seq_lens), 1, q_heads, D, generator=gen).to(decode_dev, torch.bfloat16)

        def paged(view: torch.Tensor, ids: list[int], q=q) -> torch.Tensor:
            nhc = view.transpose(1, 2)  # [B, N, H, C]: the FlashAttention paged layout, K and V packed in C
            k, v = nhc[..., :D], nhc[..., D:]
            assert k.data_ptr() == view.data_ptr()  # a view of the cache, not a copy
            out = cute.flash_attn_varlen_func(
                q, k, v, page_table=table(ids), seqused_k=used, causal=False, softmax_scale=D**-0.5
            )
            return out[0] if isinstance(out, tuple) else out

        pulled = paged(views[name], local_ids)
        reference = paged(ref_views[name], remote_ids)
        assert torch.equal(pulled, reference), (layer, (pulled.float() - reference.float()).abs().max())
        at = 0
        for s, (n, nb) in enumerate(zip(seq_lens, per_seq, strict=True)):  # exact attention, float32
            pages = torch.cat([original[rid][layer] for rid in remote_ids[at : at + nb]])[:n].float().to(decode_dev)
            at += nb
            k = pages[..., :D].repeat_interleave(q_heads // H, dim=1)  # (n, 32, D)
            v = pages[..., D:].repeat_interleave(q_heads // H, dim=1)
            w = torch.softmax(torch.einsum("hd,nhd->hn", q[s, 0].float(), k) * D**-0.5, dim=-1)
            exact = torch.einsum("hn,nhd->hd", w, v)
            torch.testing.assert_close(pulled[s, 0].float(), exact, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("transport", ["nixl", "ipc"])
def test_a_driven_pull_of_a_vram_cache_completes_on_the_calling_thread(transport: str) -> None:
    """As vLLM's worker does: the thread whose current device is the cache's drives the pull (`drive`) while
    the loop thread is held; a thread on another device is refused a tick (its CUDA context is not the
    cache's)."""
    prefill_dev, decode_dev = devices()
    pre = start_prefill("LBHNC", prefill_dev, transport)
    try:
        torch.cuda.set_device(torch.device(decode_dev))
        views, d, dec = decode_side("LBHNC", decode_dev, transport=transport)
        with dec, dec.faults.hold_loop():
            request_id = f"d-{uuid.uuid4().hex[:8]}"
            handle = dec.pull(pre.lease(request_id, [7, 3, 50]), [0, 9, 2])
            ticks: list[bool] = []
            poll_until(lambda: ticks.append(dec.drive()) or handle.done(), timeout_s=60, what="the driven pull")
            handle.wait(0)
            assert all(ticks)
            assert handle.stats.transport == transport
            for lid, rid in zip([0, 9, 2], [7, 3, 50], strict=True):
                assert d.cache.block_bytes(lid) == pre.ask("block", rid)
            if torch.cuda.device_count() > 1:
                other = 1 - torch.device(decode_dev).index
                with torch.cuda.device(other):
                    assert dec.drive() is False
    finally:
        pre.stop()


def test_a_peer_first_met_inside_inference_mode_still_serves_the_loop_thread() -> None:
    """vLLM drives the connector inside its forward's `torch.inference_mode()`: the IPC gather opened there
    made its id tensors inference tensors, and the loop thread's next post (outside it) failed with
    "Inplace update to inference tensor outside InferenceMode" (seen in vLLM 0.26 on one H200)."""
    prefill_dev, decode_dev = devices()
    pre = start_prefill("LBHNC", prefill_dev, "ipc")
    try:
        torch.cuda.set_device(torch.device(decode_dev))
        views, d, dec = decode_side("LBHNC", decode_dev, transport="ipc")
        with dec:
            with dec.faults.hold_loop(), torch.inference_mode():
                first = dec.pull(pre.lease(f"im-{uuid.uuid4().hex[:8]}", [7, 3]), [0, 9])
                poll_until(lambda: dec.drive() and first.done(), timeout_s=60, what="the driven pull")
                first.wait(0)
            second = dec.pull(pre.lease(f"im-{uuid.uuid4().hex[:8]}", [50, 4]), [2, 5])  # the loop thread's
            second.wait(60)
            assert second.stats.transport == "ipc"
            for lid, rid in zip([0, 9, 2, 5], [7, 3, 50, 4], strict=True):
                assert d.cache.block_bytes(lid) == pre.ask("block", rid)
    finally:
        pre.stop()

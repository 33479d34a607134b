"""GPU pulls (run on a CUDA machine: `pytest -m gpu tests/gpu`): VRAM over NIXL and over the IPC
gather, same-GPU and cross-GPU, byte-exact, and attention over the pulled cache."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest
import torch

from kvconnect.core.cache import KVCache
from kvconnect.core.connector import KVConnector
from kvconnect.core.plan.layout import CacheSpec, LayoutKind
from kvconnect.harness.prefill import PrefillProcess
from tests.helpers import config_for_tests

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GEOMETRY = dict(dtype="bfloat16", num_layers=4, block_size=16, num_kv_heads=8, head_dim=128, device="cuda")


@pytest.fixture(autouse=True)
def keep_current_device():
    before = torch.cuda.current_device()
    yield
    torch.cuda.set_device(before)


def spec(kind: LayoutKind, num_blocks: int = 64) -> CacheSpec:
    return CacheSpec(kind=kind, num_blocks=num_blocks, **GEOMETRY)


def pairs_of_devices() -> list[tuple[str, str]]:
    out = [("cuda:0", "cuda:0")]
    if torch.cuda.device_count() > 1:
        out.append(("cuda:0", "cuda:1"))
    return out


def decoder(kind: LayoutKind, device: str, **config) -> KVConnector:
    torch.cuda.set_device(torch.device(device))
    cache = KVCache.allocate(spec(kind, 48), device=device)
    return KVConnector(cache, config_for_tests(**config))


@pytest.mark.parametrize("transport", ["nixl", "ipc"])
@pytest.mark.parametrize(("prefill_dev", "decode_dev"), pairs_of_devices())
def test_vram_pulls_every_layout_pair(transport: str, prefill_dev: str, decode_dev: str) -> None:
    rng = np.random.default_rng(3)
    for remote_kind in LayoutKind:
        pre = PrefillProcess.start(spec(remote_kind), seed=5, device=prefill_dev, transport=transport)
        try:
            for local_kind in LayoutKind:
                with decoder(local_kind, decode_dev, transport=transport) as dec:
                    remote_ids = [int(x) for x in rng.permutation(60)[:20]] + [60, 61, 62]
                    local_ids = [int(x) for x in rng.permutation(40)[:20]] + [40, 41, 42]
                    request_id = f"g-{uuid.uuid4().hex[:8]}"
                    stats = dec.pull(pre.lease(request_id, remote_ids), local_ids).wait(60)
                    assert stats.transport == transport
                    for lid, rid in zip(local_ids, remote_ids, strict=True):
                        assert dec.cache.block_bytes(lid) == pre.ask("block", rid), (remote_kind, local_kind)
                    untouched = sorted(set(range(48)) - set(local_ids))[:4]
                    zero = bytes(spec(local_kind).block_bytes)
                    assert all(dec.cache.block_bytes(b) == zero for b in untouched)
                    assert pre.ask("state", request_id) == "completed"
        finally:
            pre.stop()


@pytest.mark.parametrize("transport", ["nixl", "ipc"])
def test_attention_over_pulled_cache_matches_prefill_kv(transport: str) -> None:
    prefill_dev, decode_dev = pairs_of_devices()[-1]
    pre = PrefillProcess.start(spec(LayoutKind.CROSS_LAYER), device=prefill_dev, transport=transport)
    try:
        pre.ask("randn", 7)
        seq_len, remote_ids = 120, [9, 3, 30, 31, 12, 50, 2, 44]  # 8 blocks of 16 tokens
        local_ids = [1, 2, 3, 4, 20, 21, 22, 40]
        with decoder(LayoutKind.BLOCKS_FIRST, decode_dev, transport=transport) as dec:
            dec.pull(pre.lease("attn", remote_ids), local_ids).wait(60)
            from torch.nn.attention import SDPBackend, sdpa_kernel

            from kvconnect.engine.attention import BatchItem, build_batch, paged_attention

            gen = torch.Generator(device="cpu").manual_seed(1)
            for layer in range(GEOMETRY["num_layers"]):
                k_ref, v_ref = pre.ask("kv", layer, remote_ids)  # (blocks, bs, H, D) on CPU
                k_ref = k_ref.reshape(-1, 8, 128)[:seq_len].to(decode_dev)
                v_ref = v_ref.reshape(-1, 8, 128)[:seq_len].to(decode_dev)
                q = torch.randn(1, 32, 128, generator=gen).to(decode_dev, torch.bfloat16)
                k_cache, v_cache = dec.cache.kv(layer)
                batch = build_batch([BatchItem([0], seq_len - 1, local_ids)], 16, decode_dev)
                paged = paged_attention(q, k_cache, v_cache, batch, scale=128**-0.5)
                # PyTorch's FlashAttention-2 kernel over K/V read from the pulled cache via the block table
                table = torch.tensor(local_ids, device=decode_dev)
                k_pulled = k_cache[table].reshape(-1, 8, 128)[:seq_len]
                v_pulled = v_cache[table].reshape(-1, 8, 128)[:seq_len]

                def sdpa(k, v, q=q):
                    qh = q.transpose(0, 1).unsqueeze(0)  # (1, 32, 1, D)
                    kh = k.repeat_interleave(4, dim=1).transpose(0, 1).unsqueeze(0)
                    vh = v.repeat_interleave(4, dim=1).transpose(0, 1).unsqueeze(0)
                    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                        return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh)

                assert torch.equal(sdpa(k_pulled, v_pulled), sdpa(k_ref, v_ref))
                dense = sdpa(k_ref, v_ref)[0].transpose(0, 1)  # (1, 32, D)
                torch.testing.assert_close(paged.float(), dense.float(), atol=2e-2, rtol=2e-2)
    finally:
        pre.stop()


@pytest.mark.parametrize("case", ["2to1_nhd16_to_hnd64_staging", "1to2_hnd_direct_two_readers", "2to1_replicated_head"])
def test_heterogeneous_tp_groups_on_vram(case: str) -> None:
    """The multi-process TP-group pulls of tests/test_hetero_pull.py with every cache in VRAM: the staging
    scatter runs on the GPU; prefill ranks and decode ranks spread over the GPUs there are."""
    from tests.hetero_groups import run_group

    count = torch.cuda.device_count()
    stats = run_group(case, lambda side, rank: f"cuda:{(rank + (side == 'decode')) % count}")
    assert all(s["bytes"] > 0 for s in stats)


def test_a_connector_built_right_before_a_graph_capture_leaves_the_capture_valid() -> None:
    """vLLM captures CUDA graphs (global capture mode) right after it registers its KV cache. The IPC gather's
    warm-up then ran on the connector's loop thread and invalidated the capture ("operation not permitted when
    stream is capturing"): the engine failed to start. Now the warm-up is done when the connector returns,
    and the loop thread's own CUDA calls run in relaxed capture mode."""
    from kvconnect.core.device import CAPTURE_MODE_RELAXED, capture_mode

    torch.cuda.set_device(0)
    x = torch.zeros(1, device="cuda:0")
    cache = KVCache.allocate(spec(LayoutKind.BLOCKS_FIRST, 16), device="cuda:0")
    with KVConnector(cache, config_for_tests()) as conn:  # (transport auto: the IPC gather warms up)
        graph, launches = torch.cuda.CUDAGraph(), 0
        window_end = time.monotonic() + 2.0  # keep the capture open while the loop thread starts and settles
        with torch.cuda.graph(graph):  # torch's default capture mode is global, as vLLM's
            while time.monotonic() < window_end:
                x.add_(1)
                launches += 1
                tick_end = time.monotonic() + 0.01
                while time.monotonic() < tick_end:  # (a window held open, not a wait for anything)
                    pass
        graph.replay()
        torch.cuda.synchronize()
        assert x.item() == launches > 0
        modes: list[int | None] = []
        conn._loop.call(lambda: modes.append(capture_mode()))
        conn.wait_idle()
        assert modes == [CAPTURE_MODE_RELAXED]
        assert conn.snapshot().ipc_gather_unavailable == 0


def test_the_gather_posts_with_driver_calls_and_wraps_its_ring_byte_exact() -> None:
    """A request's gather is posted with three CUDA driver calls (its ids' upload, its graph's launch, an event),
    not torch's wrappers, which cost 0.22-0.39 ms on a vLLM engine thread. Three times the ring's slots of
    gathers posted back to back (slots reused while earlier gathers may still run) land byte-exact, and the
    torch path, kept for a torch without raw graph handles, lands the same bytes."""
    from kvconnect.core.plan.descriptors import PairPlan
    from kvconnect.core.transports import ipc_gather

    torch.cuda.set_device(0)
    s = spec(LayoutKind.BLOCKS_FIRST, 64)
    src = KVCache.allocate(s, device="cuda:0")
    src.fill_pattern(1)
    pair = PairPlan.build(s, s)
    rng = np.random.default_rng(9)
    moves = [(rng.choice(64, 2, replace=False).astype(np.int64), np.array([2 * i, 2 * i + 1])) for i in range(24)]
    for driver in (True, False):
        dst = KVCache.allocate(s, device="cuda:0")
        gather = ipc_gather.IpcGather(ipc_gather.MappedPeer(bases=[], region_addrs=src.base_addrs()), pair, dst)
        assert gather._slots is not None  # (torch 2.8 and later hand out raw graph handles)
        if not driver:
            gather._slots.close()
            gather._slots = None
        assert len(moves) == 3 * ipc_gather._RING
        done = [gather.post(local, remote) for remote, local in moves]
        deadline = time.monotonic() + 10
        while not all(d.query() for d in done) and time.monotonic() < deadline:
            pass
        assert all(d.query() for d in done)
        for remote, local in moves:
            for r, loc in zip(remote, local, strict=True):
                assert dst.block_bytes(int(loc)) == src.block_bytes(int(r)), (driver, r, loc)
        gather.close()

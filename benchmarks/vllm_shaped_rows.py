"""Ladder rows for vLLM-shaped CUDA caches: a Llama-3-8B request (32 layers, 8 KV heads x 128, bf16, block 16,
4096 tokens = 256 blocks, 512 MiB) pulled between caches built as vLLM's GPU backends allocate them and
registered through the vLLM plug-in's `describe` on both sides (prefill in its own process).

    python3 benchmarks/vllm_shaped_rows.py [--reps 10] [--warmup 2] [--decode-device cuda:1]

Per row: 2 warm-up pulls, `reps` timed pulls of scattered block ids (a fresh draw each), the first timed pull's
blocks checked byte for byte against the prefill's (a sample of 32 blocks: the full check runs in
tests/gpu/test_gpu_vllm.py), and after each pull a torch copy of the same bytes between the same devices (the
ceiling). GB/s = bytes / (post + transfer); e2e = bytes / (requested -> usable).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import uuid

import numpy as np
import torch

from kvconnect.bench.ceiling import CopyCeiling
from kvconnect.core.config import connector_config
from kvconnect.core.connector import KVConnector
from kvconnect.harness.prefill import PrefillProcess
from kvconnect.harness.vllm_shapes import make_views
from kvconnect.vllm.layout import describe

GEO = dict(layers=32, heads=8, tokens=16, head_dim=128)
REQUEST_BLOCKS = 256
ROWS = [
    ("LBNHC", "per-layer pages (FlashAttention NHD)"),
    ("BLNHC", "block-outermost pages"),
    ("split:blocks_first", "per-layer (B, 2, N, H, D)"),
    ("split:cross_layer", "block-outermost (B, L, 2, N, H, D)"),
]


def views(shape: str, blocks: int, device: str):
    return make_views(shape, GEO["layers"], blocks, GEO["heads"], GEO["tokens"], GEO["head_dim"], device=device)


def row(shape: str, transport: str, args: argparse.Namespace) -> dict:
    pre = PrefillProcess.launch(device=args.prefill_device, transport=transport)
    try:
        pre.wait_started()
        pre.setup_views(shape, {**GEO, "blocks": 4 * REQUEST_BLOCKS}, 3)
        pre.wait_setup()
        torch.cuda.set_device(torch.device(args.decode_device))
        v, raw = views(shape, 2 * REQUEST_BLOCKS, args.decode_device)
        d = describe(
            v,
            num_blocks=2 * REQUEST_BLOCKS,
            block_size=GEO["tokens"],
            tp_size=1,
            tp_rank=0,
            total_kv_heads=GEO["heads"],
            page="vllm:cuda",
        )
        ceiling = CopyCeiling(REQUEST_BLOCKS * d.cache.spec.block_bytes, args.prefill_device, args.decode_device)
        rng = np.random.default_rng(1)
        timed = []
        with KVConnector(d.cache, connector_config({}, side_channel_host="127.0.0.1", transport=transport)) as dec:
            for rep in range(args.warmup + args.reps):
                remote = [int(x) for x in rng.permutation(4 * REQUEST_BLOCKS)[:REQUEST_BLOCKS]]
                local = [int(x) for x in rng.permutation(2 * REQUEST_BLOCKS)[:REQUEST_BLOCKS]]
                request_id = f"r-{uuid.uuid4().hex[:8]}"
                stats = dec.pull(pre.lease(request_id, remote), local).wait(120)
                pre.settle(request_id, 30)  # the CONFIRM is sent without waiting: the next lease may reuse ids
                if rep == args.warmup:
                    for i in range(0, REQUEST_BLOCKS, REQUEST_BLOCKS // 32):
                        assert d.cache.block_bytes(local[i]) == pre.ask("block", remote[i]), (shape, transport, i)
                if rep >= args.warmup:
                    timed.append(stats)
                    ceiling.once()
        cg = ceiling.result().gbps_median
        gb = statistics.median(s.gbps for s in timed)
        e2e = statistics.median(s.bytes / s.total_s / 1e9 for s in timed)
        return {
            "shape": shape,
            "transport": transport,
            "descs": timed[0].num_descs,
            "kind": d.cache.spec.kind.value,
            "desc_bytes": timed[0].bytes // max(timed[0].num_descs, 1),
            "gbps": gb,
            "e2e": e2e,
            "ceiling": cg,
            "post_ms": statistics.median(s.post_s for s in timed) * 1e3,
            "xfer_ms": statistics.median(s.transfer_s for s in timed) * 1e3,
            "queued_ms": statistics.median(s.queued_s for s in timed) * 1e3,
            "confirm_ms": statistics.median(s.confirm_s for s in timed) * 1e3,
            "total_ms": statistics.median(s.total_s for s in timed) * 1e3,
        }
    finally:
        pre.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prefill-device", default="cuda:0")
    p.add_argument("--decode-device", default="cuda:0")
    p.add_argument("--transports", default="nixl,ipc")
    args = p.parse_args()
    print("$ python3 benchmarks/vllm_shaped_rows.py " + " ".join(sys.argv[1:]))
    print(
        f"{torch.cuda.get_device_name()}; {args.prefill_device} -> {args.decode_device}; 8B, 4096 tokens, "
        f"scattered ids, {args.reps} timed pulls after {args.warmup} warm-ups; medians"
    )
    print(
        f"{'vLLM cache':36} {'kvconnect':12} {'transport':9} {'descs':>6} {'desc KiB':>8} {'post ms':>8} "
        f"{'xfer ms':>8} {'queue ms':>8} {'conf ms':>8} {'total ms':>8} "
        f"{'GB/s':>7} {'e2e':>7} {'ceil':>7} {'%ceil':>6} {'e2e %':>6}",
        flush=True,
    )
    for shape, label in ROWS:
        for transport in args.transports.split(","):
            r = row(shape, transport, args)
            print(
                f"{shape + ' ' + label:36.36} {r['kind']:12} {transport:9} {r['descs']:6d} "
                f"{r['desc_bytes'] / 1024:8.0f} {r['post_ms']:8.2f} {r['xfer_ms']:8.2f} {r['queued_ms']:8.2f} "
                f"{r['confirm_ms']:8.2f} {r['total_ms']:8.2f} {r['gbps']:7.1f} "
                f"{r['e2e']:7.1f} {r['ceiling']:7.1f} {100 * r['gbps'] / r['ceiling']:5.0f}% "
                f"{100 * r['e2e'] / r['ceiling']:5.0f}%",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

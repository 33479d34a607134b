"""What the KV digest (kv_digest) costs per pull: summing a request's blocks on one side, next to a plain copy
of the same bytes on the same device (the ceiling every kvconnect benchmark prints).

    python benchmarks/digest_cost.py [--device cuda] [--tokens 512,4096] [--reps 5]

The cache is Llama-3-8B-shaped (32 layers, 8 KV heads of 128, bf16, 16-token blocks: 128 KiB per token),
in each layout; the request's blocks are scattered over a cache twice its size. Prints, per layout and
length, the best and median time of the digest and of the copy, and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from kvconnect.core.cache import KVCache
from kvconnect.core.digest import block_sums, digest
from kvconnect.core.plan.layout import CacheSpec, LayoutKind


def timed(fn: Callable[[], object], device: str, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def row(layout: LayoutKind, tokens: int, device: str, reps: int) -> str:
    blocks = tokens // 16
    spec = CacheSpec(
        kind=layout,
        dtype="bfloat16",
        num_layers=32,
        num_blocks=2 * blocks,
        block_size=16,
        num_kv_heads=8,
        head_dim=128,
        device=device.split(":")[0],
    )
    cache = KVCache.allocate(spec, device)
    cache.fill_pattern(1)
    ids = torch.randperm(2 * blocks, generator=torch.Generator().manual_seed(tokens))[:blocks].tolist()
    nbytes = blocks * spec.block_bytes
    src = torch.full((nbytes,), 7, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    block_sums(cache, ids)  # warm-up (kernels, pages)
    d = timed(lambda: digest(block_sums(cache, ids)), device, reps)
    c = timed(lambda: dst.copy_(src), device, reps)
    med_d, med_c = statistics.median(d), statistics.median(c)
    return (
        f"{layout.value:12} {tokens:5} tokens {nbytes / 2**20:5.0f} MiB  digest {min(d) * 1e3:8.2f} / "
        f"{med_d * 1e3:8.2f} ms  copy {min(c) * 1e3:7.2f} / {med_c * 1e3:7.2f} ms  digest/copy {med_d / med_c:5.2f}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", default="512,4096")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layouts", default="cross_layer,blocks_first,kv_first")
    args = ap.parse_args()
    print(f"device {args.device}; per layout and length: size, digest best/median, copy best/median, ratio")
    for layout in args.layouts.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            print(row(LayoutKind(layout), tokens, args.device, args.reps), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The IPC gather kernel alone: one process, one GPU, no peer process and no connector, against a copy of
the same bytes in the same process.

    python3 benchmarks/gather_one_gpu.py [--tokens 512,1024,2048,4096] [--reps 20]

On one GPU, kvconnect's vLLM P/D pull moved 512 MiB in ~2.1 ms where a same-GPU copy of those bytes takes
~0.26 ms. This separates the kernel from what surrounds it there (two processes sharing the GPU by time
slices, the loop's polling): both caches live in this process and the kernel reads the "prefill" cache
through its own address, as it reads a mapped peer's. Timed with CUDA events on the gather's stream, the
upload of the block ids included. Llama-3-8B-shaped (32 layers, 8 KV heads x 128, bf16, blocks of 16),
random distinct block ids on both sides, per layout and per kernel setting (chunk words, programs per SM).
Each gather is checked byte for byte against its source blocks once.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch

from kvconnect.core.cache import KVCache
from kvconnect.core.plan.descriptors import PairPlan
from kvconnect.core.plan.layout import CacheSpec, LayoutKind
from kvconnect.core.transports import ipc_gather

NUM_BLOCKS = 600  # > 4,096 tokens / 16


def spec(kind: LayoutKind) -> CacheSpec:
    return CacheSpec(kind, "bfloat16", 32, NUM_BLOCKS, 16, 8, 128, device="cuda")


def copy_ms(num_bytes: int, reps: int) -> float:
    """Best of `reps` device-to-device copies of `num_bytes`, CUDA events."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b))
    return best


def gather_ms(gather: ipc_gather.IpcGather, local: np.ndarray, remote: np.ndarray, reps: int) -> list[float]:
    stream = gather._stream  # (internals: a measuring script)
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        gather.post(local, remote)
        b.record(stream)
        b.synchronize()
        out.append(a.elapsed_time(b))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="512,1024,2048,4096")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--chunks", default="1024,4096,8192", help="words per work item")
    ap.add_argument("--programs", default="4,8,16", help="programs per SM")
    args = ap.parse_args()
    torch.cuda.set_device(0)
    print(torch.cuda.get_device_name(0), "torch", torch.__version__)
    rng = np.random.default_rng(0)
    print(
        f"{'layout':13s} {'chunk':>6s} {'prog/SM':>7s} {'tokens':>6s} {'MiB':>6s} {'units':>6s} "
        f"{'min ms':>7s} {'med ms':>7s} {'GB/s':>6s} {'copy ms':>7s} {'copy GB/s':>9s} {'% copy':>6s}"
    )
    for kind in (LayoutKind.BLOCKS_FIRST, LayoutKind.CROSS_LAYER):
        s = spec(kind)
        src, dst = KVCache.allocate(s, device="cuda:0"), KVCache.allocate(s, device="cuda:0")
        src.fill_pattern(1)
        pair = PairPlan.build(s, s)
        mapped = ipc_gather.MappedPeer(bases=[], region_addrs=src.base_addrs())  # (nothing to unmap)
        for chunk in (int(x) for x in args.chunks.split(",")):
            for programs in (int(x) for x in args.programs.split(",")):
                ipc_gather._CHUNK_WORDS, ipc_gather._PROGRAMS_PER_SM = chunk, programs
                gather = ipc_gather.IpcGather(mapped, pair, dst)
                for tokens in (int(x) for x in args.tokens.split(",")):
                    n = tokens // s.block_size
                    remote = rng.permutation(NUM_BLOCKS)[:n].astype(np.int64)
                    local = rng.permutation(NUM_BLOCKS)[:n].astype(np.int64)
                    gather.post(local, remote)
                    torch.cuda.synchronize()
                    for i in range(0, n, max(1, n // 4)):  # the bytes landed where they belong
                        assert dst.block_bytes(int(local[i])) == src.block_bytes(int(remote[i])), (kind, chunk, i)
                    times = gather_ms(gather, local, remote, args.reps)
                    nbytes = n * pair.unit_bytes * pair.local_units.num_units
                    best, med = min(times), statistics.median(times)
                    cp = copy_ms(nbytes, args.reps)
                    print(
                        f"{kind.value:13s} {chunk:6d} {programs:7d} {tokens:6d} {nbytes / 2**20:6.0f} "
                        f"{pair.local_units.num_units:6d} {best:7.3f} {med:7.3f} {nbytes / med / 1e6:6.0f} "
                        f"{cp:7.3f} {nbytes / cp / 1e6:9.0f} {100 * cp / med:5.0f}%",
                        flush=True,
                    )
                gather._stream.synchronize()
        del src, dst
        torch.cuda.empty_cache()
    ipc_gather._CHUNK_WORDS, ipc_gather._PROGRAMS_PER_SM = 4096, 8


if __name__ == "__main__":
    main()

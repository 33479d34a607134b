# ruff: noqa: B023, E501
"""Where the IPC gather's posting time goes (one process, both caches on one GPU; launch costs only).

python3 benchmarks/ipc_post_profile.py
"""

import time

import numpy as np
import torch

from kvconnect.core.cache import KVCache
from kvconnect.core.plan.descriptors import PairPlan
from kvconnect.core.plan.layout import CacheSpec, LayoutKind
from kvconnect.core.transports import ipc_gather


def timed(fn, n=200):
    torch.cuda.synchronize()
    best = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        best.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    return 1e6 * float(np.median(best))


dev = torch.device("cuda:0")
torch.cuda.set_device(dev)
for kind in (LayoutKind.CROSS_LAYER, LayoutKind.KV_FIRST):
    spec = CacheSpec(
        kind=kind,
        dtype="bfloat16",
        num_layers=32,
        num_blocks=320,
        block_size=16,
        num_kv_heads=8,
        head_dim=128,
        device="cuda",
    )
    src, dst = KVCache.allocate(spec), KVCache.allocate(spec)
    pair = PairPlan.build(spec, spec)
    mapped = ipc_gather.MappedPeer([], src.base_addrs())
    g = ipc_gather.IpcGather(mapped, pair, dst)
    rng = np.random.default_rng(0)
    lids, rids = rng.permutation(320)[:256], rng.permutation(320)[:256]
    loc, rem = pair.order_checked(lids, rids)
    pairs = np.stack([rem, loc], 1).astype(np.int64)
    pinned = torch.empty((256, 2), dtype=torch.int64, pin_memory=True)
    print(kind.value)
    print(f"  order_checked       {timed(lambda: pair.order_checked(lids, rids)):8.1f} us")
    print(f"  plan_validated      {timed(lambda: pair.plan_validated(loc, rem)):8.1f} us")
    print(f"  upload pageable     {timed(lambda: torch.from_numpy(pairs).to(dev, non_blocking=True)):8.1f} us")
    print(
        f"  upload pinned       {timed(lambda: pinned.copy_(torch.from_numpy(pairs)).to(dev, non_blocking=True)):8.1f} us"
    )
    print(f"  post (all)          {timed(lambda: g.post(loc, rem)):8.1f} us")
    ev = g.post(loc, rem)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    e = g.post(loc, rem)
    t1 = time.perf_counter()
    e.synchronize()
    t2 = time.perf_counter()
    print(
        f"  post {1e6 * (t1 - t0):.1f} us, kernel done after {1e6 * (t2 - t1):.1f} us (local copy, {256 * spec.block_bytes / (t2 - t0) / 1e9:.0f} GB/s)"
    )

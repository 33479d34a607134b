"""Where the IPC gather's posting time goes in the real two-process flow (prefill on cuda:0, decode on
cuda:1, Llama-3-8B cross_layer, 256 scattered blocks), plus the cost of one post alone.

    python3 benchmarks/ipc_post_steps.py
"""

import statistics
import time
import uuid
from collections import defaultdict

import numpy as np
import torch

from kvconnect.core.cache import KVCache
from kvconnect.core.config import connector_config
from kvconnect.core.connector import KVConnector
from kvconnect.core.plan.descriptors import PairPlan
from kvconnect.core.plan.layout import CacheSpec, LayoutKind
from kvconnect.core.transports import ipc_gather
from kvconnect.harness.prefill import PrefillProcess

steps: dict[str, list[float]] = defaultdict(list)


def timed(name, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            steps[name].append(time.perf_counter() - t0)

    return wrapper


def main() -> None:
    ipc_gather.IpcGather.post = timed("ipc.post", ipc_gather.IpcGather.post)
    PairPlan.bounds_checked = timed("bounds_checked", PairPlan.bounds_checked)
    PairPlan.summary = timed("summary", PairPlan.summary)
    spec = CacheSpec(
        kind=LayoutKind.CROSS_LAYER,
        dtype="bfloat16",
        num_layers=32,
        num_blocks=320,
        block_size=16,
        num_kv_heads=8,
        head_dim=128,
        device="cuda",
    )
    decode_dev = f"cuda:{min(torch.cuda.device_count() - 1, 1)}"  # the second GPU when there is one
    pre = PrefillProcess.start(spec, device="cuda:0", transport="ipc")
    torch.cuda.set_device(torch.device(decode_dev))
    dec = KVConnector(KVCache.allocate(spec, device=decode_dev), connector_config({}, transport="ipc"))
    print(f"prefill cuda:0, decode {decode_dev}")
    rng = np.random.default_rng(0)
    rows = []
    for i in range(40):
        rid = f"r{uuid.uuid4().hex[:6]}"
        deadline = time.monotonic() + 10  # the last pull's lease ends when its confirmation (not awaited) lands
        while pre.ask("held") and time.monotonic() < deadline:
            time.sleep(0.001)
        params = pre.lease(rid, [int(x) for x in rng.permutation(320)[:256]])
        s = dec.pull(params, [int(x) for x in rng.permutation(320)[:256]]).wait(30)
        if i == 9:
            steps.clear()
        if i >= 10:
            rows.append(s)
    print(f"medians over {len(rows)} pulls of {rows[0].bytes / 2**20:.0f} MiB (us)")
    for f in ["queued_s", "validate_s", "post_s", "transfer_s", "confirm_s", "total_s"]:
        print(f"  stats.{f:14s} {1e6 * statistics.median(getattr(r, f) for r in rows):8.1f}")
    for name, values in steps.items():
        print(f"  {name:20s} {1e6 * statistics.median(values):8.1f}")
    # bare launch cost, same kernel, same process, nothing else running
    gather = dec._decode.peers.all()[0].link._gather  # (internals: a profiling script)
    local = np.sort(rng.permutation(320)[:256]).astype(np.int64)
    remote = np.sort(rng.permutation(320)[:256]).astype(np.int64)
    for _ in range(5):
        gather.post(local, remote)
    torch.cuda.synchronize()
    steps.clear()
    for _ in range(50):
        gather.post(local, remote)
        torch.cuda.synchronize()
    print("  alone, synchronised between posts:")
    print(f"    ipc.post           {1e6 * statistics.median(steps['ipc.post']):8.1f}")
    dec.close()
    pre.stop()


if __name__ == "__main__":  # the prefill peer is a spawned process
    main()

"""Where a pull's time goes in the real two-process flow (prefill on cuda:0, decode on cuda:1).

python3 benchmarks/post_breakdown.py [ipc|nixl]
"""

import statistics
import sys
import uuid

import numpy as np
import torch

from kvconnect.core.cache import KVCache
from kvconnect.core.config import connector_config
from kvconnect.core.connector import KVConnector
from kvconnect.core.plan.layout import CacheSpec, LayoutKind
from kvconnect.harness.prefill import PrefillProcess


def main() -> None:
    transport = sys.argv[1] if len(sys.argv) > 1 else "ipc"
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
    pre = PrefillProcess.start(spec, device="cuda:0", transport=transport)
    torch.cuda.set_device(1)
    dec = KVConnector(KVCache.allocate(spec, device="cuda:1"), connector_config({}, transport=transport))
    rng = np.random.default_rng(0)
    rows = []
    for i in range(25):
        rid = f"r{uuid.uuid4().hex[:6]}"
        params = pre.lease(rid, [int(x) for x in rng.permutation(320)[:256]])
        s = dec.pull(params, [int(x) for x in rng.permutation(320)[:256]]).wait(30)
        if i >= 5:
            rows.append(s)
    fields = ["queued_s", "validate_s", "post_s", "transfer_s", "confirm_s", "total_s"]
    print(f"{transport}: medians over {len(rows)} pulls of {rows[0].bytes / 2**20:.0f} MiB")
    for f in fields:
        print(f"  {f:11s} {1e3 * statistics.median(getattr(r, f) for r in rows):7.3f} ms")
    rest = statistics.median(r.total_s - r.queued_s - r.post_s - r.transfer_s - r.confirm_s for r in rows)
    print(f"  {'other':11s} {1e3 * rest:7.3f} ms")
    dec.close()
    pre.stop()


if __name__ == "__main__":  # the prefill peer is a spawned process
    main()

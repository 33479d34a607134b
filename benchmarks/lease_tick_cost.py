"""What one connector tick costs as a worker's history grows: a prefill and a decode connector on this host
(NIXL on DRAM), the decode pulling one block at a time, both ticks timed after every `--step` pulls.

Every tick runs the lease table's expiry, on the engine's own thread too (the vLLM plug-in drives the connector
at every step while it holds leases or pulls). Ended leases stay a minute as tombstones, so a table that walked
all its leases at each tick cost more with every request served; the floor printed is a fresh connector's tick
in the same run, and each row gives its ratio to it.

    python benchmarks/lease_tick_cost.py [--pulls 1200] [--step 300]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

from kvconnect.core.cache import KVCache
from kvconnect.core.config import connector_config
from kvconnect.core.connector import KVConnector
from kvconnect.core.plan.layout import CacheSpec, LayoutKind

GEOMETRY = dict(dtype="float16", num_layers=4, block_size=16, num_kv_heads=2, head_dim=64)


def tick_us(conn: KVConnector, n: int = 400) -> float:
    """Median of `n` ticks of `conn`, in microseconds (taken the way a driving thread takes one)."""
    took: list[int] = []
    while len(took) < n:
        t0 = time.perf_counter_ns()
        if conn.drive():  # (False: the loop thread was in a tick, so none ran here)
            took.append(time.perf_counter_ns() - t0)
    return statistics.median(took) / 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pulls", type=int, default=1200)
    ap.add_argument("--step", type=int, default=300)
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    config = connector_config({}, side_channel_host="127.0.0.1", kv_digest=False)

    def connector() -> KVConnector:
        return KVConnector(KVCache.allocate(CacheSpec(kind=LayoutKind.BLOCKS_FIRST, num_blocks=64, **GEOMETRY)), config)

    with connector() as floor, connector() as prefill, connector() as decode:
        base = tick_us(floor)
        print(f"floor: a fresh connector's tick {base:.1f} us")
        heads = ("pulls done", 10), ("leases remembered", 18), ("prefill tick us", 16), ("x floor", 8)
        print(" ".join(f"{h:>{w}}" for h, w in heads), f"{'decode tick us':>15}")
        for done in range(args.pulls + 1):
            if done % args.step == 0:
                pre, dec = tick_us(prefill), tick_us(decode)
                remembered = len(prefill._leases._leases)  # (held and tombstones)
                print(f"{done:>10} {remembered:>18} {pre:>16.1f} {pre / base:>8.2f} {dec:>15.1f}")
            if done < args.pulls:
                params = prefill.lease(f"r{done}", [done % 64])
                decode.pull(params, [done % 64], f"r{done}").wait(30)


if __name__ == "__main__":
    main()

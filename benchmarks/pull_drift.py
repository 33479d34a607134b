"""Does a long-lived decode get slower with age? Thousands of pulls through one pair of connectors, each stage of
a pull in windows of the run, and what each side keeps.

One GPU run (`results/gpu/nixl-path-h100/min-idle/`) saw kvconnect's TTFT rise from run to run on servers that
had served the runs before, where fresh servers showed a smaller gap. This separates kvconnect's own part: a
prefill process (real NIXL on DRAM over UCX, its own connector) leases `--blocks` blocks at a time, chosen at
random out of its cache (a recycled, fragmented cache), and this process pulls them into random blocks of its
own with a `KVConnector` (`transport: nixl`, no board), `--pulls` times, one after the other. Printed: the
median of each stage of a pull per window of the run (the first window against the last, and a straight-line fit
of the whole pull's time against its index), each side's resident memory, and every container either
connector keeps that grew by a quarter of the pulls or more (`kvconnect/harness/growth.py`). Ended leases stay
as tombstones for a minute (`lease_ttl_s` x 2 at least): the prefill's lease table grows by the pulls of the
last minute, by design, and stops there. The ceiling: one thread's numpy copy of a pull's bytes in this process.

    PYTHONPATH=$PWD python benchmarks/pull_drift.py [--pulls 4000] [--windows 8] [--blocks 32] [--seed 1]
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time

import numpy as np

from kvconnect.bench.ceiling import CopyCeiling
from kvconnect.core.cache import KVCache
from kvconnect.core.config import connector_config
from kvconnect.core.connector import KVConnector
from kvconnect.core.plan.layout import CacheSpec, LayoutKind
from kvconnect.harness.growth import grown, rss_bytes, sizes
from kvconnect.harness.prefill import PrefillProcess

# Llama-3-8B's KV shape per layer (8 KV heads x 128, bfloat16 as float16), 8 of its 32 layers, 16-token blocks
SPEC = CacheSpec(LayoutKind.BLOCKS_FIRST, "float16", 8, 1024, 16, 8, 128)
# a pull's stages (PullStats, seconds); "other post" is post_s less its checked parts
STAGES = ("queued_s", "validate_s", "pin_s", "launch_s", "other_post_s", "transfer_s", "after_read_s", "total_s")


def stage_row(stats: object) -> list[float]:
    row = {k: float(getattr(stats, k, 0.0)) for k in STAGES if k != "other_post_s"}
    post = float(getattr(stats, "post_s", 0.0))
    row["other_post_s"] = max(post - row["validate_s"] - row["pin_s"] - row["launch_s"], 0.0)
    return [row[k] for k in STAGES]


def spin(stop: threading.Event) -> None:
    """Hold the interpreter as a busy engine thread does: pure Python, never blocking (until `stop`)."""
    x = 0
    while not stop.is_set():
        for i in range(10_000):
            x ^= i


def engine_pull(decode: KVConnector, params: object, local: list[int], rid: str, step_s: float) -> object:
    """A pull as the vLLM plug-in makes one: started to be driven, then `drive()` between engine steps (pure
    Python for `step_s`) until it is usable."""
    handle = decode.pull(params, local, rid, driven=True)  # type: ignore[arg-type]
    deadline = time.monotonic() + 60
    while not handle.done():
        decode.drive()
        end = time.perf_counter() + step_s
        while time.perf_counter() < end and not handle.done():
            sum(range(200))
        if time.monotonic() > deadline:
            raise TimeoutError(f"pull {rid} not usable after 60 s")
    return handle.wait(0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pulls", type=int, default=4000)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=32, help="blocks per pull")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--busy",
        action="store_true",
        help="a thread of pure Python in the decode process all along (an engine's step holding the interpreter)",
    )
    ap.add_argument(
        "--engine",
        action="store_true",
        help="this thread pulls as vLLM's plug-in does: the pull started to be driven, then driven by this thread "
        "between steps of pure Python (`--step-ms`) until usable",
    )
    ap.add_argument("--step-ms", type=float, default=2.0, help="with --engine: the Python work between drives")
    ap.add_argument(
        "--switch-ms", type=float, default=0.0, help="the interpreter's switch interval (0: Python's own, 5 ms)"
    )
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    if args.switch_ms:
        sys.setswitchinterval(args.switch_ms / 1e3)
    rng = np.random.default_rng(args.seed)
    busy = "; a busy Python thread beside the decode's connector" if args.busy else ""
    busy += f"; pulls driven by this thread between {args.step_ms:g} ms steps" if args.engine else ""
    busy += f"; switch interval {sys.getswitchinterval() * 1e3:g} ms"
    print(f"cache: {SPEC}; {args.pulls} pulls of {args.blocks} random blocks; seed {args.seed}{busy}")
    prefill = PrefillProcess.start(SPEC, kv_digest=False, lease_board=False)
    config = connector_config({}, side_channel_host="127.0.0.1", kv_digest=False, lease_board=False, transport="nixl")
    rows: list[list[float]] = []
    size = 0
    stop = threading.Event()
    if args.busy:
        threading.Thread(target=spin, args=(stop,), daemon=True, name="busy").start()
    try:
        with KVConnector(KVCache.allocate(SPEC), config) as decode:
            for i in range(-20, args.pulls):  # (20 warm-up pulls: the first contact's handshake, UCX's set-up)
                if i == 0:
                    start = (sizes(decode, "decode"), *prefill.ask("sizes"), rss_bytes())
                ids = [int(b) for b in rng.choice(SPEC.num_blocks, args.blocks, replace=False)]
                local = [int(b) for b in rng.choice(SPEC.num_blocks, args.blocks, replace=False)]
                params = prefill.lease(f"drift-{i}", ids, args.blocks * SPEC.block_size)
                if args.engine:
                    stats = engine_pull(decode, params, local, f"drift-{i}", args.step_ms / 1e3)
                else:
                    stats = decode.pull(params, local, f"drift-{i}").wait(60)
                size = stats.bytes
                if i >= 0:
                    rows.append(stage_row(stats))
            end = (sizes(decode, "decode"), *prefill.ask("sizes"), rss_bytes())
            held = prefill.ask("held")
    finally:
        stop.set()
        prefill.stop()
    report(np.array(rows) * 1e3, args, size, start, end, held)
    return 0


def report(ms: np.ndarray, args: argparse.Namespace, nbytes: int, start: tuple, end: tuple, held: int) -> None:
    copy = nbytes / CopyCeiling(nbytes, "cpu", "cpu").best_gbps(7) / 1e6  # (ms)
    print(f"a pull: {nbytes / 2**20:.2f} MiB; ceiling (one thread's numpy copy of those bytes): {copy:.3f} ms")
    print("median of each stage per window (ms):")
    print(f"{'pulls':>13} " + " ".join(f"{s.removesuffix('_s'):>12}" for s in STAGES) + f" {'total/copy':>11}")
    edges = np.linspace(0, len(ms), args.windows + 1).astype(int)
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        med = np.median(ms[lo:hi], axis=0)
        print(f"{lo:>6}-{hi - 1:<6} " + " ".join(f"{v:>12.3f}" for v in med) + f" {med[-1] / copy:>11.1f}")
    first, last = (np.median(ms[a:b, -1]) for a, b in ((edges[0], edges[1]), (edges[-2], edges[-1])))
    slope = np.polyfit(np.arange(len(ms)), ms[:, -1], 1)[0] * 1000
    print(
        f"whole pull: first window {first:.3f} ms, last {last:.3f} ms (x{last / first:.3f}); "
        f"fit {slope:+.4f} ms per 1,000 pulls; p99 over the run {np.percentile(ms[:, -1], 99):.3f} ms"
    )
    (dec0, pre0, pre_rss0, dec_rss0), (dec1, pre1, pre_rss1, dec_rss1) = start, end
    mib = 2**20
    print(
        f"resident memory: decode {dec_rss0 / mib:.1f} -> {dec_rss1 / mib:.1f} MiB, prefill {pre_rss0 / mib:.1f} -> "
        f"{pre_rss1 / mib:.1f} MiB; prefill blocks still leased at the end: {held}"
    )
    at_least = max(args.pulls // 4, 1)
    for side, before, after in (("decode", dec0, dec1), ("prefill", pre0, pre1)):
        more = grown(before, after, at_least)
        print(
            f"{side}: {len(after)} containers walked; grown by {at_least} or more over the {args.pulls} pulls: "
            + (", ".join(f"{p} {a} -> {b}" for p, (a, b) in more.items()) or "none")
        )


if __name__ == "__main__":
    sys.exit(main())

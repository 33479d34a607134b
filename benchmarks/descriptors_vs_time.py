"""Transfer time against descriptor count, from several `kvconnect bench --merge on,off --telemetry` runs.

Every case of a run moves the same bytes (one request, whole blocks); what differs is how many descriptors
NIXL issued for them: the layout (kv_first: one per layer, K or V, and block; blocks_first: one per layer and
block, what NixlConnector posts for vLLM 0.26's FlashAttention layout; cross_layer: one per block), the block
ids (contiguous, runs of 16 or 4, scattered: a recycled cache) and NIXL's merging of neighbours (on, off).
Prints one row per case with the median and the min-max over runs of the read's time (post + transfer), the
descriptors NIXL's telemetry counted, the same-run copy ceiling and the ratio to it; writes a plot of time
against descriptors.

    PYTHONPATH=$PWD python benchmarks/descriptors_vs_time.py results/cpu/descriptors/run{1,2,3}/descriptors.json \\
        --plot results/cpu/descriptors/time-vs-descriptors.png
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import msgspec
import numpy as np

from kvconnect.bench.report import BenchReport, CaseResult

PATTERNS = ("contiguous", "runs:16", "runs:4", "scattered")


def read_ms(case: CaseResult) -> float:
    """Median over the case's timed reps of one read, posting to completion."""
    return float(np.median([r.post_s + r.transfer_s for r in case.reps]) * 1e3)


def ceiling_ms(case: CaseResult) -> float:
    return float(np.median(case.ceiling.reps_s) * 1e3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="bench JSON files, one per run")
    ap.add_argument("--plot", type=Path, help="PNG: read time against descriptors issued")
    args = ap.parse_args(argv)
    reports = [msgspec.json.decode(p.read_bytes(), type=BenchReport) for p in args.runs]
    by_case: dict[tuple[str, str, bool], list[CaseResult]] = defaultdict(list)
    for report in reports:
        for c in report.cases:
            by_case[(c.pair, c.pattern, c.merge)].append(c)
    sizes = {c.bytes for cases in by_case.values() for c in cases}
    print(f"{len(reports)} runs; every read moves {sorted(sizes)} B; times in ms, median (min-max over runs)")
    head = ("layout pair", "pattern", "merge", "issued", "read ms", "ceiling ms", "read/ceiling")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    points = []
    order = sorted(by_case, key=lambda k: (k[0], PATTERNS.index(k[1]) if k[1] in PATTERNS else 9, not k[2]))
    for key in order:
        cases = by_case[key]
        ms = [read_ms(c) for c in cases]
        ceil = [ceiling_ms(c) for c in cases]
        counts = [c.num_descs_issued or c.num_descs_merged for c in cases]
        issued = sorted(set(counts))
        ratio = [m / c for m, c in zip(ms, ceil, strict=True)]
        points.append((key, int(np.median(counts)), ms))
        print(
            f"| {key[0]} | {key[1]} | {'on' if key[2] else 'off'} | {'/'.join(map(str, issued))} | "
            f"{np.median(ms):.1f} ({min(ms):.1f}-{max(ms):.1f}) | {np.median(ceil):.1f} ({min(ceil):.1f}-"
            f"{max(ceil):.1f}) | {np.median(ratio):.2f} ({min(ratio):.2f}-{max(ratio):.2f}) |"
        )
    print(
        "\nMerging off against on, the same ids in the same run (the only difference: descriptors), per run:\n"
        "| layout pair | pattern | descriptors on -> off | read ms on -> off | difference ms | us per extra one |"
        "\n|---|---|---|---|---|---|"
    )
    paired, same = [], []  # (extra descriptors, extra ms) where they differ by 1,000 or more; ms where equal
    for key in order:
        if not key[2] or (key[0], key[1], False) not in by_case:
            continue
        for on, off in zip(by_case[key], by_case[(key[0], key[1], False)], strict=True):
            n_on, n_off = (c.num_descs_issued or c.num_descs_merged for c in (on, off))
            t_on, t_off = read_ms(on), read_ms(off)
            per = "-"
            if n_off - n_on >= 1000:
                paired.append((n_off - n_on, t_off - t_on))
                per = f"{(t_off - t_on) * 1e3 / (n_off - n_on):.2f}"
            elif n_off == n_on:
                same.append(t_off - t_on)
            row = f"| {key[0]} | {key[1]} | {n_on} -> {n_off} | {t_on:.1f} -> {t_off:.1f} | {t_off - t_on:+.1f} |"
            print(f"{row} {per} |")
    dn, dt = np.array([p[0] for p in paired], dtype=float), np.array([p[1] for p in paired])
    print(
        f"paired, through the origin, over the {len(paired)} pairs 1,000+ descriptors apart: "
        f"{float(dt @ dn / (dn @ dn)) * 1e3:.2f} us per descriptor (each pair: {min(dt * 1e3 / dn):.2f} to "
        f"{max(dt * 1e3 / dn):.2f}); the same descriptors on and off ({len(same)} pairs, the noise): "
        + (f"{min(same):+.1f} to {max(same):+.1f} ms" if same else "none")
    )
    xs = np.array([p[1] for p in points], dtype=float)
    ys = np.array([np.median(p[2]) for p in points])
    slope, intercept = np.polyfit(xs, ys, 1)
    print(
        f"least squares over every case (layouts and id patterns pooled, not a controlled comparison): read ms = "
        f"{intercept:.1f} + {slope * 1e3:.2f} us x descriptors"
    )
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 5))
        layouts = (("kv_first:kv_first", "s"), ("blocks_first:blocks_first", "o"), ("cross_layer:cross_layer", "^"))
        for layout, marker in layouts:
            for merge, fill in ((True, "full"), (False, "none")):
                mine = [p for p in points if p[0][0] == layout and p[0][2] is merge]
                if not mine:
                    continue
                x = [p[1] for p in mine]
                y = [np.median(p[2]) for p in mine]
                err = [[np.median(p[2]) - min(p[2]) for p in mine], [max(p[2]) - np.median(p[2]) for p in mine]]
                name = f"{layout.split(':')[0]} merge {'on' if merge else 'off'}"
                ax.errorbar(x, y, yerr=err, fmt=marker, fillstyle=fill, capsize=3, label=name)
        ax.set_xscale("log")
        ax.set_xlabel("descriptors NIXL issued per request (telemetry)")
        ax.set_ylabel("read, post to completion (ms), median and min-max over runs")
        ax.set_title(f"Same {sorted(sizes)[0] / 2**20:.0f} MiB per read, {len(reports)} runs: time against descriptors")
        ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

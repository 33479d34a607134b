"""`kvconnect bench --plot`: the report's cases drawn with matplotlib (an optional dependency: `bench`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from kvconnect.bench.report import BenchReport, CaseResult, size_label

log = logging.getLogger(__name__)


def _plot_lines(axes: Any, cases: list[CaseResult], tokens: list[int], patterns: list[str], sweep: bool) -> None:
    """One line per series (layout pair, transport), one point per request length and pattern."""
    import matplotlib.pyplot as plt

    for i, name in enumerate(dict.fromkeys(c.series for c in cases)):
        color = plt.get_cmap("tab10")(i % 10)
        mine = [c for c in cases if c.series == name]
        for j, n in enumerate(tokens):
            line = sorted((c for c in mine if c.tokens == n), key=lambda c: c.bytes_per_desc)
            x = [c.bytes_per_desc for c in line]
            style = dict(
                color=color,
                marker="o",
                markersize=4 + 2.5 * j if sweep else 6,
                alpha=0.85,
                label=name if j == 0 else None,
            )
            axes[0].plot(x, [c.gbps_median for c in line], **style)
            medians = [c.gbps_median for c in line]
            axes[0].vlines(x, [c.gbps_p90 for c in line], medians, color=color, alpha=0.4)
            axes[1].plot(x, [c.pct_of_ceiling for c in line], **style)
        for k, pattern in enumerate(patterns if sweep else []):
            line = sorted((c for c in mine if c.pattern == pattern), key=lambda c: c.bytes)
            label = f"{name} {pattern}" if len(patterns) > 1 else name
            axes[2].plot(
                [c.bytes for c in line],
                [c.gbps_median for c in line],
                color=color,
                marker="o",
                ls=("-", "--", ":", "-.")[k % 4],
                label=label,
            )


def _point_label(case: CaseResult, pairs: int) -> str:
    label = f"tp{case.tp} {case.token_layouts}" + ("!" if case.hetero_path != "auto" else "")
    return f"{case.label} {label}" if pairs > 1 else label


def _plot_by_path(axes: Any, cases: list[CaseResult]) -> None:
    """Heterogeneous runs: one point per case, coloured by the path its pulls took, labelled with its TP and
    token layouts ('!' when the path was forced)."""
    import matplotlib.pyplot as plt

    pairs = len({c.label for c in cases})
    for i, path in enumerate(dict.fromkeys(c.path for c in cases)):
        color = plt.get_cmap("tab10")(i % 10)
        mine = [c for c in cases if c.path == path]
        x = [c.bytes_per_desc for c in mine]
        axes[0].vlines(x, [c.gbps_p90 for c in mine], [c.gbps_median for c in mine], color=color, alpha=0.4)
        for ax, y in ((axes[0], [c.gbps_median for c in mine]), (axes[1], [c.pct_of_ceiling for c in mine])):
            ax.scatter(x, y, color=color, s=30, alpha=0.85, label=path)
            for case, xi, yi in zip(mine, x, y, strict=True):
                ax.annotate(
                    _point_label(case, pairs),
                    (xi, yi),
                    xytext=(4, 3),
                    textcoords="offset points",
                    fontsize=6.5,
                    color=color,
                )


def write_plot(report: BenchReport, path: str | Path) -> None:
    """GB/s and % of ceiling against bytes per descriptor, one line per layout pair (per request length,
    when several were run, larger markers for longer requests); a third panel, GB/s against request
    size, when the run swept more than one request length. Heterogeneous runs: one labelled point per
    case, coloured by path (`_plot_by_path`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    cases = report.cases
    tokens = sorted({c.tokens for c in cases})
    patterns = list(dict.fromkeys(c.pattern for c in cases))
    hetero = report.options.hetero or any(c.hetero for c in cases)
    sweep = len(tokens) > 1 and not hetero
    fig, axes = plt.subplots(1, 3 if sweep else 2, figsize=(17 if sweep else 11.5, 4.8))
    if hetero:
        _plot_by_path(axes, cases)
    else:
        _plot_lines(axes, cases, tokens, patterns, sweep)
    if cases:
        ceiling = float(np.median([c.ceiling.gbps_median for c in cases]))
        axes[0].axhline(ceiling, color="gray", ls="--", lw=1, label=f"copy ceiling (median) {ceiling:.1f}")
    if sweep:
        sizes = sorted({c.bytes for c in cases})
        ceilings = [np.median([c.ceiling.gbps_median for c in cases if c.bytes == b]) for b in sizes]
        axes[2].plot(sizes, ceilings, color="gray", ls="--", lw=1, label="copy ceiling")
    titles = ["GB/s (median; bar down to p90)", "% of the same-run copy ceiling", "GB/s vs request size"]
    for ax, title in zip(axes, titles, strict=False):
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7.5)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: size_label(v)))
        ax.set_ylim(bottom=0)
    for ax in axes[:2]:
        ax.set_xlabel("bytes per descriptor (after merging)")
    axes[0].set_ylabel("GB/s")
    axes[1].set_ylim(0, max([105.0] + [c.pct_of_ceiling * 1.05 for c in cases]))
    axes[1].set_ylabel("% of ceiling")
    if sweep:
        axes[2].set_xlabel("request size")
    geo, opts = report.options.geometry, report.options
    block = f"{geo.block_size}" if geo.decode_block == geo.block_size else f"{geo.block_size}->{geo.decode_block}"
    fig.suptitle(
        f"kvconnect bench: {geo.model}, {geo.dtype}, block {block}, {','.join(patterns)} "
        f"ids, {','.join(map(str, tokens))} tokens, {opts.prefill_device} -> {opts.decode_device}",
        fontsize=11,
    )
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    log.info("wrote %s", out)

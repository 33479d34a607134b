"""The serve benchmarks' summaries across runs (`benchmarks/vllm_serve_gpu.py`, `benchmarks/vllm_serve_netns.py`):
a metric's median with its [min-max], a text table aligned by column, a target's points against the rate."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any


def spread(vals: Sequence[float]) -> str:
    """ "-" for none, the value for one, else "median [min-max]" (4 significant digits)."""
    if not vals:
        return "-"
    if len(vals) == 1:
        return f"{vals[0]:.4g}"
    return f"{statistics.median(vals):.4g} [{min(vals):.4g}-{max(vals):.4g}]"


def aligned(lines: list[list[str]]) -> str:
    """The lines' cells right-aligned to each column's widest, two spaces apart."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)) for line in lines)


def points(rows: list[dict[str, Any]], target: str, metric: str) -> list[tuple[float, float, float, float]]:
    """(rate, median, min, max) of `metric` over the runs, per request rate `target` served (rows without a rate
    or without the metric left out)."""
    out = []
    for rate in sorted({r["rate"] for r in rows if r["target"] == target and r["rate"]}):
        vals = [r[metric] for r in rows if r["target"] == target and r["rate"] == rate and r.get(metric)]
        if vals:
            out.append((rate, statistics.median(vals), min(vals), max(vals)))
    return out

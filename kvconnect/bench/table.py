"""The benchmark report as a text table: one row per case, a legend of its columns."""

from __future__ import annotations

import logging
import textwrap
from collections.abc import Callable

from kvconnect.bench.report import BenchReport, CaseResult, size_label

log = logging.getLogger(__name__)

SCHEMA = "kvconnect-bench/1"


# --- text ----------------------------------------------------------------------------------------

_Column = tuple[str, int, Callable[[CaseResult], str]]

_COLUMNS: tuple[_Column, ...] = (
    # header, width, formatter
    ("layout pair", 35, lambda c: c.label),
    ("tokens", 6, lambda c: str(c.tokens)),
    ("pattern", 10, lambda c: c.pattern),
    ("via", 4, lambda c: c.transport_used),
    ("MiB", 8, lambda c: f"{c.bytes / 2**20:.1f}"),
    ("descs", 7, lambda c: str(c.num_descs)),
    ("merged", 7, lambda c: str(c.num_descs_merged)),
    ("issued", 7, lambda c: str(c.num_descs_issued) if c.num_descs_issued else "-"),
    ("B/desc", 9, lambda c: size_label(c.bytes_per_desc)),
    ("post ms", 8, lambda c: f"{c.post_ms_median:.2f}"),
    ("xfer ms", 8, lambda c: f"{c.xfer_ms_median:.2f}"),
    ("GB/s", 7, lambda c: f"{c.gbps_median:.2f}"),
    ("p90", 7, lambda c: f"{c.gbps_p90:.2f}"),
    ("e2e", 7, lambda c: f"{c.e2e_gbps_median:.2f}"),
    ("ceil", 7, lambda c: f"{c.ceiling.gbps_median:.2f}"),
    ("%ceil", 6, lambda c: f"{c.pct_of_ceiling:.0f}%"),
    ("1st ms", 7, lambda c: f"{c.first_contact_s * 1e3:.1f}"),
)

# heterogeneous runs: these after the layout pair, "MiB" split into wire and useful, scatter after xfer
_HETERO_AFTER_PAIR: tuple[_Column, ...] = (
    ("tp", 4, lambda c: c.tp),
    ("tokens in", 9, lambda c: c.token_layouts),
    ("block", 6, lambda c: c.blocks),
    ("path", 15, lambda c: c.path + ("" if c.hetero_path == "auto" else "!")),
    ("src", 3, lambda c: str(c.num_sources)),
)
_HETERO_BYTES: tuple[_Column, ...] = (
    ("wire MiB", 8, lambda c: f"{c.bytes / 2**20:.1f}"),
    ("use MiB", 8, lambda c: f"{c.useful / 2**20:.1f}"),
)
_HETERO_SCATTER: _Column = ("scat ms", 8, lambda c: f"{c.scatter_ms_median:.2f}")


def columns(hetero: bool) -> tuple[_Column, ...]:
    """The table's columns: the homogeneous ones, or those with the heterogeneous pair's columns added."""
    if not hetero:
        return _COLUMNS
    out: list[_Column] = []
    for col in _COLUMNS:
        if col[0] == "MiB":
            out += _HETERO_BYTES
            continue
        out.append(col)
        if col[0] == "layout pair":
            out += _HETERO_AFTER_PAIR
        elif col[0] == "xfer ms":
            out.append(_HETERO_SCATTER)
    return tuple(out)


_LEGEND = (
    "layout pair = prefill:decode; via = transport used. descs/merged = descriptors per request before/after "
    "merging runs of adjacent blocks ('merge off': NIXL issued every one apart); issued = what NIXL's "
    "telemetry says it issued ('-': --telemetry off); B/desc after merging. post/xfer = median time to post (plan + "
    "make_prepped_xfer + transfer()) and from posting to completion; when transfer() completes the copy "
    "itself (UCX cma) the copy shows under post. GB/s = bytes / (post + xfer), median over reps; p90 = the "
    "same at the 90th percentile of (post + xfer), i.e. the slow tail; e2e = bytes / (pull requested -> "
    "blocks usable, lease confirmation included). ceil = a plain copy of the same bytes right after each "
    "timed pull ({ceiling}); %ceil = GB/s / ceil. 1st ms = first-contact cost (handshake: metadata fetch + "
    "remote agent + descriptor list preparation), paid by the first pull of every case (each case starts "
    "fresh connectors)."
)


_HETERO_LEGEND = (
    "Heterogeneous pairs: the bench is decode rank 0 of the decode TP group, reading every prefill rank it "
    "needs (one process per rank). tp = prefill:decode TP sizes (the model's KV heads split over each group); "
    "tokens in = NHD/HND inside a block, prefill:decode; block = tokens per block, prefill:decode. path = what "
    "the pulls used (block: same blocks; direct: token segments straight into the decode cache; staging: "
    "whole remote blocks into a staging cache, then a scatter); '!' = forced with hetero_path. src = prefill "
    "ranks read. wire MiB = bytes the READs moved; use MiB = decode rank 0's share (its heads of the "
    "request's tokens). descs/merged count every source's READ. scat ms = the scatter (summed over sources). "
    "Here GB/s, p90 and e2e count the useful bytes, over post + xfer + scatter (e2e: over the whole pull), "
    "and ceil copies the useful bytes."
)


def _row(cells: list[str], cols: tuple[_Column, ...] = _COLUMNS) -> str:
    """First column left-aligned, the rest right-aligned, each to its column's width."""
    widths = [w for _, w, _ in cols]
    first = cells[0].ljust(widths[0])
    return "  ".join([first] + [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)])


def format_table(report: BenchReport) -> str:
    """The human-readable report: geometry and environment, one row per case, a legend."""
    opts, geo = report.options, report.options.geometry
    env = report.environment
    hetero = opts.hetero or any(c.hetero for c in report.cases)
    cols = columns(hetero)
    block = (
        f"block {geo.block_size}"
        if geo.decode_block == geo.block_size
        else f"block {geo.block_size} (prefill) / {geo.decode_block} (decode)"
    )
    lines = [
        f"kvconnect bench: {geo.model} ({geo.num_layers} layers, {geo.num_kv_heads} kv heads, head_dim "
        f"{geo.head_dim}, {geo.dtype}), {block} tokens; {opts.prefill_device} -> "
        f"{opts.decode_device}; reps {opts.reps} (+{opts.warmup} warm-up); confirm "
        f"{'on' if opts.confirm else 'off'}; nixl threads {opts.nixl_threads}",
        "env: "
        + (" ".join(f"{k}={v}" for k, v in sorted(env.items()) if k.startswith(("UCX_", "NIXL_"))) or "(UCX defaults)"),
        "",
        _row([h for h, _, _ in cols], cols),
    ]
    lines += [_row([f(case) for _, _, f in cols], cols) for case in report.cases]
    verified = sum(c.verified_pulls for c in report.cases)
    verified_gib = sum(c.verified_bytes for c in report.cases) / 2**30
    loads = [c.load_1m for c in report.cases]
    lines += [
        "",
        *textwrap.wrap(
            _LEGEND.format(ceiling=report.cases[0].ceiling.kind if report.cases else "-"), 100, break_on_hyphens=False
        ),
        *(textwrap.wrap(_HETERO_LEGEND, 100, break_on_hyphens=False) if hetero else []),
        f"verified: {verified} pulls, {verified_gib:.2f} GiB, byte-exact.",
        f"load average (1 min, at the end of each case; this run's own processes add about 2): "
        f"{min(loads, default=0):.1f} to {max(loads, default=0):.1f}",
    ]
    return "\n".join(lines)

"""What `kvconnect bench` records and how it shows it: result structs, summary statistics, the text
table, the JSON file and the PNG plot.

Everything a run measured lives in one `BenchReport` (msgspec structs, so the JSON file is the same
object the table is printed from). Throughput figures are decimal GB/s (1e9 bytes per second).
"""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec
import numpy as np

log = logging.getLogger(__name__)

SCHEMA = "kvconnect-bench/1"


class Geometry(msgspec.Struct, frozen=True):
    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int  # the prefill side's tokens per block
    decode_block_size: int = 0  # the decode side's; 0 = block_size

    @property
    def decode_block(self) -> int:
        return self.decode_block_size or self.block_size


class BenchOptions(msgspec.Struct, frozen=True):
    """Everything that defines a run (parsed from the command line, or built by tests)."""

    geometry: Geometry
    tokens: list[int]
    layout_pairs: list[tuple[str, str]]  # (prefill layout, decode layout)
    patterns: list[str]  # "contiguous", "scattered", "runs:K"
    # connector transport per case: "nixl", "ipc" (same-host GPU gather kernel), "auto"
    transports: list[str] = msgspec.field(default_factory=lambda: ["nixl"])
    reps: int = 5
    warmup: int = 1
    seed: int = 0
    cache_factor: float = 1.25  # each side's cache holds this many times the request's blocks
    prefill_device: str = "cpu"
    decode_device: str = "cpu"
    ucx_env: dict[str, str] = {}
    nixl_threads: int = 0
    confirm: bool = True
    pull_timeout_s: float = 60.0
    progress: bool | None = None  # None: a bar when stderr is a terminal
    # heterogeneous pairs (hetero.py): (prefill TP, decode TP) sizes, (prefill, decode) token layouts, and
    # ConnectorConfig.hetero_path values to compare; geometry.num_kv_heads is the model's KV heads
    tp_pairs: list[tuple[int, int]] = msgspec.field(default_factory=lambda: [(1, 1)])
    token_layouts: list[tuple[str, str]] = msgspec.field(default_factory=lambda: [("NHD", "NHD")])
    hetero_paths: list[str] = msgspec.field(default_factory=lambda: ["auto"])
    # NIXL's merging of adjacent descriptors per case (False: skip_desc_merge, to measure what it saves), and
    # NIXL's per-transfer telemetry (the descriptors it really issued, per pull)
    merges: list[bool] = msgspec.field(default_factory=lambda: [True])
    telemetry: bool = False
    shuffle: bool = False  # run the cases in an order drawn from `seed` (runs with other seeds: other orders)

    @property
    def hetero(self) -> bool:
        """True when any option asks for a heterogeneous pair (the table then shows their columns)."""
        return (
            self.tp_pairs != [(1, 1)]
            or self.token_layouts != [("NHD", "NHD")]
            or self.hetero_paths != ["auto"]
            or self.geometry.decode_block != self.geometry.block_size
        )


class RepResult(msgspec.Struct, frozen=True):
    """One timed pull (seconds, from the connector's PullStats)."""

    post_s: float
    transfer_s: float
    confirm_s: float
    total_s: float
    num_descs_merged: int
    scatter_s: float = 0.0  # staging path: staging -> decode cache (summed over the sources)
    num_descs_issued: int = 0  # what NIXL's telemetry says it issued (0: telemetry off)


class Ceiling(msgspec.Struct, frozen=True):
    kind: str  # "memcpy (numpy, 1 thread)" or "torch copy cuda:0 -> cuda:1"
    bytes: int
    reps_s: list[float]
    gbps_median: float


class CaseResult(msgspec.Struct, frozen=True):
    prefill_layout: str
    decode_layout: str
    tokens: int
    pattern: str
    transport: str  # as asked for ("nixl", "ipc", "auto")
    transport_used: str  # as the pulls reported it
    num_blocks: int  # blocks of the request on the prefill side
    cache_blocks: int  # blocks in the prefill side's cache (ids are drawn from these)
    bytes: int  # what the READs moved per request (wire bytes; whole staged blocks on the staging path)
    granularity: str
    num_descs: int  # per request, before run merging
    num_descs_merged: int  # median over timed reps
    bytes_per_desc: float  # after merging
    first_contact_s: float  # handshake_s of the case's first pull: metadata + remote agent + list prep
    first_pull_total_s: float  # that first (cold) pull, requested -> usable
    reps: list[RepResult]
    gbps_median: float  # useful_bytes / (post + transfer + scatter)
    gbps_p90: float  # the same at the 90th percentile of (post + transfer): the slow tail
    e2e_gbps_median: float  # useful_bytes / total (pull requested -> blocks usable, confirmation included)
    post_ms_median: float
    xfer_ms_median: float
    confirm_ms_median: float
    total_ms_median: float
    ceiling: Ceiling
    pct_of_ceiling: float  # gbps_median / ceiling.gbps_median * 100
    verified_pulls: int  # every pull of the case, first and warm-up included
    verified_bytes: int
    load_1m: float = 0.0  # this machine's 1-minute load average when the case ended (noise hint)
    # heterogeneous pairs; the defaults describe a homogeneous case (and files written before these fields)
    prefill_tp: int = 1
    decode_tp: int = 1  # the bench measures decode rank 0 of this group
    prefill_token_layout: str = "NHD"
    decode_token_layout: str = "NHD"
    prefill_block_size: int = 0  # 0: the geometry's block_size
    decode_block_size: int = 0
    hetero_path: str = "auto"  # as asked (ConnectorConfig.hetero_path)
    path: str = "block"  # as the pulls reported it: block, direct, staging ("+"-joined over sources)
    num_sources: int = 1  # prefill ranks decode rank 0 read
    prefill_ranks: int = 1  # prefill processes in the case (ranks read, and copies nobody reads, released)
    useful_bytes: int = 0  # decode rank 0's share: its KV heads of tokens [0, n); 0 in older files (= bytes)
    scatter_ms_median: float = 0.0
    staging_mb: int = 0  # the decode connector's staging cache per source shape, sized from the request
    merge: bool = True  # NIXL merged adjacent descriptors (False: skip_desc_merge)
    num_descs_issued: int = 0  # median over timed reps of what NIXL's telemetry says it issued (0: off)

    @property
    def label(self) -> str:
        """The layout pair, and "merge off" when NIXL's merging was off."""
        return self.pair if self.merge else f"{self.pair} merge off"

    @property
    def pair(self) -> str:
        return f"{self.prefill_layout}:{self.decode_layout}"

    @property
    def useful(self) -> int:
        return self.useful_bytes or self.bytes

    @property
    def tp(self) -> str:
        return f"{self.prefill_tp}:{self.decode_tp}"

    @property
    def token_layouts(self) -> str:
        return f"{self.prefill_token_layout}:{self.decode_token_layout}"

    @property
    def blocks(self) -> str:
        return f"{self.prefill_block_size}:{self.decode_block_size or self.prefill_block_size}"

    @property
    def hetero(self) -> bool:
        return (
            self.tp != "1:1"
            or self.prefill_token_layout != self.decode_token_layout
            or self.path != "block"
            or self.prefill_block_size != (self.decode_block_size or self.prefill_block_size)
        )

    @property
    def series(self) -> str:
        """The plot's line: the layout pair (with TP, token layouts and path when heterogeneous), and the
        transport when it is not NIXL."""
        name = self.label
        if self.hetero:
            name += f" tp{self.tp} {self.token_layouts} {self.path}"
        return name if self.transport_used == "nixl" else f"{name} ({self.transport_used})"


class BenchReport(msgspec.Struct):
    schema: str
    command: list[str]
    options: BenchOptions
    environment: dict[str, str]  # UCX_*, NIXL_*, CUDA_VISIBLE_DEVICES as the run saw them
    system: dict[str, str]  # versions, CPU model, GPU names; nothing that names the host
    cases: list[CaseResult] = []


class HeteroFields(msgspec.Struct, frozen=True):
    """What a case adds when its pair is heterogeneous (copied into CaseResult's fields of the same names)."""

    prefill_tp: int
    decode_tp: int
    prefill_token_layout: str
    decode_token_layout: str
    prefill_block_size: int
    decode_block_size: int
    hetero_path: str
    path: str
    num_sources: int
    prefill_ranks: int
    staging_mb: int


def summarize_case(
    *,
    prefill_layout: str,
    decode_layout: str,
    tokens: int,
    pattern: str,
    transport: str,
    transport_used: str,
    num_blocks: int,
    cache_blocks: int,
    total_bytes: int,
    granularity: str,
    num_descs: int,
    first_contact_s: float,
    first_pull_total_s: float,
    reps: list[RepResult],
    ceiling: Ceiling,
    verified_pulls: int,
    verified_bytes: int,
    load_1m: float = 0.0,
    useful_bytes: int = 0,
    hetero: HeteroFields | None = None,
    merge: bool = True,
) -> CaseResult:
    """Medians and tails of the timed reps, plus the ratio to the same-run ceiling. Rates count the useful
    bytes (`useful_bytes`, default `total_bytes`: decode rank 0's share) over post + transfer + scatter."""
    useful = useful_bytes or total_bytes
    span_s = np.array([r.post_s + r.transfer_s + r.scatter_s for r in reps])
    total_s = np.array([r.total_s for r in reps])
    merged = int(np.median([r.num_descs_merged for r in reps]))
    gbps = useful / np.median(span_s) / 1e9
    extra = msgspec.structs.asdict(hetero) if hetero is not None else {}
    return CaseResult(
        prefill_layout=prefill_layout,
        decode_layout=decode_layout,
        tokens=tokens,
        pattern=pattern,
        transport=transport,
        transport_used=transport_used,
        num_blocks=num_blocks,
        cache_blocks=cache_blocks,
        bytes=total_bytes,
        granularity=granularity,
        num_descs=num_descs,
        num_descs_merged=merged,
        merge=merge,
        num_descs_issued=int(np.median([r.num_descs_issued for r in reps])),
        bytes_per_desc=total_bytes / max(merged, 1),
        first_contact_s=first_contact_s,
        first_pull_total_s=first_pull_total_s,
        reps=reps,
        gbps_median=float(gbps),
        gbps_p90=float(useful / np.percentile(span_s, 90) / 1e9),
        e2e_gbps_median=float(useful / np.median(total_s) / 1e9),
        post_ms_median=float(np.median([r.post_s for r in reps]) * 1e3),
        xfer_ms_median=float(np.median([r.transfer_s for r in reps]) * 1e3),
        confirm_ms_median=float(np.median([r.confirm_s for r in reps]) * 1e3),
        total_ms_median=float(np.median(total_s) * 1e3),
        ceiling=ceiling,
        pct_of_ceiling=float(100 * gbps / ceiling.gbps_median) if ceiling.gbps_median > 0 else 0.0,
        verified_pulls=verified_pulls,
        verified_bytes=verified_bytes,
        load_1m=load_1m,
        useful_bytes=useful,
        scatter_ms_median=float(np.median([r.scatter_s for r in reps]) * 1e3),
        **extra,
    )


def size_label(nbytes: float) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f}{unit}" if value >= 100 or value == int(value) else f"{value:.1f}{unit}"
    return f"{nbytes:.0f}B"


# --- files ---------------------------------------------------------------------------------------


def write_json(report: BenchReport, path: str | Path) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(msgspec.json.format(msgspec.json.encode(report), indent=1) + b"\n")
    log.info("wrote %s", out)


def read_json(path: str | Path) -> BenchReport:
    return msgspec.json.decode(Path(path).read_bytes(), type=BenchReport)

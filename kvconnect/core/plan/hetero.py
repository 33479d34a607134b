"""Plans for pairs whose blocks differ: tensor parallelism, block size, NHD/HND (pure, numpy).

Two decisions, both made once per peer at handshake time:

1. *Sources* (`plan_sources`): which prefill ranks a decode rank reads, and which KV heads from each. A decode
   rank with fewer heads than a prefill rank reads its slice from one rank; one with more heads reads a
   sub-range from each of several ranks. Where TP exceeds the KV heads, ranks hold copies of one head: a
   decode rank reads one copy, spread by rank, and copies nobody reads are released by one named decode
   rank so every prefill rank frees its blocks. A prefill rank read by several decode ranks counts them
   (`readers`) and frees its blocks after the last.
2. *Read path* (`ReadPath`, chosen by `plan_source`), per source:
   - `block`: the blocks are the same bytes on both sides; whole units, as for equal specs.
   - `direct`: NIXL places the pieces of each token segment straight into the decode cache with CHUNK
     descriptors (one piece per segment and K/V half where HND keeps a head slice contiguous, or NHD a
     token range of all heads; many small pieces otherwise). An engine's pages move as runs of heads
     (`head_run_pair`), or, between vLLM CPU pages of different block sizes, as the pieces of each
     segment their instruction set's layout allows (`cpu_pages.py`).
   - `staging`: whole remote blocks are read block for block into a staging cache shaped like the remote
     one, then scattered and permuted on the device (`staging.py`).
   `auto` takes the cheaper of the two by `CostModel` (a per-descriptor cost dominates: on a GPU, direct
   placement of HND head slices of 16 KiB costs ~16x the staging path; on DRAM the scatter is the slow
   part and direct wins), and never the direct path with several pieces per segment when staging is off.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import msgspec
import numpy as np

from kvconnect.core.errors import LayoutMismatchError
from kvconnect.core.plan.cpu_pages import page_pair
from kvconnect.core.plan.descriptors import PairPlan
from kvconnect.core.plan.layout import (
    CacheSpec,
    Granularity,
    UnitTable,
    check_compatible,
    holds_state,
    rank_heads,
    same_block_shape,
    tp_problem,
    unit_table,
)

PATHS = ("auto", "direct", "staging")  # ConnectorConfig.hetero_path


class ReadPath(str, enum.Enum):
    BLOCK = "block"
    DIRECT = "direct"
    STAGING = "staging"


@dataclass(frozen=True)
class Source:
    """One prefill rank a decode rank reads from."""

    rank: int
    heads: tuple[int, int]  # global KV heads [start, stop) read from it
    reader: int  # this decode rank's index among the decode ranks reading that prefill rank
    readers: int  # how many decode ranks read that prefill rank


@dataclass(frozen=True)
class Sources:
    reads: tuple[Source, ...]
    release_only: tuple[int, ...]  # prefill ranks nobody reads whose leases this decode rank releases


def _picks(model_heads: int, local_tp: int, local_rank: int, remote_tp: int) -> list[tuple[int, tuple[int, int]]]:
    start, stop = rank_heads(model_heads, local_tp, local_rank)
    if remote_tp <= model_heads:
        per = model_heads // remote_tp
        return [
            (r, (max(start, r * per), min(stop, (r + 1) * per))) for r in range(start // per, (stop - 1) // per + 1)
        ]
    copies = remote_tp // model_heads  # prefill ranks holding each head
    return [(h * copies + local_rank % copies, (h, h + 1)) for h in range(start, stop)]


def plan_sources(local: CacheSpec, remote_tp: int) -> Sources:
    """The prefill ranks (of `remote_tp`) that decode rank `local.tp_rank` reads, and the heads from each."""
    problem = tp_problem(local.model_kv_heads, remote_tp)
    if problem:
        raise LayoutMismatchError({"tp_size": (local.tp_size, remote_tp)}, f"prefill side: {problem}")
    picks = [_picks(local.model_kv_heads, local.tp_size, d, remote_tp) for d in range(local.tp_size)]
    readers: dict[int, list[int]] = {}
    for d, ranks in enumerate(picks):
        for r, _ in ranks:
            readers.setdefault(r, []).append(d)
    reads = tuple(
        Source(r, heads, readers[r].index(local.tp_rank), len(readers[r])) for r, heads in picks[local.tp_rank]
    )
    unread = tuple(r for r in range(remote_tp) if r not in readers and r % local.tp_size == local.tp_rank)
    return Sources(reads, unread)


@dataclass(frozen=True)
class SourcePlan:
    """How one source is pulled; `pair` is local<-remote (block, direct) or staging<-remote (staging)."""

    source: Source
    path: ReadPath
    pair: PairPlan
    reason: str  # why this path, for logs and the pull stats

    @property
    def staging_spec(self) -> CacheSpec | None:
        """The staging cache's spec (the local side of `pair`) on the staging path."""
        return self.pair.local_spec if self.path is ReadPath.STAGING else None

    @property
    def descs_per_block(self) -> int:
        """Descriptors per remote block before run merging."""
        return self.pair.remote_units.num_units

    def describe(self) -> str:
        lo, hi = self.source.heads
        return (
            f"rank {self.source.rank} heads [{lo},{hi}) via {self.path.value} ({self.reason}); "
            f"{self.pair.granularity.name} units of {self.pair.unit_bytes} B"
        )


def _inner_strides(spec: CacheSpec) -> dict[str, int]:
    """Element strides of a token slot and of a head inside one K or V block."""
    d = spec.head_dim
    if spec.token_layout == "NHD":
        return {"slot": spec.num_kv_heads * d, "head": d}
    return {"slot": d, "head": spec.block_size * d}


def chunk_geometry(
    local: CacheSpec, remote: CacheSpec, heads: tuple[int, int], seg_tokens: int
) -> tuple[int, np.ndarray, np.ndarray]:
    """The largest piece of one (segment, head slice) that is contiguous, in the same element order, on both
    sides: (elements per chunk, chunk offsets in elements on the local side, on the remote side)."""
    sizes = {"slot": seg_tokens, "head": heads[1] - heads[0]}
    ls, rs = _inner_strides(local), _inner_strides(remote)
    chunk, outer = local.head_dim, ["slot", "head"]
    grew = True
    while grew:
        grew = False
        for dim in list(outer):
            if sizes[dim] == 1 or (ls[dim] == chunk and rs[dim] == chunk):
                chunk *= sizes[dim]
                outer.remove(dim)
                grew = True
    outer.sort(key=lambda dim: -ls[dim])  # local address order
    grid = np.meshgrid(*[np.arange(sizes[dim], dtype=np.int64) for dim in outer], indexing="ij")
    idx = {dim: g.reshape(-1) for dim, g in zip(outer, grid, strict=True)}
    count = int(np.prod([sizes[dim] for dim in outer], dtype=np.int64))
    local_off = np.full(count, (heads[0] - local.head_range()[0]) * ls["head"], np.int64)
    remote_off = np.full(count, (heads[0] - remote.head_range()[0]) * rs["head"], np.int64)
    for dim, i in idx.items():
        local_off += i * ls[dim]
        remote_off += i * rs[dim]
    return chunk, local_off, remote_off


def _chunk_table(spec: CacheSpec, seg_tokens: int, offsets: np.ndarray, chunk_elems: int) -> UnitTable:
    """Units (half, segment of the block, chunk), in that order, of one side."""
    half = unit_table(spec, Granularity.HALF)
    isz = spec.itemsize
    seg = np.arange(spec.block_size // seg_tokens, dtype=np.int64) * seg_tokens * _inner_strides(spec)["slot"]
    off = half.offset_bytes[:, None, None] + (seg[None, :, None] + offsets[None, None, :]) * isz
    region = np.broadcast_to(half.region[:, None, None], off.shape)
    return UnitTable(
        Granularity.CHUNK, region.reshape(-1).copy(), off.reshape(-1), chunk_elems * isz, spec.block_stride_bytes
    )


def chunked_pair(local: CacheSpec, remote: CacheSpec, heads: tuple[int, int]) -> PairPlan:
    """A CHUNK plan moving `heads` token segment by token segment straight into the local cache."""
    g = math.gcd(local.block_size, remote.block_size)
    chunk, l_off, r_off = chunk_geometry(local, remote, heads, g)
    return PairPlan(
        local,
        remote,
        Granularity.CHUNK,
        _chunk_table(local, g, l_off, chunk),
        _chunk_table(remote, g, r_off, chunk),
        seg_tokens=g,
        chunks=int(l_off.size),
    )


def _head_runs(spec: CacheSpec, heads: tuple[int, int]) -> UnitTable:
    """Per layer, the run of `heads` inside an engine page whose outer dimension is the head."""
    layer = unit_table(spec, Granularity.LAYER)
    offset = layer.offset_bytes + (heads[0] - spec.head_range()[0]) * spec.head_page_bytes
    return UnitTable(
        Granularity.CHUNK,
        layer.region.copy(),
        offset,
        (heads[1] - heads[0]) * spec.head_page_bytes,
        spec.block_stride_bytes,
    )


def head_run_pair(local: CacheSpec, remote: CacheSpec, heads: tuple[int, int]) -> PairPlan:
    """Engine pages (`CacheSpec.page`) of different TP sizes: each block's run of `heads` moves as one piece per
    layer. The pages' interior is the engine's, so only whole heads of equal pages can move: the block sizes
    must match and heads must be the pages' outer dimension (token_layout HND) on both sides. Pages that hold
    a Mamba2 state beside K and V move as `state_pair` plans."""
    if holds_state(local.page) or holds_state(remote.page):
        raise LayoutMismatchError(
            {"tp_size": (local.tp_size, remote.tp_size)},
            f"{local.page} pages hold Mamba / linear-attention state beside K and V: they move whole, between "
            "workers of the same tensor-parallel size only",
        )
    _check_head_runs(local, remote)
    return PairPlan(
        local,
        remote,
        Granularity.CHUNK,
        _head_runs(local, heads),
        _head_runs(remote, heads),
        seg_tokens=local.block_size,
        chunks=1,
    )


def _check_head_runs(local: CacheSpec, remote: CacheSpec) -> None:
    mismatch = {
        name: (getattr(local, name), getattr(remote, name))
        for name in ("block_size", "token_layout")
        if getattr(local, name) != getattr(remote, name)
    }
    if mismatch or local.token_layout != "HND":
        raise LayoutMismatchError(
            mismatch or {"token_layout": (local.token_layout, remote.token_layout)},
            f"{local.page} pages can only exchange whole heads, with heads outermost in the "
            "page and the same block size on both sides",
        )


def state_pair(local: CacheSpec, remote: CacheSpec, heads: tuple[int, int]) -> PairPlan:
    """A Mamba2 hybrid's pages between ranks of different TP sizes, block for block: an attention block moves
    its run of `heads` per layer, a state block the runs of x channels, groups and SSM heads the two ranks share
    (`StateSpec.runs`), each at its own offset; `PairPlan.state_from` tells the two unit sets apart. Both sides
    must describe their state (`CacheSpec.state`) alike."""
    if local.state is None or remote.state is None:
        side = "local" if local.state is None else "remote"
        raise LayoutMismatchError(
            {"tp_size": (local.tp_size, remote.tp_size)},
            f"{local.page} pages hold Mamba / linear-attention state: between workers of different tensor-parallel "
            f"sizes kvconnect splits a Mamba2 state only, and the {side} worker does not describe it",
        )
    if max(local.head_replication, remote.head_replication) > 1:
        raise LayoutMismatchError(
            {"tp_size": (local.tp_size, remote.tp_size)},
            f"a Mamba2 hybrid over more ranks than its {local.model_kv_heads} KV heads: the ranks a decode rank reads "
            "heads from (one copy each) do not hold all of its state",
        )
    _check_head_runs(local, remote)
    runs = local.state.runs((local.tp_rank, local.tp_size), (remote.tp_rank, remote.tp_size))
    sizes = np.array([n for _, _, n in runs], dtype=np.int64)
    attention = [_head_runs(local, heads), _head_runs(remote, heads)]
    tables = []
    for spec, column, attn in ((local, 0, attention[0]), (remote, 1, attention[1])):
        layer = unit_table(spec, Granularity.LAYER)
        offsets = np.array([run[column] for run in runs], dtype=np.int64)
        region = np.concatenate([attn.region, np.repeat(layer.region, len(runs))])
        offset = np.concatenate([attn.offset_bytes, (layer.offset_bytes[:, None] + offsets[None, :]).reshape(-1)])
        unit_sizes = np.concatenate([attn.unit_sizes, np.tile(sizes, layer.num_units)])
        tables.append(
            UnitTable(Granularity.CHUNK, region, offset, int(unit_sizes.max()), spec.block_stride_bytes, unit_sizes)
        )
    return PairPlan(local, remote, Granularity.CHUNK, tables[0], tables[1], state_from=attention[0].num_units)


def staging_spec(remote: CacheSpec, num_blocks: int, device: str) -> CacheSpec:
    """A cache shaped like the remote one (so the read is block for block) with `num_blocks` blocks."""
    return msgspec.structs.replace(remote, num_blocks=num_blocks, device=device)


@dataclass(frozen=True)
class CostModel:
    """Rough time of moving one remote block: descriptors x a fixed cost each, bytes over the link, and bytes
    through the device scatter. The defaults below come from measurements with NIXL 1.5 / UCX, per device kind
    (results/gpu/h200-pair/ and results/cpu/ladder/: per-descriptor cost, link and scatter rates); the choice
    they feed (direct or staging) needs only their order of magnitude."""

    desc_s: float
    link_bps: float
    scatter_bps: float

    @classmethod
    def for_device(cls, device: str) -> CostModel:
        if device == "cuda":
            return cls(desc_s=4.6e-6, link_bps=350e9, scatter_bps=140e9)
        return cls(desc_s=4.6e-6, link_bps=6e9, scatter_bps=2.5e9)

    def read_s(self, pair: PairPlan) -> float:
        """One remote block's READ under `pair` (the whole direct path)."""
        units = pair.remote_units.num_units  # pieces per remote block
        return units * self.desc_s + units * pair.unit_bytes / self.link_bps

    def staging_s(self, pair: PairPlan, useful_bytes: int) -> float:
        """The READ into staging, then scattering the useful bytes."""
        return self.read_s(pair) + useful_bytes / self.scatter_bps


def _why(local: CacheSpec, remote: CacheSpec, heads: tuple[int, int]) -> str:
    parts = []
    if (local.head_range(), remote.head_range()) != (heads, heads):
        parts.append(f"heads {heads[0]}-{heads[1] - 1} of {local.head_range()} local / {remote.head_range()} remote")
    if local.block_size != remote.block_size:
        parts.append(f"block {remote.block_size}->{local.block_size}")
    if local.token_layout != remote.token_layout:
        parts.append(f"{remote.token_layout}->{local.token_layout}")
    return ", ".join(parts)


def plan_source(
    local: CacheSpec, remote: CacheSpec, source: Source, path: str = "auto", staging_blocks: int = 0
) -> SourcePlan:
    """Choose and build the path for one source (see the module doc). `path` forces direct or staging;
    `staging_blocks` sizes the staging cache. Raises LayoutMismatchError naming why a pair cannot be served."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    check_compatible(local, remote)
    lo, hi = source.heads
    for name, spec in (("local", local), ("remote", remote)):
        have = spec.head_range()
        if not (have[0] <= lo and hi <= have[1]):
            raise LayoutMismatchError(
                {"tp_rank": (local.tp_rank, remote.tp_rank)},
                f"{name} rank {spec.tp_rank}/{spec.tp_size} holds heads {have}, not the [{lo},{hi}) this pull needs",
            )
    if same_block_shape(local, remote):
        return SourcePlan(source, ReadPath.BLOCK, PairPlan.build(local, remote), "same blocks")
    why = _why(local, remote, source.heads)
    if (
        local.page
        and local.block_size != remote.block_size
        and not (holds_state(local.page) or holds_state(remote.page))
    ):
        return SourcePlan(source, ReadPath.DIRECT, page_pair(local, remote, source.heads), why + " (engine pages)")
    if local.page and (local.state is not None or remote.state is not None):
        return SourcePlan(source, ReadPath.DIRECT, state_pair(local, remote, source.heads), why + " (state pages)")
    if local.page:
        return SourcePlan(source, ReadPath.DIRECT, head_run_pair(local, remote, source.heads), why + " (engine pages)")
    direct = chunked_pair(local, remote, source.heads)
    if path == "direct":
        return SourcePlan(source, ReadPath.DIRECT, direct, why + " (forced)")
    if staging_blocks < 1:
        if path == "auto" and direct.chunks == 1:
            return SourcePlan(source, ReadPath.DIRECT, direct, why + " (contiguous; staging off)")
        raise LayoutMismatchError(
            {"token_layout": (local.token_layout, remote.token_layout)},
            f"{why} needs the staging path ({direct.chunks} pieces per segment otherwise) and staging is disabled",
        )
    stage = staging_spec(remote, staging_blocks, local.device)
    staged = PairPlan.build(stage, remote)
    model = CostModel.for_device(local.device)
    useful = direct.remote_units.num_units * direct.unit_bytes
    t_direct, t_staging = model.read_s(direct), model.staging_s(staged, useful)
    costs = (
        f"est. per block: direct {t_direct * 1e6:.0f} us ({direct.remote_units.num_units} x "
        f"{direct.unit_bytes} B), staging {t_staging * 1e6:.0f} us"
    )
    if path == "auto" and t_direct <= t_staging:
        return SourcePlan(source, ReadPath.DIRECT, direct, f"{why}; {costs}")
    forced = " (forced)" if path == "staging" else ""
    return SourcePlan(source, ReadPath.STAGING, staged, f"{why}; {costs}{forced}")

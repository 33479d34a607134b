"""What `kvconnect bench` measures: the cases (layout pairs, patterns, TP, token layouts, paths) and the
block ids each pull draws, as pure functions of the options and a seed."""

from __future__ import annotations

import itertools
import zlib
from dataclasses import dataclass, replace

import numpy as np

from kvconnect.bench.report import BenchOptions, Geometry
from kvconnect.core.plan.hetero import Source, Sources, plan_source, plan_sources
from kvconnect.core.plan.layout import CacheSpec, LayoutKind

# --- block ids -----------------------------------------------------------------------------------


def run_length(pattern: str, num_blocks: int) -> int:
    """Blocks per run of consecutive ids: `num_blocks` (contiguous), 1 (scattered) or K (runs:K)."""
    if pattern == "contiguous":
        return num_blocks
    if pattern == "scattered":
        return 1
    return int(pattern.split(":", 1)[1])


def cache_blocks_for(pattern: str, num_blocks: int, cache_factor: float) -> int:
    """Blocks in each side's cache: `cache_factor` x the request, and room for whole runs."""
    k = min(run_length(pattern, num_blocks), num_blocks)
    return max(int(np.ceil(num_blocks * cache_factor)), k * -(-num_blocks // k))


def draw_ids(rng: np.random.Generator, pattern: str, num_blocks: int, cache_blocks: int) -> np.ndarray:
    """`num_blocks` distinct ids in [0, cache_blocks), as runs of consecutive ids in random order."""
    k = min(run_length(pattern, num_blocks), num_blocks)
    if k == num_blocks:
        start = int(rng.integers(0, cache_blocks - num_blocks + 1))
        return np.arange(start, start + num_blocks, dtype=np.int64)
    slots = rng.choice(cache_blocks // k, -(-num_blocks // k), replace=False)
    return (slots[:, None] * k + np.arange(k)[None, :]).reshape(-1)[:num_blocks].astype(np.int64)


def pattern_rng(seed: int, pattern: str, tokens: int, rep: int) -> np.random.Generator:
    """The same ids for every layout pair of a (pattern, tokens, rep): pairs differ only in layout."""
    return np.random.default_rng([seed, zlib.crc32(pattern.encode()), tokens, rep + 1])


# --- cases --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CaseKey:
    """What distinguishes one case from another (block sizes are the run's, in its geometry)."""

    prefill_layout: str
    decode_layout: str
    pattern: str
    tokens: int
    transport: str
    tp: tuple[int, int] = (1, 1)  # (prefill, decode) TP sizes
    token_layouts: tuple[str, str] = ("NHD", "NHD")  # (prefill, decode)
    hetero_path: str = "auto"  # ConnectorConfig.hetero_path of the decode side
    merge: bool = True  # ConnectorConfig.merge_descs of the decode side

    @property
    def label(self) -> str:
        pair = f"{self.prefill_layout}:{self.decode_layout}" + ("" if self.merge else " merge off")
        if (self.tp, self.token_layouts, self.hetero_path) != ((1, 1), ("NHD", "NHD"), "auto"):
            pair += f" tp {self.tp[0]}:{self.tp[1]} {':'.join(self.token_layouts)} path {self.hetero_path}"
        return f"{pair} {self.tokens} tokens {self.pattern} via {self.transport}"


@dataclass(frozen=True)
class CaseShape:
    """Every cache of one case: decode rank 0's, each prefill rank's it involves, and what it reads."""

    decode: CacheSpec  # rank 0 of the decode TP group: the one this process measures
    prefill: dict[int, CacheSpec]  # by rank: the ranks decode rank 0 reads, and copies nobody reads (released)
    sources: Sources
    tokens: int
    plain: bool  # TP 1:1, same block size and token layout: whole blocks, verified block for block

    @property
    def reads(self) -> tuple[Source, ...]:
        return self.sources.reads

    @property
    def num_blocks(self) -> tuple[int, int]:
        """The request's blocks on the prefill side and on the decode side."""
        return -(-self.tokens // self.prefill[0].block_size), -(-self.tokens // self.decode.block_size)

    @property
    def useful_bytes(self) -> int:
        """Decode rank 0's share: its KV heads of tokens [0, n) (whole blocks for a plain case)."""
        d = self.decode
        if self.plain:
            return self.num_blocks[1] * d.block_bytes
        return self.tokens * d.num_layers * 2 * d.num_kv_heads * d.head_dim * d.itemsize

    @property
    def staging_mb(self) -> int:
        """Staging space (per source: the decode side keeps one staging cache per remote shape) that holds a
        request's remote blocks."""
        return max(1, -(-self.num_blocks[0] * self.prefill[0].block_bytes // 2**20))

    def paths(self, hetero_path: str) -> tuple[str, ...]:
        """The path each source takes: hetero.plan_source, as the decode side chooses it at handshake."""
        blocks = self.staging_mb * 2**20 // self.prefill[0].block_bytes
        return tuple(
            plan_source(self.decode, self.prefill[s.rank], s, hetero_path, blocks).path.value for s in self.reads
        )


def case_shape(
    geo: Geometry, key: CaseKey, cache_factor: float, prefill_device: str = "cpu", decode_device: str = "cpu"
) -> CaseShape:
    """The specs of a case; the model's KV heads (`geo.num_kv_heads`) split over each side's TP group."""
    (tp_p, tp_d), (order_p, order_d) = key.tp, key.token_layouts
    bs_p, bs_d = geo.block_size, geo.decode_block

    def spec(kind: str, tp: int, rank: int, block: int, order: str, device: str) -> CacheSpec:
        blocks = cache_blocks_for(key.pattern, -(-key.tokens // block), cache_factor)
        return CacheSpec(
            kind=LayoutKind(kind),
            dtype=geo.dtype,
            num_layers=geo.num_layers,
            num_blocks=blocks,
            block_size=block,
            num_kv_heads=max(geo.num_kv_heads // tp, 1),
            head_dim=geo.head_dim,
            device=device.split(":")[0],
            tp_size=tp,
            tp_rank=rank,
            token_layout=order,
            total_kv_heads=geo.num_kv_heads,
        )

    decode = spec(key.decode_layout, tp_d, 0, bs_d, order_d, decode_device)
    sources = plan_sources(decode, tp_p)
    ranks = sorted({s.rank for s in sources.reads} | set(sources.release_only))
    prefill = {r: spec(key.prefill_layout, tp_p, r, bs_p, order_p, prefill_device) for r in ranks}
    plain = key.tp == (1, 1) and order_p == order_d and bs_p == bs_d
    return CaseShape(decode, prefill, sources, key.tokens, plain)


def plan_cases(opts: BenchOptions) -> list[CaseKey]:
    """Every case of a run, in order (shuffled by the seed when asked). A case whose sources would take the same
    paths as an earlier one that differs only in hetero_path (every path of a pair with equal blocks; a forced
    path `auto` picks anyway) runs once, under the first hetero_path asked."""
    seen: set[tuple[CaseKey, tuple[str, ...]]] = set()
    out = []
    for pattern, tokens, transport, tp, orders, path, pair, merge in itertools.product(
        opts.patterns,
        opts.tokens,
        opts.transports,
        opts.tp_pairs,
        opts.token_layouts,
        opts.hetero_paths,
        opts.layout_pairs,
        opts.merges,
    ):
        key = CaseKey(pair[0], pair[1], pattern, tokens, transport, (tp[0], tp[1]), (orders[0], orders[1]), path, merge)
        ident = (replace(key, hetero_path=""), case_shape(opts.geometry, key, opts.cache_factor).paths(path))
        if ident not in seen:
            seen.add(ident)
            out.append(key)
    if opts.shuffle:
        return [out[i] for i in np.random.default_rng(opts.seed).permutation(len(out))]
    return out

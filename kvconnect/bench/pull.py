"""The two sides of `kvconnect bench`: prefill peers in their own processes, and the decode-side
measurement of one case in this one.

Each prefill process owns one `KVConnector` (its own NIXL agent and ZMQ side channel) over a cache filled
from a seed; it is driven over a pipe: `setup` (a fresh cache and connector per case, on a given side
channel port), `lease`, `settle` (wait until a lease ended), `release` and `stop`. A case with a prefill TP
group runs one process per prefill rank that decode rank 0 involves (ranks it reads, and copies of heads
nobody reads, which it releases); the ranks share the engine id and listen on consecutive ports. The decode
side (decode rank 0 of its group) builds a fresh connector per case too, so every case pays, and reports,
its own first contact. It verifies every pulled request against shadows of the prefill ranks' caches built
from the same seeds, and measures the copy ceiling for the same (useful) bytes.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import os
import socket
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import msgspec
import numpy as np
import torch

from kvconnect.bench.report import BenchOptions, CaseResult, Ceiling, Geometry, HeteroFields, RepResult, summarize_case
from kvconnect.core.cache import KVCache
from kvconnect.core.config import ConnectorConfig
from kvconnect.core.connector import KVConnector
from kvconnect.core.errors import KVConnectError, TransferError
from kvconnect.core.hetero import Source, Sources, plan_source, plan_sources
from kvconnect.core.layout import CacheSpec, LayoutKind
from kvconnect.core.protocol import KVTransferParams
from kvconnect.core.pull import PullHandle, PullStats

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 120.0


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


# --- prefill process -----------------------------------------------------------------------------


class _PrefillServer:
    """The prefill process's state: one cache and connector at a time, replaced by each `setup`."""

    def __init__(self, device: str, config: ConnectorConfig) -> None:
        self.device = device
        self.config = config
        self.connector: KVConnector | None = None
        self.cache: KVCache | None = None

    def handle(self, cmd: str, args: list[Any]) -> Any:
        if cmd == "setup":
            return self.setup(*args)
        if self.connector is None:
            raise KVConnectError(f"{cmd!r} before setup")
        if cmd == "lease":  # (request id, block ids, num_tokens)
            return msgspec.json.encode(self.connector.lease(*args))
        if cmd == "settle":
            return _settle(self.connector, args[0], args[1])
        if cmd == "release":  # end the lease if still held: (its final state, blocks this rank still leases)
            state = self.connector.release(args[0])
            return str(state.value), _drained(self.connector, _RELEASE_WAIT_S)
        raise KVConnectError(f"unknown command {cmd!r}")

    def setup(self, spec_raw: bytes, seed: int, port: int) -> int:
        self.close()  # release NIXL's hold, then the old cache's memory
        spec = msgspec.msgpack.decode(spec_raw, type=CacheSpec)
        self.cache = KVCache.allocate(spec, self.device)
        self.cache.fill_pattern(seed)
        _sync(self.device)
        self.connector = KVConnector(self.cache, msgspec.structs.replace(self.config, side_channel_port=port))
        return self.connector.side_channel_port

    def close(self) -> None:
        if self.connector is not None:
            self.connector.close()
        self.connector = self.cache = None


def _prefill_main(pipe: Any, env: dict[str, str], device: str, config: ConnectorConfig) -> None:
    """Entry point of the spawned prefill process: serve commands until `stop` or a closed pipe."""
    os.environ.update(env)  # before anything loads NIXL/UCX
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    server = _PrefillServer(device, config)
    pipe.send(("ok", os.getpid()))
    try:
        while True:
            try:
                cmd, *args = pipe.recv()
            except EOFError:
                break
            if cmd == "stop":
                break
            try:
                pipe.send(("ok", server.handle(cmd, args)))
            except Exception as e:  # report to the driver instead of dying
                pipe.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        server.close()


_RELEASE_WAIT_S = 10.0


def _drained(connector: KVConnector, timeout_s: float) -> int:
    """Blocks still leased once none are, or the deadline passed. A lease ended while a reader had it
    pinned hands its blocks back when that reader's confirmation (sent without waiting) arrives."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = connector.leases.num_blocks_held
        if held == 0 or time.monotonic() >= deadline:
            return held
        time.sleep(0.0005)


def _settle(connector: KVConnector, request_id: str, timeout_s: float) -> str:
    """Wait (polling, with a deadline) until the lease is no longer held; return its state."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = connector.leases.state(request_id)
        if state.value != "held" or time.monotonic() >= deadline:
            return str(state.value)
        time.sleep(0.0005)


@dataclass
class PrefillPeer:
    """The driver's handle on one prefill process."""

    proc: Any
    pipe: Any
    port: int = 0

    @classmethod
    def launch(cls, env: dict[str, str], device: str, config: ConnectorConfig) -> PrefillPeer:
        """Spawn the process; `wait_started` for its answer (launch several first to start them together)."""
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_prefill_main, args=(child, env, device, config), daemon=True,
                           name="kvconnect-bench-prefill")
        proc.start()
        child.close()
        return cls(proc, parent)

    def wait_started(self) -> None:
        self._answer("start", _START_TIMEOUT_S)

    def _answer(self, what: str, timeout_s: float) -> Any:
        if not self.pipe.poll(timeout_s):
            raise KVConnectError(f"prefill process did not answer {what!r} within {timeout_s:.0f}s")
        try:
            tag, value = self.pipe.recv()
        except EOFError as e:
            raise KVConnectError(
                f"prefill process exited during {what!r} (exit code {self.proc.exitcode})") from e
        if tag != "ok":
            raise KVConnectError(f"prefill process failed {what!r}: {value}")
        return value

    def ask(self, *cmd: Any, timeout_s: float = 60.0) -> Any:
        self.pipe.send(cmd)
        return self._answer(cmd[0], timeout_s)

    def setup(self, spec: CacheSpec, seed: int, port: int = 0) -> None:
        """Send a new cache spec (side channel on `port`, 0 = any); call `wait_setup` for the answer (fill
        the shadow meanwhile)."""
        self.pipe.send(("setup", msgspec.msgpack.encode(spec), seed, port))

    def wait_setup(self) -> None:
        self.port = int(self._answer("setup", _START_TIMEOUT_S))

    def lease(self, request_id: str, block_ids: list[int], num_tokens: int | None = None) -> KVTransferParams:
        return msgspec.json.decode(self.ask("lease", request_id, block_ids, num_tokens), type=KVTransferParams)

    def settle(self, request_id: str, timeout_s: float) -> str:
        return str(self.ask("settle", request_id, timeout_s, timeout_s=timeout_s + 10))

    def release(self, request_id: str) -> tuple[str, int]:
        """Release the lease if it is still held: (its final state, blocks this rank still leases)."""
        state, held = self.ask("release", request_id)
        return str(state), int(held)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.pipe.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(20)
        if self.proc.is_alive():
            log.warning("prefill process did not stop; killing pid %s", self.proc.pid)
            self.proc.kill()
            self.proc.join(5)
        self.pipe.close()


class PrefillGroup:
    """The prefill processes of a run, started as cases need them: a case with k prefill ranks uses the
    first k (same engine id, so a TP group's ranks are one engine to the decode side)."""

    def __init__(self, env: dict[str, str], device: str, config: ConnectorConfig) -> None:
        self.env, self.device, self.config = env, device, config
        self.peers: list[PrefillPeer] = []

    def take(self, count: int) -> list[PrefillPeer]:
        new = [PrefillPeer.launch(self.env, self.device, self.config) for _ in range(count - len(self.peers))]
        self.peers += new  # (stopped by `stop` even if one fails to start)
        for peer in new:
            peer.wait_started()
        return self.peers[:count]

    def stop(self) -> None:
        for peer in self.peers:
            peer.stop()


def free_port_run(count: int, host: str = "127.0.0.1") -> int:
    """A base port with `count` consecutive ports free on `host` (TP rank r listens on base + r)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((host, 0))
            base = probe.getsockname()[1]
        if base + count > 65536:
            continue
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                socks.append(socket.socket())
                socks[-1].bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise KVConnectError(f"no {count} consecutive free ports on {host}")


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

    @property
    def label(self) -> str:
        pair = f"{self.prefill_layout}:{self.decode_layout}"
        if (self.tp, self.token_layouts, self.hetero_path) != ((1, 1), ("NHD", "NHD"), "auto"):
            pair += (f" tp {self.tp[0]}:{self.tp[1]} {':'.join(self.token_layouts)} path {self.hetero_path}")
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
        return tuple(plan_source(self.decode, self.prefill[s.rank], s, hetero_path, blocks).path.value
                     for s in self.reads)


def case_shape(geo: Geometry, key: CaseKey, cache_factor: float, prefill_device: str = "cpu",
               decode_device: str = "cpu") -> CaseShape:
    """The specs of a case; the model's KV heads (`geo.num_kv_heads`) split over each side's TP group."""
    (tp_p, tp_d), (order_p, order_d) = key.tp, key.token_layouts
    bs_p, bs_d = geo.block_size, geo.decode_block

    def spec(kind: str, tp: int, rank: int, block: int, order: str, device: str) -> CacheSpec:
        blocks = cache_blocks_for(key.pattern, -(-key.tokens // block), cache_factor)
        return CacheSpec(kind=LayoutKind(kind), dtype=geo.dtype, num_layers=geo.num_layers, num_blocks=blocks,
                         block_size=block, num_kv_heads=max(geo.num_kv_heads // tp, 1), head_dim=geo.head_dim,
                         device=device.split(":")[0], tp_size=tp, tp_rank=rank, token_layout=order,
                         total_kv_heads=geo.num_kv_heads)

    decode = spec(key.decode_layout, tp_d, 0, bs_d, order_d, decode_device)
    sources = plan_sources(decode, tp_p)
    ranks = sorted({s.rank for s in sources.reads} | set(sources.release_only))
    prefill = {r: spec(key.prefill_layout, tp_p, r, bs_p, order_p, prefill_device) for r in ranks}
    plain = key.tp == (1, 1) and order_p == order_d and bs_p == bs_d
    return CaseShape(decode, prefill, sources, key.tokens, plain)


def plan_cases(opts: BenchOptions) -> list[CaseKey]:
    """Every case of a run, in order. A case whose sources would take the same paths as an earlier one that
    differs only in hetero_path (every path of a pair with equal blocks; a forced path `auto` picks anyway)
    runs once, under the first hetero_path asked."""
    seen: set[tuple[CaseKey, tuple[str, ...]]] = set()
    out = []
    for pattern, tokens, transport, tp, orders, path, pair in itertools.product(
            opts.patterns, opts.tokens, opts.transports, opts.tp_pairs, opts.token_layouts, opts.hetero_paths,
            opts.layout_pairs):
        key = CaseKey(pair[0], pair[1], pattern, tokens, transport, (tp[0], tp[1]), (orders[0], orders[1]), path)
        ident = (replace(key, hetero_path=""), case_shape(opts.geometry, key, opts.cache_factor).paths(path))
        if ident not in seen:
            seen.add(ident)
            out.append(key)
    return out


# --- verification and ceiling --------------------------------------------------------------------


def verify(local: KVCache, shadow: KVCache, local_ids: np.ndarray, remote_ids: np.ndarray) -> int:
    """Compare every pulled block with the shadow of the remote one, as raw bytes; returns bytes checked.

    Raises TransferError naming the first differing block, layer and half.
    """
    dev = local.regions[0].device
    li = torch.as_tensor(local_ids, device=dev)
    ri = torch.as_tensor(remote_ids, device=shadow.regions[0].device)
    checked = 0
    for layer in range(local.spec.num_layers):
        for half, got_t, want_t in zip("KV", local.kv(layer), shadow.kv(layer), strict=True):
            got = got_t.index_select(0, li).view(torch.uint8)
            want = want_t.index_select(0, ri).view(torch.uint8).to(dev)
            if not torch.equal(got, want):
                bad = (got != want).flatten(1).any(1).nonzero().flatten()
                i = int(bad[0])
                raise TransferError(
                    f"pulled bytes differ: local block {int(local_ids[i])} <- remote block "
                    f"{int(remote_ids[i])}, layer {layer} {half} ({int(bad.numel())} of {len(local_ids)} "
                    "blocks differ in this half)"
                )
            checked += got.numel()
    return checked


def token_rows(cache: KVCache, block_ids: np.ndarray, num_tokens: int, layer: int) -> tuple[torch.Tensor, ...]:
    """K and V of tokens [0, num_tokens) held in `block_ids` (token order) of one layer, each (tokens, H, D)."""
    idx = torch.as_tensor(block_ids, device=cache.regions[0].device)
    spec = cache.spec
    return tuple(view.index_select(0, idx).reshape(-1, spec.num_kv_heads, spec.head_dim)[:num_tokens]
                 for view in cache.kv(layer))


def verify_tokens(local: KVCache, local_ids: np.ndarray, shadows: dict[int, KVCache], sources: Sequence[Source],
                  remote_ids: np.ndarray, num_tokens: int) -> int:
    """Compare tokens [0, n) of every KV head of the local rank with the prefill rank each was read from
    (`shadows`, by rank, hold the same block ids), as raw bytes; returns bytes checked.

    Raises TransferError naming the first differing token, layer, half and source.
    """
    lo_d, hi_d = local.spec.head_range()
    covered = sorted(h for s in sources for h in range(*s.heads))
    if covered != list(range(lo_d, hi_d)):
        raise KVConnectError(f"sources cover heads {covered}, not the local rank's [{lo_d},{hi_d})")
    dev = local.regions[0].device
    checked = 0
    for layer in range(local.spec.num_layers):
        got_kv = token_rows(local, local_ids, num_tokens, layer)
        for src in sources:
            shadow = shadows[src.rank]
            (lo, hi), lo_r = src.heads, shadow.spec.head_range()[0]
            want_kv = token_rows(shadow, remote_ids, num_tokens, layer)
            for half, got_t, want_t in zip("KV", got_kv, want_kv, strict=True):
                got = got_t[:, lo - lo_d:hi - lo_d].contiguous().view(torch.uint8)
                want = want_t[:, lo - lo_r:hi - lo_r].to(dev).contiguous().view(torch.uint8)
                if not torch.equal(got, want):
                    bad = (got != want).flatten(1).any(1).nonzero().flatten()
                    t = int(bad[0])
                    raise TransferError(
                        f"pulled bytes differ: token {t} (local block {int(local_ids[t // local.spec.block_size])} "
                        f"<- prefill rank {src.rank} block {int(remote_ids[t // shadow.spec.block_size])}), layer "
                        f"{layer} {half}, heads [{lo},{hi}) ({int(bad.numel())} of {num_tokens} tokens differ)")
                checked += got.numel()
    return checked


class CopyCeiling:
    """A plain copy of the request's bytes from the prefill side's memory kind to the decode side's:
    one numpy memcpy on one thread for DRAM, a torch copy between the devices otherwise. One copy runs
    right after each timed pull, so pull and ceiling see the same machine state (this box is shared)."""

    def __init__(self, nbytes: int, src_device: str, dst_device: str) -> None:
        self.nbytes = nbytes
        self.src_device, self.dst_device = src_device, dst_device
        self.dram = src_device == "cpu" and dst_device == "cpu"
        self.times_s: list[float] = []
        if self.dram:
            self.src = np.full(nbytes, 0x5A, dtype=np.uint8)
            self.dst = np.empty_like(self.src)
            self.kind = "memcpy (numpy copyto, 1 thread)"
        else:
            self.src_t = torch.full((nbytes,), 0x5A, dtype=torch.uint8, device=src_device)
            self.dst_t = torch.empty(nbytes, dtype=torch.uint8, device=dst_device)
            self.kind = f"torch copy {src_device} -> {dst_device}"
        self._copy()  # pages faulted in, peer access set up, before anything is timed

    def _copy(self) -> float:
        if self.dram:
            t0 = time.perf_counter()
            np.copyto(self.dst, self.src)
            return time.perf_counter() - t0
        _sync(self.src_device)
        _sync(self.dst_device)
        t0 = time.perf_counter()
        self.dst_t.copy_(self.src_t)
        _sync(self.dst_device)
        _sync(self.src_device)
        return time.perf_counter() - t0

    def once(self) -> None:
        self.times_s.append(self._copy())

    def result(self) -> Ceiling:
        return Ceiling(kind=self.kind, bytes=self.nbytes, reps_s=self.times_s,
                       gbps_median=self.nbytes / float(np.median(self.times_s)) / 1e9)


# --- one case, decode side -----------------------------------------------------------------------


@dataclass
class PullOutcome:
    stats: PullStats
    verified_bytes: int
    scatter_s: float  # summed over the sources: their scatters run one after the other on the loop thread


def _scatter_s(handle: PullHandle) -> float:
    return sum(part.stats.scatter_s for part in handle.parts) if handle.parts else handle.stats.scatter_s


def rank_seed(fill_seed: int, rank: int) -> int:
    """Each prefill rank's cache gets its own bytes (rank 0 keeps the case's seed)."""
    return fill_seed + 1_000_003 * rank


class DecodeCase:
    """Pulls of one case over a fresh decode connector; `pull_once` is one verified request."""

    def __init__(self, peers: dict[int, PrefillPeer], shape: CaseShape, fill_seed: int, device: str,
                 config: ConnectorConfig, label: str) -> None:
        self.peers = peers  # by prefill rank
        self.shape = shape
        self.device = device
        self.label = label
        self.confirm = config.confirm_reads
        self.timeout_s = config.pull_timeout_s
        tp = shape.prefill[0].tp_size
        base = free_port_run(max(peers) + 1) if tp > 1 else 0  # a TP group's rank r listens on base + r
        seeds = {r: rank_seed(fill_seed, r) for r in peers}
        for rank, peer in peers.items():
            peer.setup(shape.prefill[rank], seeds[rank], base + rank if base else 0)
        # the read ranks' caches, rebuilt here from their seeds (while the prefill processes fill their own)
        self.shadows = {}
        for src in shape.reads:
            self.shadows[src.rank] = KVCache.allocate(
                msgspec.structs.replace(shape.prefill[src.rank], device=shape.decode.device), device)
            self.shadows[src.rank].fill_pattern(seeds[src.rank])
        self.local = KVCache.allocate(shape.decode, device)
        for peer in peers.values():
            peer.wait_setup()
        _sync(device)
        self.connector = KVConnector(self.local, config)
        self._count = 0

    def pull_once(self, local_ids: np.ndarray, remote_ids: np.ndarray) -> PullOutcome:
        self._count += 1
        request_id = f"{self.label}-{self._count}"
        for t in self.local.regions:  # stale bytes from an earlier pull must not pass verification
            t.view(torch.uint8).zero_()
        ids = [int(b) for b in remote_ids]
        num_tokens = None if self.shape.plain else self.shape.tokens  # block sizes may differ
        params = {rank: peer.lease(request_id, ids, num_tokens) for rank, peer in self.peers.items()}
        _sync(self.device)
        handle = self.connector.pull(params[0], [int(b) for b in local_ids], request_id=request_id)
        stats = handle.wait(self.timeout_s)
        self._end_leases(request_id)
        if self.shape.plain:
            checked = verify(self.local, self.shadows[0], local_ids, remote_ids)
        else:
            checked = verify_tokens(self.local, local_ids, self.shadows, self.shape.reads, remote_ids,
                                    self.shape.tokens)
        return PullOutcome(stats, checked, _scatter_s(handle))

    def _end_leases(self, request_id: str) -> None:
        """Every prefill rank's lease must end. A rank only decode rank 0 reads ends it by that read (the
        confirmation, or the notification: waited for); a rank other decode ranks would read too, or one
        holding a copy nobody reads, is released here. Then no rank may lease a block."""
        for src in self.shape.reads:
            if src.readers == 1:
                state = self.peers[src.rank].settle(request_id, self.timeout_s)
                if state != "completed":
                    raise TransferError(f"pull {request_id}: prefill rank {src.rank}'s lease ended {state}, "
                                        "not completed")
        for rank, peer in self.peers.items():
            state, held = peer.release(request_id)
            if held or state not in ("completed", "released"):
                raise TransferError(f"pull {request_id}: prefill rank {rank} still leases {held} blocks after "
                                    f"release (lease {state})")

    def close(self) -> None:
        self.connector.close()


def rep_result(outcome: PullOutcome) -> RepResult:
    stats = outcome.stats
    return RepResult(post_s=stats.post_s, transfer_s=stats.transfer_s, confirm_s=stats.confirm_s,
                     total_s=stats.total_s, num_descs_merged=stats.num_descs_merged, scatter_s=outcome.scatter_s)


def _draws(opts: BenchOptions, key: CaseKey, shape: CaseShape) -> list[tuple[np.ndarray, np.ndarray]]:
    """(local ids, remote ids) of every pull of a case: the same for every pair of a (pattern, tokens, rep)."""
    (nb_p, nb_d), cache_p, cache_d = shape.num_blocks, shape.prefill[0].num_blocks, shape.decode.num_blocks
    out = []
    for rep in range(1 + opts.warmup + opts.reps):
        rng = pattern_rng(opts.seed, key.pattern, key.tokens, rep)
        remote_ids = draw_ids(rng, key.pattern, nb_p, cache_p)
        out.append((draw_ids(rng, key.pattern, nb_d, cache_d), remote_ids))
    return out


def _check_pulls(index: int, key: CaseKey, shape: CaseShape, first: PullStats, timed: list[PullStats]) -> int:
    """What every case must show (one handshake, the transport and paths asked for, every source read, the
    same bytes each time); returns the bytes each pull moved."""
    if first.handshake_s <= 0 or any(s.handshake_s for s in timed):
        raise KVConnectError(f"case {index}: expected one handshake, on the first pull only")
    used = {s.transport for s in timed}
    if len(used) != 1 or (key.transport != "auto" and used != {key.transport}):
        raise KVConnectError(f"case {index}: asked for transport {key.transport}, pulls used {sorted(used)}")
    want_path = "+".join(sorted(set(shape.paths(key.hetero_path))))
    paths, sources = {s.path for s in timed}, {s.num_sources for s in timed}
    if paths != {want_path} or sources != {len(shape.reads)}:
        raise KVConnectError(f"case {index}: expected path {want_path} from {len(shape.reads)} prefill ranks, "
                             f"pulls used {sorted(paths)} from {sorted(sources)}")
    moved = {s.bytes for s in timed}
    if len(moved) != 1 or (shape.plain and moved != {shape.useful_bytes}) or min(moved) < shape.useful_bytes:
        raise KVConnectError(f"case {index}: pulls moved {sorted(moved)} bytes, expected "
                             f"{'' if shape.plain else 'one figure, at least '}{shape.useful_bytes}")
    return moved.pop()


def measure_case(group: PrefillGroup, opts: BenchOptions, index: int, key: CaseKey, config: ConnectorConfig,
                 tick: Callable[[], None]) -> CaseResult:
    """First-contact pull, warm-up pulls, then timed pulls each followed by one ceiling copy; every
    pull verified byte for byte, and every prefill rank's lease ended after it."""
    geo = opts.geometry
    shape = case_shape(geo, key, opts.cache_factor, opts.prefill_device, opts.decode_device)
    draws = _draws(opts, key, shape)
    ceiling = CopyCeiling(shape.useful_bytes, opts.prefill_device, opts.decode_device)
    peers = dict(zip(sorted(shape.prefill), group.take(len(shape.prefill)), strict=True))
    cfg = msgspec.structs.replace(config, transport=key.transport, hetero_path=key.hetero_path,
                                  staging_mb=shape.staging_mb)
    case = DecodeCase(peers, shape, fill_seed=opts.seed * 7919 + index + 1, device=opts.decode_device,
                      config=cfg, label=f"bench-{index}")
    outcomes = []
    try:
        for i, (local_ids, remote_ids) in enumerate(draws):
            outcomes.append(case.pull_once(local_ids, remote_ids))
            if i > opts.warmup:  # a timed pull: its ceiling copy now
                ceiling.once()
            tick()
    finally:
        case.close()
    first, timed = outcomes[0].stats, outcomes[1 + opts.warmup:]
    moved = _check_pulls(index, key, shape, first, [o.stats for o in timed])
    hetero = HeteroFields(
        prefill_tp=key.tp[0], decode_tp=key.tp[1], prefill_token_layout=key.token_layouts[0],
        decode_token_layout=key.token_layouts[1], prefill_block_size=geo.block_size,
        decode_block_size=geo.decode_block, hetero_path=key.hetero_path, path=timed[0].stats.path,
        num_sources=len(shape.reads), prefill_ranks=len(peers), staging_mb=shape.staging_mb)
    return summarize_case(
        prefill_layout=key.prefill_layout, decode_layout=key.decode_layout, tokens=key.tokens,
        pattern=key.pattern, transport=key.transport, transport_used=timed[0].stats.transport,
        num_blocks=shape.num_blocks[0], cache_blocks=shape.prefill[0].num_blocks, total_bytes=moved,
        granularity=first.granularity, num_descs=first.num_descs, first_contact_s=first.handshake_s,
        first_pull_total_s=first.total_s, reps=[rep_result(o) for o in timed], ceiling=ceiling.result(),
        verified_pulls=len(outcomes), verified_bytes=sum(o.verified_bytes for o in outcomes),
        load_1m=os.getloadavg()[0], useful_bytes=shape.useful_bytes, hetero=hetero,
    )

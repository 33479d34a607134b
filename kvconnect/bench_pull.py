"""The two sides of `kvconnect bench`: a prefill peer in its own process, and the decode-side
measurement of one case in this one.

The prefill process owns one `KVConnector` (its own NIXL agent and ZMQ side channel) over a cache
filled from a seed; it is driven over a pipe: `setup` (a fresh cache and connector per case), `lease`,
`settle` (wait until a lease ended) and `stop`. The decode side builds a fresh connector per case too,
so every case pays, and reports, its own first contact. It verifies every pulled request against a
shadow of the remote cache built from the same seed, and measures the copy ceiling for the same bytes.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import torch

from kvconnect.bench_report import BenchOptions, CaseResult, Ceiling, RepResult, summarize_case
from kvconnect.cache import KVCache
from kvconnect.config import ConnectorConfig
from kvconnect.connector import KVConnector
from kvconnect.errors import KVConnectError, TransferError
from kvconnect.layout import CacheSpec, LayoutKind
from kvconnect.protocol import KVTransferParams
from kvconnect.transfer import PullStats

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 120.0


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


# --- prefill process -----------------------------------------------------------------------------


def _prefill_main(pipe: Any, env: dict[str, str], device: str, config: ConnectorConfig) -> None:
    """Entry point of the spawned prefill process: serve commands until `stop` or a closed pipe."""
    os.environ.update(env)  # before anything loads NIXL/UCX
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    connector: KVConnector | None = None
    cache: KVCache | None = None
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
                if cmd == "setup":
                    if connector is not None:  # release NIXL's hold, then the old cache's memory
                        connector.close()
                        connector = cache = None
                    spec = msgspec.msgpack.decode(args[0], type=CacheSpec)
                    cache = KVCache.allocate(spec, device)
                    cache.fill_pattern(args[1])
                    _sync(device)
                    connector = KVConnector(cache, config)
                    pipe.send(("ok", connector.side_channel_port))
                elif connector is None:
                    raise KVConnectError(f"{cmd!r} before setup")
                elif cmd == "lease":
                    pipe.send(("ok", msgspec.json.encode(connector.lease(args[0], args[1]))))
                elif cmd == "settle":
                    pipe.send(("ok", _settle(connector, args[0], args[1])))
                else:
                    raise KVConnectError(f"unknown command {cmd!r}")
            except Exception as e:  # report to the driver instead of dying
                pipe.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        if connector is not None:
            connector.close()


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
    """The driver's handle on the prefill process."""

    proc: Any
    pipe: Any
    port: int = 0

    @classmethod
    def start(cls, env: dict[str, str], device: str, config: ConnectorConfig) -> PrefillPeer:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_prefill_main, args=(child, env, device, config), daemon=True,
                           name="kvconnect-bench-prefill")
        proc.start()
        child.close()
        peer = cls(proc, parent)
        peer._answer("start", _START_TIMEOUT_S)
        return peer

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

    def setup(self, spec: CacheSpec, seed: int) -> None:
        """Send a new cache spec; call `wait_setup` for the answer (fill the shadow meanwhile)."""
        self.pipe.send(("setup", msgspec.msgpack.encode(spec), seed))

    def wait_setup(self) -> None:
        self.port = int(self._answer("setup", _START_TIMEOUT_S))

    def lease(self, request_id: str, block_ids: list[int]) -> KVTransferParams:
        return msgspec.json.decode(self.ask("lease", request_id, block_ids), type=KVTransferParams)

    def settle(self, request_id: str, timeout_s: float) -> str:
        return str(self.ask("settle", request_id, timeout_s, timeout_s=timeout_s + 10))

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


class DecodeCase:
    """Pulls of one case over a fresh decode connector; `pull_once` is one verified request."""

    def __init__(self, peer: PrefillPeer, local_spec: CacheSpec, remote_spec: CacheSpec, fill_seed: int,
                 device: str, config: ConnectorConfig, label: str) -> None:
        self.peer = peer
        self.device = device
        self.label = label
        self.confirm = config.confirm_reads
        self.timeout_s = config.pull_timeout_s
        peer.setup(remote_spec, fill_seed)
        # the remote cache's bytes, rebuilt here from the seed (while the prefill process fills its own)
        shadow_spec = msgspec.structs.replace(remote_spec, device=local_spec.device)
        self.shadow = KVCache.allocate(shadow_spec, device)
        self.shadow.fill_pattern(fill_seed)
        self.local = KVCache.allocate(local_spec, device)
        peer.wait_setup()
        _sync(device)
        self.connector = KVConnector(self.local, config)
        self._count = 0

    def pull_once(self, local_ids: np.ndarray, remote_ids: np.ndarray) -> PullOutcome:
        self._count += 1
        request_id = f"{self.label}-{self._count}"
        for t in self.local.regions:  # stale bytes from an earlier pull must not pass verification
            t.view(torch.uint8).zero_()
        params = self.peer.lease(request_id, [int(b) for b in remote_ids])
        _sync(self.device)
        handle = self.connector.pull(params, [int(b) for b in local_ids], request_id=request_id)
        stats = handle.wait(self.timeout_s)
        if not self.confirm:  # the notification frees the lease; the next draw may reuse the blocks
            state = self.peer.settle(request_id, self.timeout_s)
            if state != "completed":
                raise TransferError(f"pull {request_id}: prefill lease ended {state}, not completed")
        return PullOutcome(stats, verify(self.local, self.shadow, local_ids, remote_ids))

    def close(self) -> None:
        self.connector.close()


def rep_result(stats: PullStats) -> RepResult:
    return RepResult(post_s=stats.post_s, transfer_s=stats.transfer_s, confirm_s=stats.confirm_s,
                     total_s=stats.total_s, num_descs_merged=stats.num_descs_merged)


@dataclass(frozen=True)
class CaseKey:
    """What distinguishes one case from another."""

    prefill_layout: str
    decode_layout: str
    pattern: str
    tokens: int
    transport: str

    @property
    def label(self) -> str:
        pair = f"{self.prefill_layout}:{self.decode_layout}"
        return f"{pair} {self.tokens} tokens {self.pattern} via {self.transport}"


def measure_case(peer: PrefillPeer, opts: BenchOptions, index: int, key: CaseKey, config: ConnectorConfig,
                 tick: Callable[[], None]) -> CaseResult:
    """First-contact pull, warm-up pulls, then timed pulls each followed by one ceiling copy; every
    pull verified byte for byte."""
    geo = opts.geometry
    pair, pattern, tokens, transport = (key.prefill_layout, key.decode_layout), key.pattern, key.tokens, \
        key.transport
    num_blocks = -(-tokens // geo.block_size)
    cache_blocks = cache_blocks_for(pattern, num_blocks, opts.cache_factor)

    def spec(kind: str, device: str) -> CacheSpec:
        return CacheSpec(kind=LayoutKind(kind), dtype=geo.dtype, num_layers=geo.num_layers,
                         num_blocks=cache_blocks, block_size=geo.block_size, num_kv_heads=geo.num_kv_heads,
                         head_dim=geo.head_dim, device=device.split(":")[0])

    draws = []
    for rep in range(1 + opts.warmup + opts.reps):
        rng = pattern_rng(opts.seed, pattern, tokens, rep)
        remote_ids = draw_ids(rng, pattern, num_blocks, cache_blocks)
        draws.append((draw_ids(rng, pattern, num_blocks, cache_blocks), remote_ids))
    total_bytes = num_blocks * spec(pair[0], opts.prefill_device).block_bytes
    ceiling = CopyCeiling(total_bytes, opts.prefill_device, opts.decode_device)
    case = DecodeCase(peer, spec(pair[1], opts.decode_device), spec(pair[0], opts.prefill_device),
                      fill_seed=opts.seed * 7919 + index + 1, device=opts.decode_device,
                      config=msgspec.structs.replace(config, transport=transport), label=f"bench-{index}")
    outcomes = []
    try:
        for i, (local_ids, remote_ids) in enumerate(draws):
            outcomes.append(case.pull_once(local_ids, remote_ids))
            if i > opts.warmup:  # a timed pull: its ceiling copy now
                ceiling.once()
            tick()
    finally:
        case.close()
    first, timed = outcomes[0].stats, [o.stats for o in outcomes[1 + opts.warmup:]]
    if first.handshake_s <= 0 or any(s.handshake_s for s in timed):
        raise KVConnectError(f"case {index}: expected one handshake, on the first pull only")
    used = {s.transport for s in timed}
    if len(used) != 1 or (transport != "auto" and used != {transport}):
        raise KVConnectError(f"case {index}: asked for transport {transport}, pulls used {sorted(used)}")
    if any(s.bytes != total_bytes for s in timed):
        raise KVConnectError(
            f"case {index}: pulls moved {[s.bytes for s in timed]} bytes, expected {total_bytes}")
    return summarize_case(
        prefill_layout=pair[0], decode_layout=pair[1], tokens=tokens, pattern=pattern, transport=transport,
        transport_used=used.pop(), num_blocks=num_blocks,
        cache_blocks=cache_blocks, total_bytes=total_bytes, granularity=first.granularity,
        num_descs=first.num_descs, first_contact_s=first.handshake_s, first_pull_total_s=first.total_s,
        reps=[rep_result(s) for s in timed], ceiling=ceiling.result(), verified_pulls=len(outcomes),
        verified_bytes=sum(o.verified_bytes for o in outcomes), load_1m=os.getloadavg()[0],
    )

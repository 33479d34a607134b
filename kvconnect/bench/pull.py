"""The two sides of `kvconnect bench`: prefill peers in their own processes, and the decode-side
measurement of one case in this one.

Each prefill process (`testing.prefill.PrefillProcess`) owns one `KVConnector` (its own NIXL agent and ZMQ
side channel) over a cache filled from a seed, replaced for every case. A case with a prefill TP
group runs one process per prefill rank that decode rank 0 involves (ranks it reads, and copies of heads
nobody reads, which it releases); the ranks share the engine id and listen on consecutive ports. The decode
side (decode rank 0 of its group) builds a fresh connector per case too, so every case pays, and reports,
its own first contact. It verifies every pulled request against shadows of the prefill ranks' caches built
from the same seeds, and measures the copy ceiling for the same (useful) bytes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from kvconnect.bench.cases import CaseKey, CaseShape, case_shape, draw_ids, pattern_rng
from kvconnect.bench.ceiling import CopyCeiling
from kvconnect.bench.report import BenchOptions, CaseResult, HeteroFields, RepResult, summarize_case
from kvconnect.core.cache import KVCache
from kvconnect.core.config import ConnectorConfig, HeteroPathChoice, TransportChoice
from kvconnect.core.connector import KVConnector
from kvconnect.core.decode.handle import PullHandle, PullStats
from kvconnect.core.errors import KVConnectError, TransferError
from kvconnect.core.plan.hetero import Source
from kvconnect.core.plan.params import new_lease_id
from kvconnect.harness.net import free_port_run
from kvconnect.harness.prefill import PrefillProcess

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 120.0


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


# --- prefill processes --------------------------------------------------------------------------


class PrefillGroup:
    """The prefill processes of a run, started as cases need them: a case with k prefill ranks uses the
    first k (same engine id, so a TP group's ranks are one engine to the decode side)."""

    def __init__(self, env: dict[str, str], device: str, config: ConnectorConfig) -> None:
        self.env, self.device = env, device
        self.config = msgspec.to_builtins(config)  # (crosses to the spawned processes as plain values)
        self.peers: list[PrefillProcess] = []

    def take(self, count: int) -> list[PrefillProcess]:
        new = [PrefillProcess.launch(self.env, self.device, **self.config) for _ in range(count - len(self.peers))]
        self.peers += new  # (stopped by `stop` even if one fails to start)
        for peer in new:
            peer.wait_started()
        return self.peers[:count]

    def stop(self) -> None:
        for peer in self.peers:
            peer.stop()


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
    return tuple(
        view.index_select(0, idx).reshape(-1, spec.num_kv_heads, spec.head_dim)[:num_tokens] for view in cache.kv(layer)
    )


def verify_tokens(
    local: KVCache,
    local_ids: np.ndarray,
    shadows: dict[int, KVCache],
    sources: Sequence[Source],
    remote_ids: np.ndarray,
    num_tokens: int,
) -> int:
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
                got = got_t[:, lo - lo_d : hi - lo_d].contiguous().view(torch.uint8)
                want = want_t[:, lo - lo_r : hi - lo_r].to(dev).contiguous().view(torch.uint8)
                if not torch.equal(got, want):
                    bad = (got != want).flatten(1).any(1).nonzero().flatten()
                    t = int(bad[0])
                    raise TransferError(
                        f"pulled bytes differ: token {t} (local block {int(local_ids[t // local.spec.block_size])} "
                        f"<- prefill rank {src.rank} block {int(remote_ids[t // shadow.spec.block_size])}), layer "
                        f"{layer} {half}, heads [{lo},{hi}) ({int(bad.numel())} of {num_tokens} tokens differ)"
                    )
                checked += got.numel()
    return checked


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

    def __init__(
        self,
        peers: dict[int, PrefillProcess],
        shape: CaseShape,
        fill_seed: int,
        device: str,
        config: ConnectorConfig,
        label: str,
    ) -> None:
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
                msgspec.structs.replace(shape.prefill[src.rank], device=shape.decode.device), device
            )
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
        lease_id = new_lease_id()  # one lease id for the group: a reader names it on every rank
        params = {rank: peer.lease(request_id, ids, num_tokens, lease_id) for rank, peer in self.peers.items()}
        _sync(self.device)
        handle = self.connector.pull(params[0], [int(b) for b in local_ids], request_id=request_id)
        stats = handle.wait(self.timeout_s)
        self._end_leases(request_id)
        if self.shape.plain:
            checked = verify(self.local, self.shadows[0], local_ids, remote_ids)
        else:
            checked = verify_tokens(
                self.local, local_ids, self.shadows, self.shape.reads, remote_ids, self.shape.tokens
            )
        return PullOutcome(stats, checked, _scatter_s(handle))

    def _end_leases(self, request_id: str) -> None:
        """Every prefill rank's lease must end. A rank only decode rank 0 reads ends it by that read (the
        confirmation, or the notification: waited for); a rank other decode ranks would read too, or one
        holding a copy nobody reads, is released here. Then no rank may lease a block."""
        for src in self.shape.reads:
            if src.readers == 1:
                state = self.peers[src.rank].settle(request_id, self.timeout_s)
                if state != "completed":
                    raise TransferError(
                        f"pull {request_id}: prefill rank {src.rank}'s lease ended {state}, not completed"
                    )
        for rank, peer in self.peers.items():
            state, held = peer.release(request_id)
            if held or state not in ("completed", "released"):
                raise TransferError(
                    f"pull {request_id}: prefill rank {rank} still leases {held} blocks after release (lease {state})"
                )

    def close(self) -> None:
        self.connector.close()


def rep_result(outcome: PullOutcome) -> RepResult:
    stats = outcome.stats
    return RepResult(
        post_s=stats.post_s,
        transfer_s=stats.transfer_s,
        confirm_s=stats.confirm_s,
        total_s=stats.total_s,
        num_descs_merged=stats.num_descs_merged,
        scatter_s=outcome.scatter_s,
        num_descs_issued=stats.num_descs_issued,
    )


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
        raise KVConnectError(
            f"case {index}: expected path {want_path} from {len(shape.reads)} prefill ranks, "
            f"pulls used {sorted(paths)} from {sorted(sources)}"
        )
    moved = {s.bytes for s in timed}
    if len(moved) != 1 or (shape.plain and moved != {shape.useful_bytes}) or min(moved) < shape.useful_bytes:
        raise KVConnectError(
            f"case {index}: pulls moved {sorted(moved)} bytes, expected "
            f"{'' if shape.plain else 'one figure, at least '}{shape.useful_bytes}"
        )
    return moved.pop()


def measure_case(
    group: PrefillGroup, opts: BenchOptions, index: int, key: CaseKey, config: ConnectorConfig, tick: Callable[[], None]
) -> CaseResult:
    """First-contact pull, warm-up pulls, then timed pulls each followed by one ceiling copy; every
    pull verified byte for byte, and every prefill rank's lease ended after it."""
    geo = opts.geometry
    shape = case_shape(geo, key, opts.cache_factor, opts.prefill_device, opts.decode_device)
    draws = _draws(opts, key, shape)
    ceiling = CopyCeiling(shape.useful_bytes, opts.prefill_device, opts.decode_device)
    peers = dict(zip(sorted(shape.prefill), group.take(len(shape.prefill)), strict=True))
    cfg = msgspec.structs.replace(
        config,
        transport=TransportChoice(key.transport),
        hetero_path=HeteroPathChoice(key.hetero_path),
        staging_mb=shape.staging_mb,
        merge_descs=key.merge,
    )
    case = DecodeCase(
        peers,
        shape,
        fill_seed=opts.seed * 7919 + index + 1,
        device=opts.decode_device,
        config=cfg,
        label=f"bench-{index}",
    )
    outcomes = []
    try:
        for i, (local_ids, remote_ids) in enumerate(draws):
            outcomes.append(case.pull_once(local_ids, remote_ids))
            if i > opts.warmup:  # a timed pull: its ceiling copy now
                ceiling.once()
            tick()
    finally:
        case.close()
    first, timed = outcomes[0].stats, outcomes[1 + opts.warmup :]
    moved = _check_pulls(index, key, shape, first, [o.stats for o in timed])
    hetero = HeteroFields(
        prefill_tp=key.tp[0],
        decode_tp=key.tp[1],
        prefill_token_layout=key.token_layouts[0],
        decode_token_layout=key.token_layouts[1],
        prefill_block_size=geo.block_size,
        decode_block_size=geo.decode_block,
        hetero_path=key.hetero_path,
        path=timed[0].stats.path,
        num_sources=len(shape.reads),
        prefill_ranks=len(peers),
        staging_mb=shape.staging_mb,
    )
    return summarize_case(
        prefill_layout=key.prefill_layout,
        decode_layout=key.decode_layout,
        tokens=key.tokens,
        pattern=key.pattern,
        transport=key.transport,
        transport_used=timed[0].stats.transport,
        num_blocks=shape.num_blocks[0],
        cache_blocks=shape.prefill[0].num_blocks,
        total_bytes=moved,
        granularity=first.granularity,
        num_descs=first.num_descs,
        first_contact_s=first.handshake_s,
        first_pull_total_s=first.total_s,
        reps=[rep_result(o) for o in timed],
        ceiling=ceiling.result(),
        verified_pulls=len(outcomes),
        verified_bytes=sum(o.verified_bytes for o in outcomes),
        load_1m=os.getloadavg()[0],
        useful_bytes=shape.useful_bytes,
        hetero=hetero,
        merge=key.merge,
    )

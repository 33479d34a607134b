"""Decode side: the prefill peers it knows, and what a handshake sets up for each.

A peer is one prefill rank (engine id + TP rank): its side channel, the incarnation and cache spec it
answered with, the plan chosen for it (`hetero.SourcePlan`) and the transport built for that plan. A
peer is *ready* once its transport exists; that is the last step of `PeerSet.setup`, so a set-up that
fails half way leaves a peer that is not ready and is dropped. Prepared local descriptor lists and
staging caches are shared by every peer that needs the same one. Loop thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import zmq

from kvconnect.core.agent import MemKind, NixlAgent, PreppedList
from kvconnect.core.board import BoardReader
from kvconnect.core.cache import KVCache
from kvconnect.core.config import ConnectorConfig
from kvconnect.core.decode.pull import PullPhase
from kvconnect.core.decode.staging import StagingPool, reserve
from kvconnect.core.errors import CapacityError, InvalidRequestError, LayoutMismatchError
from kvconnect.core.plan.descriptors import strided_descriptor_array, token_span
from kvconnect.core.plan.hetero import Path, Source, SourcePlan, Sources, plan_source, plan_sources
from kvconnect.core.plan.layout import CacheSpec
from kvconnect.core.transports.base import Transport
from kvconnect.core.transports.nixl_read import NixlRead
from kvconnect.core.transports.registry import FastPaths
from kvconnect.core.wire import protocol as p
from kvconnect.core.wire.handshake import PeerChannel
from kvconnect.core.wire.lease_client import ShortChannels

if TYPE_CHECKING:
    from kvconnect.core.decode.pull import Pull

log = logging.getLogger(__name__)
MAX_PEERS = 256  # prefill ranks known at once; beyond, an idle one is forgotten (or a first contact refused)
MAX_HANDSHAKING = 32  # first contacts in flight at once (each one a socket to wherever its params point)
MAX_STAGING_POOLS = 4  # staging caches (one per remote shape, up to staging_mb each) a decode allocates at most


@dataclass
class Peer:
    engine_id: str
    host: str
    port: int
    channel: PeerChannel
    source: Source
    remote_tp: int = 1
    hello_sent_s: float = 0.0
    info: p.PeerInfo | None = None
    agent_name: str = ""
    plan: SourcePlan | None = None
    transport: Transport | None = None
    waiting: list[Pull] = field(default_factory=list)  # pulls waiting for the handshake
    confirming: dict[str, Pull] = field(default_factory=dict)  # by message ref: a PIN or CONFIRM answer due
    board: BoardReader | None = None  # its lease board, when it is on this host (board.py)

    @property
    def ready(self) -> bool:
        return self.transport is not None

    @property
    def key(self) -> str:
        return peer_key(self.engine_id, self.source.rank)

    def take_overdue(self, now: float) -> tuple[list[Pull], list[Pull]]:
        """Remove and return the pulls past their deadline (or cancelled): those waiting for this peer's
        handshake, and those waiting for a lease answer after their transfer (a PIN answer pending while the
        transfer runs is covered by the transfer's own deadline)."""
        waiting = [x for x in self.waiting if x.handle.cancel_requested or now >= x.deadline_s]
        self.waiting = [x for x in self.waiting if not any(x is y for y in waiting)]
        confirming = []
        for ref, pull in list(self.confirming.items()):
            if pull.phase is not PullPhase.POSTED and (pull.handle.cancel_requested or now >= pull.deadline_s):
                del self.confirming[ref]
                self.channel.forget(ref)
                confirming.append(pull)
        return waiting, confirming


def peer_key(engine_id: str, rank: int) -> str:
    return f"{engine_id}#{rank}"


class PeerSet:
    """The known peers, and the local resources their transports share."""

    def __init__(
        self,
        agent: NixlAgent,
        cache: KVCache,
        config: ConnectorConfig,
        ctx: zmq.Context,
        secret: bytes,
        fast_paths: FastPaths,
    ) -> None:
        self._agent = agent
        self._fast_paths = fast_paths
        self._cache = cache
        self._config = config
        self._ctx = ctx
        self._secret = secret
        self._mem = MemKind.for_device(cache.spec.device)
        self._peers: dict[str, Peer] = {}
        self._local_lists: dict[tuple[object, ...], PreppedList] = {}
        self.staging: dict[CacheSpec, StagingPool] = {}  # by staging spec (one per remote shape)
        self._sources: dict[int, Sources] = {}  # by remote TP size
        self.short = ShortChannels(ctx, secret)  # releases to ranks no peer is connected to

    def get(self, key: str) -> Peer | None:
        return self._peers.get(key)

    def all(self) -> list[Peer]:
        return list(self._peers.values())

    def new(
        self, engine_id: str, host: str, port: int, source: Source, remote_tp: int, busy: Callable[[Peer], bool]
    ) -> Peer:
        """A peer to handshake with (first contact). Bounded: at MAX_PEERS the least recently added idle one
        (`busy` says which are not) is forgotten; CapacityError when none is idle or MAX_HANDSHAKING first
        contacts are already in flight (params name any engine and host they like)."""
        handshaking = sum(1 for x in self._peers.values() if not x.ready)
        if handshaking >= MAX_HANDSHAKING:
            raise CapacityError(f"{handshaking} prefill handshakes in flight already (at most {MAX_HANDSHAKING})")
        if len(self._peers) >= MAX_PEERS:
            idle = next((x for x in self._peers.values() if x.ready and not busy(x)), None)
            if idle is None:
                raise CapacityError(f"{len(self._peers)} prefill peers known and none idle (at most {MAX_PEERS})")
            log.info("forgetting idle peer %s: %d peers known", idle.key, len(self._peers))
            self.forget(idle, keep_agent=False)
        peer = self.open(engine_id, host, port, source, remote_tp)
        self._peers[peer.key] = peer
        return peer

    def open(self, engine_id: str, host: str, port: int, source: Source, remote_tp: int) -> Peer:
        """A peer object with its own channel, not (yet) one of the known peers."""
        return Peer(engine_id, host, port, PeerChannel(self._ctx, host, port, self._secret), source, remote_tp)

    def adopt(self, peer: Peer) -> None:
        """Make `peer` (a proven claim: decode/claims.py) the known peer of its key."""
        self._peers[peer.key] = peer

    def known_tp(self, engine_id: str) -> int:
        """How many ranks `engine_id` runs, as its handshake said (0 if no rank of it has answered)."""
        for peer in self._peers.values():
            if peer.engine_id == engine_id and peer.info is not None:
                return peer.info.spec.tp_size
        return 0

    def forget(self, peer: Peer, keep_agent: bool) -> None:
        """Remove `peer`: its remote agent (unless `keep_agent`: a given-up READ still uses it; it is then
        freed when the NIXL agent closes), its transport and its channel."""
        self._peers.pop(peer.key, None)
        if peer.agent_name and not keep_agent:
            self._agent.remove_remote(peer.agent_name)
        if peer.transport is not None:
            peer.transport.close()
            peer.transport = None
        if peer.board is not None:
            peer.board.close()
            peer.board = None
        peer.channel.close()

    def stale(self, peer: Peer, pull: Pull) -> str:
        """How `pull`'s params disagree with what `peer` is ("" when they do not): another side-channel
        address, other heads, another incarnation. A claim to check, not a fact (decode/claims.py)."""
        if (peer.host, peer.port, peer.remote_tp) != (pull.remote_host, pull.remote_port, pull.remote_tp):
            return "another side channel address or TP size"
        if peer.source != pull.source:
            if peer.plan is not None:
                return "other heads of this rank"
            assert pull.source is not None
            peer.source = pull.source
        if peer.info is not None and pull.expected_incarnation not in (None, peer.info.incarnation_id):
            return f"incarnation {pull.expected_incarnation[:12]}"
        return ""

    def sources(self, remote_tp: int) -> Sources:
        """The prefill ranks this decode rank reads when the prefill runs `remote_tp` ranks (any thread)."""
        got = self._sources.get(remote_tp)
        if got is None:
            try:
                got = self._sources[remote_tp] = plan_sources(self._cache.spec, remote_tp)
            except LayoutMismatchError as e:
                raise InvalidRequestError("kv_transfer_params.tp_size", str(e)) from e
        return got

    # --- handshake -----------------------------------------------------------------------------------

    def setup(self, peer: Peer, info: p.PeerInfo) -> None:
        """Make `peer` ready from its handshake answer; raises a kvconnect error naming what is wrong."""
        spec, config = self._cache.spec, self._config
        if info.engine_id != peer.engine_id:
            log.info("peer at %s:%d is engine %r, not %r", peer.host, peer.port, info.engine_id[:64], peer.engine_id)
            raise InvalidRequestError(
                "kv_transfer_params.remote_engine_id",
                f"the side channel at {peer.host}:{peer.port} is another engine's, not {peer.engine_id!r}'s",
            )
        if (info.spec.tp_size, info.spec.tp_rank) != (peer.remote_tp, peer.source.rank):
            raise LayoutMismatchError(
                {"tp_rank": (peer.source.rank, info.spec.tp_rank), "tp_size": (peer.remote_tp, info.spec.tp_size)},
                f"peer at {peer.host}:{peer.port} is rank {info.spec.tp_rank} of {info.spec.tp_size}, expected "
                f"rank {peer.source.rank} of {peer.remote_tp} (ranks listen on base port + rank)",
            )
        staging_blocks = config.staging_mb * 2**20 // info.spec.block_bytes
        plan = plan_source(spec, info.spec, peer.source, config.hetero_path.value, staging_blocks)
        peer.info, peer.plan = info, plan
        peer.agent_name = self._agent.add_remote(info.agent_metadata)
        remote_list = self._agent.prep(
            peer.agent_name,
            strided_descriptor_array(plan.pair.remote_units, info.spec.num_blocks, info.base_addrs, info.device_id),
            MemKind.for_device(info.spec.device),
        )
        local_list = self._local_list(plan)
        if config.lease_board and not config.kv_digest:  # (the digest comes only with the PIN's answer)
            peer.board = BoardReader.open(info.lease_board, info.incarnation_id)
        peer.transport = self._fast_paths.open(info, plan, self._cache, peer.key)
        if peer.transport is None:
            peer.transport = NixlRead(self._agent, plan.pair, local_list, remote_list)

    def log_ready(self, peer: Peer, handshake_s: float, setup_s: float) -> None:
        assert peer.plan is not None and peer.transport is not None and peer.info is not None
        log.info(
            "peer %s ready: incarnation %s, %s<-%s, %s, %d descriptors per block, over %s, handshake %.1f ms "
            "(setup %.1f ms)",
            peer.key,
            peer.info.incarnation_id[:12],
            self._cache.spec.kind.value,
            peer.info.spec.kind.value,
            peer.plan.describe(),
            peer.plan.descs_per_block,
            peer.transport.kind.value,
            handshake_s * 1e3,
            setup_s * 1e3,
        )

    def order(self, peer: Peer, pull: Pull) -> tuple[np.ndarray, np.ndarray] | None:
        """(local, remote) ids of `pull` in the order its transfer moves them (into staging blocks on the
        staging path: None while there are none free); sets the tokens the blocks hold where block sizes
        differ. InvalidRequestError when the ids do not fit the peer."""
        plan, transport, info = peer.plan, peer.transport, peer.info
        assert plan is not None and transport is not None and info is not None
        if len(pull.group_sizes) > 1 and (plan.path is not Path.BLOCK or not plan.pair.block_for_block):
            raise InvalidRequestError(
                "kv_transfer_params.remote_group_sizes",
                f"a hybrid model's blocks (KV cache groups {list(pull.group_sizes)}) move only between caches "
                f"with the same block size (local {self._cache.spec.block_size}, remote {info.spec.block_size})",
            )
        if plan.path is Path.STAGING:
            if not reserve(self.staging_pool(plan), pull):
                return None
            assert pull.staging_ids is not None
            local, remote = transport.order(np.asarray(pull.staging_ids, dtype=np.int64), pull.remote_block_ids)
        else:
            local, remote = transport.order(pull.local_block_ids, pull.remote_block_ids)
        if not plan.pair.block_for_block or plan.path is Path.STAGING:
            pull.num_tokens = token_span(
                len(pull.local_block_ids),
                self._cache.spec.block_size,
                len(pull.remote_block_ids),
                info.spec.block_size,
                pull.num_tokens,
            )
        return local, remote

    def staging_pool(self, plan: SourcePlan) -> StagingPool:
        assert plan.staging_spec is not None
        return self.staging[plan.staging_spec]

    def _local_list(self, plan: SourcePlan) -> PreppedList:
        """The prepared list of the pull's local target (the cache, or a staging cache made for this shape)."""
        stage = plan.staging_spec
        if stage is not None and stage not in self.staging:
            if len(self.staging) >= MAX_STAGING_POOLS:
                raise LayoutMismatchError(
                    {"staging caches": (len(self.staging), MAX_STAGING_POOLS)},
                    f"this decode holds a staging cache for each of {MAX_STAGING_POOLS} other "
                    "remote cache shapes already; a prefill of yet another shape is refused",
                )
            pool = StagingPool(stage)
            self._agent.register(
                np.array(
                    [[addr, stage.region_bytes, pool.cache.device_id] for addr in pool.cache.base_addrs()],
                    dtype=np.int64,
                ),
                self._mem,
            )
            self.staging[stage] = pool
            log.info(
                "staging cache for %s: %d blocks, %.0f MiB",
                plan.pair.remote_spec.kind.value,
                pool.capacity,
                stage.cache_bytes / 2**20,
            )
        table = plan.pair.local_units
        key = (
            table.granularity,
            table.unit_bytes,
            table.region.tobytes(),
            table.offset_bytes.tobytes(),
            plan.pair.local_spec,
        )  # plans with equal local unit tables share one list
        if key not in self._local_lists:
            target = self.staging[stage].cache if stage is not None else self._cache
            self._local_lists[key] = self._agent.prep(
                "",
                strided_descriptor_array(table, plan.pair.local_spec.num_blocks, target.base_addrs(), target.device_id),
                self._mem,
            )
        return self._local_lists[key]

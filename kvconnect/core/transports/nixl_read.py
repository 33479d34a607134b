"""NIXL's READ: the transport every peer can take, both halves of it.

- Prefill half (`start`): the cache's regions registered with the connector's NIXL agent; a peer needs nothing
  more than the agent metadata the handshake carries, so it offers nothing of its own.
- Decode half (`open`): the peer's agent added and its remote descriptor list (every unit of every remote
  block, in NIXL's strided form) prepared once per peer; the local list prepared once per local target (the
  cache, or a staging cache) and shared by every peer that reads into it. A pull passes only two index arrays,
  issued sorted by remote block id so that runs of consecutive blocks on both sides merge into one descriptor.
  The READ carries the notification that tells the prefill it has been read.
- Staging (the hetero plan's STAGING path, `staging.py`): whole remote blocks are read into a staging cache
  shaped like the remote one (one per remote shape, at most `MAX_STAGING_POOLS`), then scattered into the
  cache when the read lands. A pull's staging blocks go back when its move settles: never while a READ may
  still write them.
- A dropped peer's agent is removed once no READ of its link can still land (NIXL cannot cancel a posted READ,
  and one given up still writes through the remote agent).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import torch

from kvconnect.core.agent import MemKind, NixlAgent, PreppedList, XferHandle, XferState
from kvconnect.core.cache import KVCache
from kvconnect.core.errors import InvalidRequestError, LayoutMismatchError
from kvconnect.core.plan.descriptors import PairPlan, PullPlan, strided_descriptor_array
from kvconnect.core.plan.hetero import SourcePlan
from kvconnect.core.plan.layout import CacheSpec
from kvconnect.core.transports.base import Link, Move, Transport, TransportKind
from kvconnect.core.transports.staging import StagingPool, scatter
from kvconnect.core.wire.protocol import PeerInfo

log = logging.getLogger(__name__)
# staging caches (one per remote shape, up to staging_mb each) a decode allocates at most
MAX_STAGING_POOLS = 4


class NixlRead(Transport):
    kind = TransportKind.NIXL.value
    notifies = True

    def __init__(self) -> None:
        self._agent: NixlAgent | None = None
        self._cache: KVCache | None = None
        self._local_lists: dict[tuple[object, ...], PreppedList] = {}
        self.staging: dict[CacheSpec, StagingPool] = {}  # by staging spec (one per remote shape)

    def start(self, cache: KVCache, agent: NixlAgent) -> bytes:
        self._agent, self._cache = agent, cache
        regions = np.array([[addr, cache.spec.region_bytes, cache.device_id] for addr in cache.base_addrs()], np.int64)
        agent.register(regions, MemKind.for_device(cache.spec.device))
        return b""

    def open(self, offer: bytes, info: PeerInfo, plan: SourcePlan) -> NixlLink:
        agent, cache = self._agent, self._cache
        assert agent is not None and cache is not None, "NixlRead.open before start"
        agent_name = agent.add_remote(info.agent_metadata)
        try:
            remote_list = agent.prep(
                agent_name,
                strided_descriptor_array(plan.pair.remote_units, info.spec.num_blocks, info.base_addrs, info.device_id),
                MemKind.for_device(info.spec.device),
            )
            pool = self._staging_pool(plan.staging_spec)
            local_list = self._local_list(plan, pool.cache if pool is not None else cache)
            return NixlLink(agent, agent_name, plan.pair, local_list, remote_list, pool, cache, plan.source.heads)
        except BaseException:  # (the peer is dropped and handshaken again: nothing of this attempt stays)
            agent.remove_remote(agent_name)
            raise

    def _staging_pool(self, stage: CacheSpec | None) -> StagingPool | None:
        """The staging cache for remote blocks of this shape (made and registered at its first peer)."""
        if stage is None:
            return None
        pool = self.staging.get(stage)
        if pool is not None:
            return pool
        if len(self.staging) >= MAX_STAGING_POOLS:
            raise LayoutMismatchError(
                {"staging caches": (len(self.staging), MAX_STAGING_POOLS)},
                f"this decode holds a staging cache for each of {MAX_STAGING_POOLS} other remote cache shapes "
                "already; a prefill of yet another shape is refused",
            )
        assert self._agent is not None
        pool = StagingPool(stage)
        regions = [[addr, stage.region_bytes, pool.cache.device_id] for addr in pool.cache.base_addrs()]
        self._agent.register(np.array(regions, dtype=np.int64), MemKind.for_device(stage.device))
        self.staging[stage] = pool
        log.info(
            "staging cache for %s: %d blocks, %.0f MiB", stage.kind.value, pool.capacity, stage.cache_bytes / 2**20
        )
        return pool

    def _local_list(self, plan: SourcePlan, target: KVCache) -> PreppedList:
        """The prepared list of the pulls' local target; plans with equal local unit tables share one."""
        table = plan.pair.local_units
        spec = plan.pair.local_spec
        key = (
            table.granularity,
            table.unit_sizes.tobytes(),
            table.region.tobytes(),
            table.offset_bytes.tobytes(),
            spec,
        )
        if key not in self._local_lists:
            assert self._agent is not None
            descs = strided_descriptor_array(table, spec.num_blocks, target.base_addrs(), target.device_id)
            self._local_lists[key] = self._agent.prep("", descs, MemKind.for_device(spec.device))
        return self._local_lists[key]


class NixlLink(Link):
    def __init__(
        self,
        agent: NixlAgent,
        agent_name: str,
        pair: PairPlan,
        local_list: PreppedList,
        remote_list: PreppedList,
        pool: StagingPool | None,
        cache: KVCache,
        heads: tuple[int, int],
    ) -> None:
        self._agent, self.agent_name, self._pair = agent, agent_name, pair
        self._local, self._remote = local_list, remote_list
        self._pool, self._cache, self._heads = pool, cache, heads
        self._in_flight = 0  # moves posted and not settled (a READ of theirs may still land)
        self._closed = False

    def prepare(
        self,
        local_ids: np.ndarray,
        remote_ids: np.ndarray,
        num_tokens: int | None,
        remote_offset: int = 0,
        state_ids: np.ndarray | None = None,
    ) -> NixlMove | None:
        if self._pool is None:
            local, remote = self._pair.order_checked(local_ids, remote_ids)
            return NixlMove(self, local, remote, num_tokens, remote_offset=remote_offset, state_ids=state_ids)
        if remote_offset:  # (the scatter places whole staged blocks' tokens from their first)
            raise InvalidRequestError("remote_block_ids", "the staging path reads whole blocks from their first token")
        staged = self._pool.alloc(len(remote_ids))  # (InvalidRequestError: it can never fit)
        if staged is None:
            return None
        try:
            into, remote = self._pair.order_checked(np.asarray(staged, dtype=np.int64), remote_ids)
        except BaseException:
            self._pool.free(staged)
            raise
        return NixlMove(self, into, remote, num_tokens, staged, local_ids)

    def close(self) -> None:
        self._closed = True
        self._let_go()

    def _settled(self) -> None:
        self._in_flight -= 1
        self._let_go()

    def _let_go(self) -> None:
        if self._closed and self._in_flight == 0 and self.agent_name:
            self._agent.remove_remote(self.agent_name)  # (releases the peer's prepared list too)
            self.agent_name = ""


class NixlMove(Move):
    abandonable = True  # NIXL cannot cancel a posted READ: a given-up one may still land

    def __init__(
        self,
        link: NixlLink,
        local_ids: np.ndarray,
        remote_ids: np.ndarray,
        num_tokens: int | None,
        staged: list[int] | None = None,
        targets: np.ndarray | None = None,
        remote_offset: int = 0,
        state_ids: np.ndarray | None = None,
    ) -> None:
        self._link, self.local_ids, self.remote_ids, self._num_tokens = link, local_ids, remote_ids, num_tokens
        self._offset, self._state_ids = remote_offset, state_ids
        # staging: the staging blocks read into, the cache's blocks
        self._staged, self._targets = staged, targets
        self._xfer: XferHandle | None = None
        self._posted = False

    def post(self, notif: bytes) -> tuple[XferState, PullPlan]:
        link = self._link
        plan = link._pair.plan_validated(
            self.local_ids, self.remote_ids, self._num_tokens, self._offset, self._state_ids
        )
        self._xfer = link._agent.read(link._local, plan.local_indices, link._remote, plan.remote_indices, notif)
        if not link._agent.options.merge_descs:  # (then NIXL issues every unit apart)
            plan = dataclasses.replace(plan, num_descs_merged=plan.num_descs)
        try:
            state = link._agent.post(self._xfer)
        except BaseException:
            self.release()
            raise
        self._posted = True
        link._in_flight += 1
        return state, plan

    def state(self) -> XferState:
        assert self._xfer is not None
        return self._link._agent.state(self._xfer)

    def issued_descs(self) -> int | None:
        return self._link._agent.telemetry_descs(self._xfer) if self._xfer is not None else None

    def land(self) -> float:
        if self._staged is None:
            return 0.0
        pool, cache = self._link._pool, self._link._cache
        assert pool is not None and self._targets is not None and self._num_tokens is not None
        t0 = time.monotonic()
        scatter(pool.cache, self._staged, cache, self._targets, self._num_tokens, self._link._heads)
        if cache.spec.device == "cuda":
            torch.cuda.current_stream(cache.regions[0].device).synchronize()
        return time.monotonic() - t0

    def release(self) -> None:
        if self._xfer is not None:
            self._link._agent.release(self._xfer)
            self._xfer = None

    def settle(self) -> None:
        self.release()
        if self._staged is not None:
            assert self._link._pool is not None
            self._link._pool.free(self._staged)
            self._staged = None
        if self._posted:
            self._posted = False
            self._link._settled()

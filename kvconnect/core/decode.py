"""Decode side of a connector: peers learned by handshake, and pulls driven to completion.

Runs on the connector's loop thread (except `pull`, which only validates and enqueues). A peer is one
prefill rank (engine id + TP rank), cached together with its incarnation, remote NIXL agent, the plan
chosen for it at handshake (`hetero.SourcePlan`) and prepared descriptor lists; a pull naming another
incarnation, or a disconnect, drops the stale peer and handshakes again. A request read from several
prefill ranks (heterogeneous TP) runs as one pull per rank, joined by a `PullGroup`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import zmq

from kvconnect.core import protocol as p
from kvconnect.core.agent import MemKind, PreppedList, XferState
from kvconnect.core.descriptors import PairPlan, strided_descriptor_array, token_span
from kvconnect.core.errors import (
    HandshakeError,
    HandshakeTimeoutError,
    InvalidRequestError,
    KVConnectError,
    LayoutMismatchError,
    LeaseLostError,
    PeerGoneError,
    TransferError,
    TransferTimeoutError,
)
from kvconnect.core.handshake import PeerChannel
from kvconnect.core.hetero import Path, Source, SourcePlan, Sources, plan_source, plan_sources
from kvconnect.core.layout import CacheSpec
from kvconnect.core.pull import AbandonedReads, Pull, PullGroup, PullHandle, PullPhase
from kvconnect.core.staging import StagingPool, scatter

if TYPE_CHECKING:
    from kvconnect.core.connector import KVConnector

log = logging.getLogger(__name__)


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
    remote_list: PreppedList | None = None
    waiting: list[Pull] = field(default_factory=list)
    confirming: dict[str, Pull] = field(default_factory=dict)
    transport: str = "nixl"
    mapped: Any = None  # a peer_copy.IpcGather when the same-host GPU path is used

    @property
    def ready(self) -> bool:
        return self.remote_list is not None

    @property
    def key(self) -> str:
        return f"{self.engine_id}#{self.source.rank}"


class DecodeSide:
    def __init__(self, conn: KVConnector, ctx: zmq.Context, secret: bytes) -> None:
        self._conn = conn
        self._ctx = ctx
        self._secret = secret
        self._peers: dict[str, Peer] = {}
        self._local_lists: dict[tuple, PreppedList] = {}
        self._staging: dict[CacheSpec, StagingPool] = {}  # by staging spec (one per remote shape)
        self._staging_wait: list[Pull] = []  # staging pulls waiting for free staging blocks
        self._posted: list[Pull] = []
        self._sources: dict[int, Sources] = {}  # by remote TP size
        self.abandoned = AbandonedReads(conn.agent)  # given-up READs that may still land

    # --- any thread --------------------------------------------------------------------------------

    def sources(self, remote_tp: int) -> Sources:
        got = self._sources.get(remote_tp)
        if got is None:
            try:
                got = self._sources[remote_tp] = plan_sources(self._conn.spec, remote_tp)
            except LayoutMismatchError as e:
                raise InvalidRequestError("kv_transfer_params.tp_size", str(e)) from e
        return got

    def pull(self, params: p.KVTransferParams, local_block_ids: Sequence[int], request_id: str | None) -> PullHandle:
        conn = self._conn
        pull = Pull.from_params(params, local_block_ids, request_id, conn.spec, conn.config.pull_timeout_s)
        sources = self.sources(pull.remote_tp)
        if len(sources.reads) == 1:
            pull.source = sources.reads[0]
            pull.remote_port += pull.source.rank
            if pull.source.rank:
                pull.expected_incarnation = None  # the params name rank 0's incarnation
            parts = [pull]
        else:
            group = PullGroup(pull, len(sources.reads))
            parts = [pull.part(source, group) for source in sources.reads]

        def start() -> None:
            for part in parts:
                self._start(part)
            for rank in sources.release_only:
                self._send_release_to(params, rank)  # copies of heads nobody reads: free them now

        conn._call(start)
        return pull.handle

    # --- loop thread -------------------------------------------------------------------------------

    def busy(self) -> bool:
        """True while a READ or a confirmation is in flight: the loop then spins instead of sleeping."""
        return bool(self._posted) or any(peer.confirming for peer in self._peers.values())

    def _start(self, pull: Pull) -> None:
        pull.handle.stats.queued_s = time.monotonic() - pull.requested_s
        assert pull.source is not None
        peer = self._peers.get(pull.peer_key)
        if peer is not None and (peer.host, peer.port, peer.remote_tp) != (pull.remote_host, pull.remote_port,
                                                                          pull.remote_tp):
            self._fail_peer(peer, PeerGoneError(f"engine {peer.engine_id}: side channel address changed"))
            peer = None
        if peer is not None and peer.source != pull.source:
            if peer.plan is None:
                peer.source = pull.source  # made to send a release; it reads these heads from now on
            else:
                self._drop_peer(peer, "pull reads other heads from this rank")
                peer = None
        if (peer is not None and peer.info is not None
                and pull.expected_incarnation not in (None, peer.info.incarnation_id)):
            self._drop_peer(peer, f"pull names incarnation {pull.expected_incarnation[:12]}")
            peer = None
        if peer is None:
            peer = Peer(pull.remote_engine_id, pull.remote_host, pull.remote_port,
                        PeerChannel(self._ctx, pull.remote_host, pull.remote_port, self._secret), pull.source,
                        pull.remote_tp)
            self._peers[peer.key] = peer
        if peer.ready:
            self._post(peer, pull)
            return
        peer.waiting.append(pull)
        if not peer.hello_sent_s:
            peer.hello_sent_s = time.monotonic()
            peer.channel.send(p.Hello(p.PROTOCOL_VERSION, self._conn.engine_id))

    def _peer_ready(self, peer: Peer, info: p.PeerInfo) -> None:
        conn = self._conn
        t0 = time.monotonic()
        try:
            if info.engine_id != peer.engine_id:
                raise InvalidRequestError("kv_transfer_params.remote_engine_id", f"peer at {peer.host}:"
                                          f"{peer.port} is engine {info.engine_id!r}, not {peer.engine_id!r}")
            if (info.spec.tp_size, info.spec.tp_rank) != (peer.remote_tp, peer.source.rank):
                raise LayoutMismatchError(
                    {"tp_rank": (peer.source.rank, info.spec.tp_rank), "tp_size": (peer.remote_tp, info.spec.tp_size)},
                    f"peer at {peer.host}:{peer.port} is rank {info.spec.tp_rank} of {info.spec.tp_size}, expected "
                    f"rank {peer.source.rank} of {peer.remote_tp} (ranks listen on base port + rank)")
            staging_blocks = conn.config.staging_mb * 2**20 // info.spec.block_bytes
            plan = plan_source(conn.spec, info.spec, peer.source, conn.config.hetero_path, staging_blocks)
            pair = plan.pair
            peer.agent_name = conn.agent.add_remote(info.agent_metadata)
            remote_mem = MemKind.for_device(info.spec.device)
            peer.remote_list = conn.agent.prep(
                peer.agent_name,
                strided_descriptor_array(pair.remote_units, info.spec.num_blocks, info.base_addrs, info.device_id),
                remote_mem,
            )
            if plan.staging_spec is not None and plan.staging_spec not in self._staging:
                pool = StagingPool(plan.staging_spec)
                conn.agent.register(np.array([[addr, plan.staging_spec.region_bytes, pool.cache.device_id]
                                              for addr in pool.cache.base_addrs()], dtype=np.int64), conn.mem)
                self._staging[plan.staging_spec] = pool
                log.info("staging cache for %s: %d blocks, %.0f MiB", info.spec.kind.value, pool.capacity,
                         plan.staging_spec.cache_bytes / 2**20)
            key = self._local_key(plan)
            if key not in self._local_lists:
                target = self._staging[plan.staging_spec].cache if plan.staging_spec is not None else conn.cache
                self._local_lists[key] = conn.agent.prep(
                    "",
                    strided_descriptor_array(pair.local_units, pair.local_spec.num_blocks, target.base_addrs(),
                                             target.device_id),
                    conn.mem,
                )
            peer.plan, peer.info = plan, info
            if plan.path is Path.BLOCK:
                self._try_ipc(peer, info, pair)
        except KVConnectError as e:
            conn.counters.handshake_failures += 1
            self._fail_peer(peer, e)
            return
        conn.counters.handshakes += 1
        handshake_s = time.monotonic() - peer.hello_sent_s
        log.info("peer %s ready: incarnation %s, %s<-%s, %s, %d descriptors per block, over %s, handshake %.1f ms "
                 "(setup %.1f ms)", peer.key, info.incarnation_id[:12], conn.spec.kind.value,
                 info.spec.kind.value, plan.describe(), plan.descs_per_block, peer.transport, handshake_s * 1e3,
                 (time.monotonic() - t0) * 1e3)
        waiting, peer.waiting = peer.waiting, []
        for pull in waiting:
            pull.handle.stats.handshake_s = handshake_s
            if pull.expected_incarnation not in (None, info.incarnation_id):
                self._fail(pull, LeaseLostError(
                    f"prefill engine {peer.engine_id} restarted (lease was granted by incarnation "
                    f"{pull.expected_incarnation[:12]}, peer is now {info.incarnation_id[:12]})"))
            else:
                self._post(peer, pull)

    @staticmethod
    def _local_key(plan: SourcePlan) -> tuple:
        """Identifies a local prepared list: plans with equal local unit tables share one."""
        table = plan.pair.local_units
        return (table.granularity, table.unit_bytes, table.region.tobytes(), table.offset_bytes.tobytes(),
                plan.pair.local_spec)

    def _try_ipc(self, peer: Peer, info: p.PeerInfo, pair: PairPlan) -> None:
        """Use the IPC gather for a same-host GPU peer when allowed; NIXL stays as the fallback."""
        conn = self._conn
        if conn.config.transport == "nixl" or conn.spec.device != "cuda" or info.spec.device != "cuda":
            return
        from kvconnect.core.transports import ipc_gather as peer_copy

        try:
            peer.mapped = peer_copy.IpcGather.open(info, pair, conn.cache)
            peer.transport = "ipc"
        except peer_copy.PeerCopyError as e:
            if conn.config.transport == "ipc":
                raise
            log.info("peer %s: CUDA IPC gather unavailable (%s); using NIXL", peer.engine_id, e)

    def _post(self, peer: Peer, pull: Pull) -> None:
        conn = self._conn
        assert peer.plan is not None and peer.remote_list is not None and peer.info is not None
        plan_src = peer.plan
        t0 = time.monotonic()
        try:
            if plan_src.path is Path.STAGING:
                if not self._reserve_staging(plan_src, pull):
                    self._staging_wait.append(pull)
                    return
                assert pull.staging_ids is not None
                local_ids: Sequence[int] | np.ndarray = pull.staging_ids
            else:
                local_ids = pull.local_block_ids
            if peer.mapped is not None:  # one gather kernel: issue order is irrelevant
                local, remote = plan_src.pair.bounds_checked(pull.local_block_ids, pull.remote_block_ids)
            else:
                local, remote = plan_src.pair.order_checked(local_ids, pull.remote_block_ids)  # see from_params
            if not plan_src.pair.block_for_block or plan_src.path is Path.STAGING:
                pull.num_tokens = token_span(len(pull.local_block_ids), conn.spec.block_size,
                                             len(pull.remote_block_ids), peer.info.spec.block_size, pull.num_tokens)
        except InvalidRequestError as e:
            self._fail(pull, e)
            return
        pull.incarnation_id = peer.info.incarnation_id
        stats = pull.handle.stats
        stats.validate_s = time.monotonic() - t0
        stats.granularity = plan_src.pair.granularity.name
        stats.transport = peer.transport
        stats.path = plan_src.path.value
        try:
            if peer.mapped is not None:  # launch first: the plan below is only bookkeeping for this path
                pull.event = peer.mapped.post(local, remote)
                state = XferState.PROC
                posted_s = time.monotonic()
                plan = pull.plan = plan_src.pair.summary(int(local.size))
            else:
                plan = pull.plan = plan_src.pair.plan_validated(local, remote, pull.num_tokens)
                src = pull.source
                assert src is not None
                notif = p.encode_notif(pull.remote_request_id, peer.info.incarnation_id, src.reader, src.readers)
                pull.xfer = conn.agent.read(self._local_lists[self._local_key(plan_src)], plan.local_indices,
                                            peer.remote_list, plan.remote_indices, notif)
                state = conn.agent.post(pull.xfer)
                posted_s = time.monotonic()
        except KVConnectError as e:
            if isinstance(e, PeerGoneError):
                self._drop_peer(peer, str(e))
            self._fail(pull, e)
            return
        stats.num_blocks, stats.bytes = plan.num_blocks, plan.total_bytes
        stats.num_descs, stats.num_descs_merged = plan.num_descs, plan.num_descs_merged
        pull.posted_s = posted_s
        stats.post_s = posted_s - t0
        pull.phase = PullPhase.POSTED
        self._posted.append(pull)
        if self._pins_reads(pull):
            self._send_pin(peer, pull)
        self._check(pull, state)

    def _pins_reads(self, pull: Pull) -> bool:
        config = self._conn.config
        return config.pin_reads and (config.confirm_reads or pull.handle.stats.transport == "ipc")

    def _send_pin(self, peer: Peer, pull: Pull) -> None:
        """Ask the prefill side to keep the blocks until we confirm (so the READ's end needs no round trip)."""
        src = pull.source
        assert src is not None
        now = time.monotonic()
        pin_s = max(pull.deadline_s - now, 0.001)
        pull.pin_until_s = now + pin_s  # the prefill pins from when it gets this, so at least until then
        pull.pin = "sent"
        peer.confirming[pull.remote_request_id] = pull
        peer.channel.send(p.LeaseRequest(p.PROTOCOL_VERSION, self._conn.engine_id, pull.remote_request_id,
                                         p.LeaseAction.PIN, reader=src.reader, readers=src.readers,
                                         pin_ms=int(pin_s * 1000)))

    def _reserve_staging(self, plan: SourcePlan, pull: Pull) -> bool:
        """Staging blocks for the pull's remote blocks (False: wait); InvalidRequestError if it can never fit."""
        assert plan.staging_spec is not None
        pool = self._staging[plan.staging_spec]
        ids = pool.alloc(len(pull.remote_block_ids))
        if ids is None:
            return False
        pull.staging_ids = ids

        def free() -> None:
            if pull.staging_ids is not None:
                pool.free(pull.staging_ids)
                pull.staging_ids = None

        pull.on_settled = free
        return True

    def _scatter(self, pull: Pull) -> KVConnectError | None:
        """Staging path: move the pulled tokens and heads into the decode cache, then free the staging blocks."""
        peer = self._peers.get(pull.peer_key)
        if peer is None or peer.plan is None or peer.plan.staging_spec is None:
            return PeerGoneError(f"engine {pull.remote_engine_id} dropped before its staged blocks were placed")
        assert pull.staging_ids is not None and pull.num_tokens is not None and pull.source is not None
        t0 = time.monotonic()
        cache = self._conn.cache
        scatter(self._staging[peer.plan.staging_spec].cache, pull.staging_ids, cache, pull.local_block_ids,
                pull.num_tokens, pull.source.heads)
        if cache.spec.device == "cuda":
            import torch

            torch.cuda.current_stream(cache.regions[0].device).synchronize()
        pull.handle.stats.scatter_s = time.monotonic() - t0
        return None

    def _check(self, pull: Pull, state: XferState) -> None:
        if state is XferState.PROC:
            return
        self._posted.remove(pull)
        if state is XferState.ERR:
            self._release_xfer(pull)
            self._fail(pull, TransferError(f"pull {pull.handle.request_id}: NIXL reported ERR"))
            return
        now = time.monotonic()
        pull.read_done_s = now
        pull.handle.stats.transfer_s = now - pull.posted_s
        if pull.xfer is not None and self._conn.config.telemetry:
            issued = self._conn.agent.telemetry_descs(pull.xfer)
            if issued is not None:
                pull.extra["issued_descs"] = issued
        self._release_xfer(pull)
        if pull.staging_ids is not None:
            error = self._scatter(pull)
            pull.run_on_settled()
            if error is not None:
                self._fail(pull, error)
                return
        if not self._conn.config.confirm_reads and pull.handle.stats.transport != "ipc":
            self._succeed(pull)  # (an IPC gather sends no notification: its confirmation ends the lease)
            return
        pull.phase = PullPhase.CONFIRMING
        if pull.pin == "sent":
            return  # the pin's answer decides (_on_reply)
        self._after_pin(pull)

    def _after_pin(self, pull: Pull) -> None:
        """READ done, pin answered (or none asked): succeed under a live pin, else confirm the old way."""
        peer = self._peers.get(pull.peer_key)
        if peer is None:
            self._fail(pull, PeerGoneError(f"engine {pull.remote_engine_id} dropped before confirmation"))
            return
        if pull.pin not in ("", "held"):
            self._fail(pull, LeaseLostError(f"pull {pull.handle.request_id}: prefill lease was {pull.pin} "
                                            "before the read was pinned; data discarded"))
            return
        src = pull.source
        assert src is not None
        confirm = p.LeaseRequest(p.PROTOCOL_VERSION, self._conn.engine_id, pull.remote_request_id,
                                 p.LeaseAction.CONFIRM, reader=src.reader, readers=src.readers)
        if pull.pin == "held" and time.monotonic() < pull.pin_until_s:
            peer.channel.send(confirm)  # ends our pin and, for the last reader, the lease; answer not needed
            pull.handle.stats.confirm_s = time.monotonic() - pull.read_done_s
            self._succeed(pull)
            return
        peer.confirming[pull.remote_request_id] = pull
        peer.channel.send(confirm)

    def progress(self) -> None:
        """One loop tick: replies, READ states, cancellations and deadlines."""
        now = time.monotonic()
        for peer in list(self._peers.values()):
            for ref, reply in peer.channel.receive():
                self._on_reply(peer, ref, reply)
        for pull in list(self._posted):
            if pull.event is not None:  # IPC gather: a local kernel, it always finishes
                if pull.event.query():
                    pull.event = None
                    self._check(pull, XferState.DONE)
                continue
            if pull.handle.cancel_requested or now >= pull.deadline_s:
                self._posted.remove(pull)
                self._abandon(pull, now)
                continue
            assert pull.xfer is not None
            try:
                state = self._conn.agent.state(pull.xfer)
            except KVConnectError as e:
                self._posted.remove(pull)
                self._release_xfer(pull)
                if isinstance(e, PeerGoneError) and pull.peer_key in self._peers:
                    self._drop_peer(self._peers[pull.peer_key], str(e))
                self._fail(pull, e)
                continue
            self._check(pull, state)
        waiting, self._staging_wait = self._staging_wait, []
        for pull in waiting:
            staged_for = self._peers.get(pull.peer_key)
            if pull.handle.cancel_requested or now >= pull.deadline_s or staged_for is None or not staged_for.ready:
                self.send_release_for(pull)
                self._fail(pull, TransferTimeoutError(f"pull {pull.handle.request_id}: no staging space before "
                                                      "the deadline (raise staging_mb)"))
            else:
                self._post(staged_for, pull)
        for peer in list(self._peers.values()):
            if not peer.ready and peer.waiting and now - peer.hello_sent_s >= self._conn.config.handshake_timeout_s:
                self._conn.counters.handshake_failures += 1
                self._fail_peer(peer, HandshakeTimeoutError(
                    f"engine {peer.engine_id} at {peer.host}:{peer.port}: no handshake answer within "
                    f"{self._conn.config.handshake_timeout_s:.3g}s"))
            for rid, pull in list(peer.confirming.items()):
                if pull.phase is PullPhase.POSTED:
                    continue  # a PIN answer pending while the READ runs: the READ's deadline covers it
                if pull.handle.cancel_requested or now >= pull.deadline_s:
                    del peer.confirming[rid]
                    peer.channel.forget(f"lease:{rid}")
                    self._fail(pull, TransferTimeoutError(f"pull {pull.handle.request_id}: lease not confirmed "
                                                          "before the deadline; data discarded"))
        self.abandoned.poll()

    def _on_reply(self, peer: Peer, ref: str, reply: p.PeerInfo | p.LeaseReply | HandshakeError) -> None:
        if ref == "hello" or (isinstance(reply, HandshakeError) and not ref):
            if isinstance(reply, p.PeerInfo):
                self._peer_ready(peer, reply)
            elif isinstance(reply, HandshakeError) and not peer.ready:
                self._conn.counters.handshake_failures += 1
                self._fail_peer(peer, reply)
            return
        pull = peer.confirming.pop(ref.removeprefix("lease:"), None)
        if pull is None or pull.phase in (PullPhase.DONE, PullPhase.FAILED):
            return
        if pull.pin == "sent":  # the answer to our PIN
            if isinstance(reply, HandshakeError):
                pull.pin = f"unpinned ({reply})"
            else:
                assert isinstance(reply, p.LeaseReply)
                # COMPLETED: our READ's notification already ended the lease, so it read under the lease
                good = reply.state in (p.LeaseState.HELD, p.LeaseState.COMPLETED)
                pull.pin = "held" if good else reply.state.value
            if pull.phase is PullPhase.CONFIRMING:  # the READ is already done
                self._after_pin(pull)
            return
        if isinstance(reply, HandshakeError):
            self._fail(pull, reply)
        elif isinstance(reply, p.LeaseReply) and reply.state is p.LeaseState.COMPLETED:
            pull.handle.stats.confirm_s = time.monotonic() - pull.read_done_s
            self._succeed(pull)
        else:
            state = reply.state.value if isinstance(reply, p.LeaseReply) else "?"
            self._fail(pull, LeaseLostError(f"pull {pull.handle.request_id}: prefill lease was {state} "
                                            "when the read finished; data discarded"))

    def _abandon(self, pull: Pull, now: float) -> None:
        self.abandoned.add(pull, getattr(self._peers.get(pull.peer_key), "agent_name", ""))
        self.send_release_for(pull)
        if pull.handle.cancel_requested:
            self._fail(pull, TransferError(f"pull {pull.handle.request_id} cancelled"))
        else:
            self._fail(pull, TransferTimeoutError(
                f"pull {pull.handle.request_id} from {pull.remote_engine_id} not complete after "
                f"{now - pull.requested_s:.3g}s; abandoned"))

    def send_release_for(self, pull: Pull) -> None:
        """Release the lease this pull reads (as its reader: that also drops its pin)."""
        peer = self._peers.get(pull.peer_key)
        if peer is not None:
            peer.confirming.pop(pull.remote_request_id, None)
            reader = pull.source.reader if pull.source is not None else -1
            peer.channel.send(p.LeaseRequest(p.PROTOCOL_VERSION, self._conn.engine_id, pull.remote_request_id,
                                             p.LeaseAction.RELEASE, reader=reader))

    def send_release(self, params: p.KVTransferParams) -> None:
        """Release the lease on every rank of the prefill's TP group."""
        for rank in range(max(params.tp_size, 1)):
            self._send_release_to(params, rank)

    def _send_release_to(self, params: p.KVTransferParams, rank: int) -> None:
        if not (params.remote_engine_id and params.remote_host and params.remote_port and params.remote_request_id):
            return
        peer = self._peers.get(f"{params.remote_engine_id}#{rank}")
        if peer is None:
            port = params.remote_port + rank
            peer = Peer(params.remote_engine_id, params.remote_host, port,
                        PeerChannel(self._ctx, params.remote_host, port, self._secret), Source(rank, (0, 0), 0, 1),
                        params.tp_size)
            self._peers[peer.key] = peer
        peer.channel.send(p.LeaseRequest(p.PROTOCOL_VERSION, self._conn.engine_id, params.remote_request_id,
                                         p.LeaseAction.RELEASE, reader=-1))

    def _release_xfer(self, pull: Pull) -> None:
        if pull.xfer is not None:
            self._conn.agent.release(pull.xfer)
            pull.xfer = None

    def _succeed(self, pull: Pull) -> None:
        conn = self._conn
        conn.counters.bytes_pulled += pull.handle.stats.bytes
        conn.counters.descs_posted += pull.handle.stats.num_descs_merged
        pull.finish(None)
        self._report(pull, None)

    def _fail(self, pull: Pull, error: KVConnectError) -> None:
        if pull.phase in (PullPhase.DONE, PullPhase.FAILED):
            return
        if pull.pin:  # drop our pin now rather than when it times out
            self.send_release_for(pull)
        rank = pull.source.rank if pull.source is not None else 0
        log.warning("pull %s from %s failed: %s%s", pull.handle.request_id, pull.remote_engine_id, error,
                    f" (prefill rank {rank})" if rank else "")
        if pull.xfer is None:
            pull.run_on_settled()  # no READ can land in its staging blocks any more
        pull.finish(error)
        self._report(pull, error)

    def _report(self, pull: Pull, error: KVConnectError | None) -> None:
        """Count and announce a finished request (a multi-source one once, when its group ends)."""
        if pull.group is not None:
            if not pull.group.part_done(pull, error):
                return
            pull = pull.group.parent
        conn = self._conn
        if error is None:
            conn.counters.pulls_ok += 1
        else:
            conn.counters.failed(error)
        if conn.on_pull_done:
            conn.on_pull_done(pull.handle.stats, error)

    def _fail_peer(self, peer: Peer, error: KVConnectError) -> None:
        waiting, peer.waiting = peer.waiting, []
        self._drop_peer(peer, str(error))
        for pull in waiting:
            self._fail(pull, error)

    def _drop_peer(self, peer: Peer, why: str) -> None:
        """Forget a peer: its remote agent, prepared lists and channel. In-flight pulls fail."""
        log.info("dropping peer %s: %s", peer.key, why)
        self._peers.pop(peer.key, None)
        for pull in [x for x in self._posted if x.peer_key == peer.key]:
            self._posted.remove(pull)
            self.abandoned.add(pull, peer.agent_name)
            self._fail(pull, PeerGoneError(f"engine {peer.engine_id} dropped: {why}"))
        for pull in peer.confirming.values():
            self._fail(pull, PeerGoneError(f"engine {peer.engine_id} dropped before confirmation: {why}"))
        peer.confirming.clear()
        if peer.agent_name and not self.abandoned.uses(peer.agent_name):  # (else freed at close)
            self._conn.agent.remove_remote(peer.agent_name)
        if peer.mapped is not None:
            peer.mapped.close()
            peer.mapped = None
        peer.channel.close()

    def close(self) -> None:
        for peer in list(self._peers.values()):
            self._fail_peer(peer, PeerGoneError("connector closed"))
        for pull in list(self._posted):
            self._posted.remove(pull)
            self._release_xfer(pull)
            self._fail(pull, TransferError("connector closed"))
        self.abandoned.close()

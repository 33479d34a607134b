"""Decode side of a connector: peers learned by handshake, and pulls driven to completion.

Runs on the connector's loop thread (except `pull`, which only validates and enqueues). A peer is
cached per remote engine id together with its incarnation, remote NIXL agent and prepared descriptor
lists; a pull naming another incarnation, or a disconnect, drops the stale peer and handshakes again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zmq

from kvconnect import protocol as p
from kvconnect.agent import MemKind, PreppedList, XferState
from kvconnect.descriptors import PairPlan, strided_descriptor_array
from kvconnect.errors import (
    HandshakeError,
    HandshakeTimeoutError,
    InvalidRequestError,
    KVConnectError,
    LeaseLostError,
    PeerGoneError,
    TransferError,
    TransferTimeoutError,
)
from kvconnect.handshake import PeerChannel
from kvconnect.layout import Granularity
from kvconnect.transfer import AbandonedReads, Pull, PullHandle, PullPhase

if TYPE_CHECKING:
    from kvconnect.connector import KVConnector

log = logging.getLogger(__name__)


@dataclass
class Peer:
    engine_id: str
    host: str
    port: int
    channel: PeerChannel
    hello_sent_s: float = 0.0
    info: p.PeerInfo | None = None
    agent_name: str = ""
    pair: PairPlan | None = None
    remote_list: PreppedList | None = None
    waiting: list[Pull] = field(default_factory=list)
    confirming: dict[str, Pull] = field(default_factory=dict)
    transport: str = "nixl"
    mapped: Any = None  # a peer_copy.IpcGather when the same-host GPU path is used

    @property
    def ready(self) -> bool:
        return self.remote_list is not None


class DecodeSide:
    def __init__(self, conn: KVConnector, ctx: zmq.Context, secret: bytes) -> None:
        self._conn = conn
        self._ctx = ctx
        self._secret = secret
        self._peers: dict[str, Peer] = {}
        self._local_lists: dict[Granularity, PreppedList] = {}
        self._posted: list[Pull] = []
        self.abandoned = AbandonedReads(conn.agent)  # given-up READs that may still land

    # --- any thread --------------------------------------------------------------------------------

    def pull(self, params: p.KVTransferParams, local_block_ids: Sequence[int], request_id: str | None) -> PullHandle:
        conn = self._conn
        pull = Pull.from_params(params, local_block_ids, request_id, conn.spec, conn.config.pull_timeout_s)
        conn._call(lambda: self._start(pull))
        return pull.handle

    # --- loop thread -------------------------------------------------------------------------------

    def busy(self) -> bool:
        """True while a READ or a confirmation is in flight: the loop then spins instead of sleeping."""
        return bool(self._posted) or any(peer.confirming for peer in self._peers.values())

    def _start(self, pull: Pull) -> None:
        pull.handle.stats.queued_s = time.monotonic() - pull.requested_s
        peer = self._peers.get(pull.remote_engine_id)
        if peer is not None and (peer.host, peer.port) != (pull.remote_host, pull.remote_port):
            self._fail_peer(peer, PeerGoneError(f"engine {peer.engine_id}: side channel address changed"))
            peer = None
        if (peer is not None and peer.info is not None
                and pull.expected_incarnation not in (None, peer.info.incarnation_id)):
            self._drop_peer(peer, f"pull names incarnation {pull.expected_incarnation[:12]}")
            peer = None
        if peer is None:
            peer = Peer(pull.remote_engine_id, pull.remote_host, pull.remote_port,
                        PeerChannel(self._ctx, pull.remote_host, pull.remote_port, self._secret))
            self._peers[peer.engine_id] = peer
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
            pair = PairPlan.build(conn.spec, info.spec)
            peer.agent_name = conn.agent.add_remote(info.agent_metadata)
            remote_mem = MemKind.for_device(info.spec.device)
            peer.remote_list = conn.agent.prep(
                peer.agent_name,
                strided_descriptor_array(pair.remote_units, info.spec.num_blocks, info.base_addrs, info.device_id),
                remote_mem,
            )
            if pair.granularity not in self._local_lists:
                self._local_lists[pair.granularity] = conn.agent.prep(
                    "",
                    strided_descriptor_array(pair.local_units, conn.spec.num_blocks, conn.cache.base_addrs(),
                                             conn.cache.device_id),
                    conn.mem,
                )
            peer.pair, peer.info = pair, info
            self._try_ipc(peer, info, pair)
        except KVConnectError as e:
            conn.counters.handshake_failures += 1
            self._fail_peer(peer, e)
            return
        conn.counters.handshakes += 1
        handshake_s = time.monotonic() - peer.hello_sent_s
        log.info("peer %s ready: incarnation %s, %s<-%s at %s granularity over %s, handshake %.1f ms "
                 "(setup %.1f ms)", peer.engine_id, info.incarnation_id[:12], conn.spec.kind.value,
                 info.spec.kind.value, pair.granularity.name, peer.transport, handshake_s * 1e3,
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

    def _try_ipc(self, peer: Peer, info: p.PeerInfo, pair: PairPlan) -> None:
        """Use the IPC gather for a same-host GPU peer when allowed; NIXL stays as the fallback."""
        conn = self._conn
        if conn.config.transport == "nixl" or conn.spec.device != "cuda" or info.spec.device != "cuda":
            return
        from kvconnect import peer_copy

        try:
            peer.mapped = peer_copy.IpcGather.open(info, pair, conn.cache)
            peer.transport = "ipc"
        except peer_copy.PeerCopyError as e:
            if conn.config.transport == "ipc":
                raise
            log.info("peer %s: CUDA IPC gather unavailable (%s); using NIXL", peer.engine_id, e)

    def _post(self, peer: Peer, pull: Pull) -> None:
        conn = self._conn
        assert peer.pair is not None and peer.remote_list is not None and peer.info is not None
        t0 = time.monotonic()
        try:
            local, remote = peer.pair.order_checked(pull.local_block_ids, pull.remote_block_ids)  # see from_params
        except InvalidRequestError as e:
            self._fail(pull, e)
            return
        pull.incarnation_id = peer.info.incarnation_id
        stats = pull.handle.stats
        stats.validate_s = time.monotonic() - t0
        stats.granularity = peer.pair.granularity.name
        stats.transport = peer.transport
        try:
            if peer.mapped is not None:  # launch first: the plan below is only bookkeeping for this path
                pull.event = peer.mapped.post(local, remote)
                state = XferState.PROC
                posted_s = time.monotonic()
                plan = pull.plan = peer.pair.plan_validated(local, remote)
            else:
                plan = pull.plan = peer.pair.plan_validated(local, remote)
                notif = p.encode_notif(pull.remote_request_id, peer.info.incarnation_id)
                pull.xfer = conn.agent.read(self._local_lists[peer.pair.granularity], plan.local_indices,
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
        self._check(pull, state)

    def _check(self, pull: Pull, state: XferState) -> None:
        if state is XferState.PROC:
            return
        self._posted.remove(pull)
        if state is XferState.ERR:
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
        if not self._conn.config.confirm_reads and pull.handle.stats.transport != "ipc":
            self._succeed(pull)  # (an IPC gather sends no notification: its confirmation ends the lease)
            return
        peer = self._peers.get(pull.remote_engine_id)
        if peer is None:
            self._fail(pull, PeerGoneError(f"engine {pull.remote_engine_id} dropped before confirmation"))
            return
        pull.phase = PullPhase.CONFIRMING
        peer.confirming[pull.remote_request_id] = pull
        peer.channel.send(p.LeaseRequest(p.PROTOCOL_VERSION, self._conn.engine_id, pull.remote_request_id,
                                         p.LeaseAction.CONFIRM))

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
                if isinstance(e, PeerGoneError) and pull.remote_engine_id in self._peers:
                    self._drop_peer(self._peers[pull.remote_engine_id], str(e))
                self._fail(pull, e)
                continue
            self._check(pull, state)
        for peer in list(self._peers.values()):
            if not peer.ready and peer.waiting and now - peer.hello_sent_s >= self._conn.config.handshake_timeout_s:
                self._conn.counters.handshake_failures += 1
                self._fail_peer(peer, HandshakeTimeoutError(
                    f"engine {peer.engine_id} at {peer.host}:{peer.port}: no handshake answer within "
                    f"{self._conn.config.handshake_timeout_s:.3g}s"))
            for rid, pull in list(peer.confirming.items()):
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
        if pull is None:
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
        self.abandoned.add(pull, getattr(self._peers.get(pull.remote_engine_id), "agent_name", ""))
        self.send_release_for(pull)
        if pull.handle.cancel_requested:
            self._fail(pull, TransferError(f"pull {pull.handle.request_id} cancelled"))
        else:
            self._fail(pull, TransferTimeoutError(
                f"pull {pull.handle.request_id} from {pull.remote_engine_id} not complete after "
                f"{now - pull.requested_s:.3g}s; abandoned"))

    def send_release_for(self, pull: Pull) -> None:
        peer = self._peers.get(pull.remote_engine_id)
        if peer is not None:
            peer.channel.send(p.LeaseRequest(p.PROTOCOL_VERSION, self._conn.engine_id, pull.remote_request_id,
                                             p.LeaseAction.RELEASE))

    def send_release(self, params: p.KVTransferParams) -> None:
        if not (params.remote_engine_id and params.remote_host and params.remote_port and params.remote_request_id):
            return
        peer = self._peers.get(params.remote_engine_id)
        if peer is None:
            peer = Peer(params.remote_engine_id, params.remote_host, params.remote_port,
                        PeerChannel(self._ctx, params.remote_host, params.remote_port, self._secret))
            self._peers[peer.engine_id] = peer
        peer.channel.send(p.LeaseRequest(p.PROTOCOL_VERSION, self._conn.engine_id, params.remote_request_id,
                                         p.LeaseAction.RELEASE))

    def _release_xfer(self, pull: Pull) -> None:
        if pull.xfer is not None:
            self._conn.agent.release(pull.xfer)
            pull.xfer = None

    def _succeed(self, pull: Pull) -> None:
        conn = self._conn
        conn.counters.pulls_ok += 1
        conn.counters.bytes_pulled += pull.handle.stats.bytes
        conn.counters.descs_posted += pull.handle.stats.num_descs_merged
        pull.finish(None)
        if conn.on_pull_done:
            conn.on_pull_done(pull.handle.stats, None)

    def _fail(self, pull: Pull, error: KVConnectError) -> None:
        conn = self._conn
        conn.counters.failed(error)
        log.warning("pull %s from %s failed: %s", pull.handle.request_id, pull.remote_engine_id, error)
        pull.finish(error)
        if conn.on_pull_done:
            conn.on_pull_done(pull.handle.stats, error)

    def _fail_peer(self, peer: Peer, error: KVConnectError) -> None:
        waiting, peer.waiting = peer.waiting, []
        self._drop_peer(peer, str(error))
        for pull in waiting:
            self._fail(pull, error)

    def _drop_peer(self, peer: Peer, why: str) -> None:
        """Forget a peer: its remote agent, prepared lists and channel. In-flight pulls fail."""
        log.info("dropping peer %s: %s", peer.engine_id, why)
        self._peers.pop(peer.engine_id, None)
        for pull in [x for x in self._posted if x.remote_engine_id == peer.engine_id]:
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

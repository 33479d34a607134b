"""Decode side of a connector: pulls driven from request to usable blocks.

Runs inside the connector's ticks (except `prepare`, which only validates). Each pull goes WAIT_PEER -> POSTED ->
CONFIRMING -> DONE, or FAILED from any of them (`pull.PullPhase`):

- WAIT_PEER: the peer (`peers.py`) is handshaking; a pull naming another incarnation, or a disconnect, drops the
  stale peer and handshakes again;
- POSTED: the peer's transport (`transports/`) moves the blocks; with `pin_reads` the lease is pinned just before
  the transfer is posted, so a transfer that ends under a held pin needs no round trip;
- CONFIRMING: a held pin, or the prefill's lease board showing the lease held (same host: `board.py`), makes the
  pull DONE; else the prefill side is asked whether its lease held until the read ended (fail closed).

Every pull ends by its deadline whatever its peer is doing (`_sweep_deadlines`); params that disagree with a known
peer are checked before it is replaced (`claims.py`). A request read from several prefill ranks (heterogeneous TP)
runs as one pull per rank, joined by a `PullGroup`. With nothing in flight (`quiet`) the loop thread ticks rarely.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvconnect.core.agent import XferState
from kvconnect.core.allowlist import parse_allowlist
from kvconnect.core.cache import KVCache
from kvconnect.core.config import ConnectorConfig
from kvconnect.core.decode.claims import Claims
from kvconnect.core.decode.confirm import LeaseConfirmation
from kvconnect.core.decode.peers import Peer, PeerSet
from kvconnect.core.decode.pull import AbandonedReads, BlockIds, PinState, Pull, PullHandle, PullPhase, release_posted
from kvconnect.core.decode.releases import Releases
from kvconnect.core.decode.staging import place
from kvconnect.core.errors import (
    HandshakeError,
    HandshakeTimeoutError,
    InvalidRequestError,
    KVConnectError,
    LeaseLostError,
    PeerGoneError,
    TransferError,
    TransferTimeoutError,
)
from kvconnect.core.plan.groups import GroupedBlocks
from kvconnect.core.plan.params import KVTransferParams
from kvconnect.core.snapshot import Counters
from kvconnect.core.wire import protocol as p
from kvconnect.core.wire.logs import LogLimiter

log = logging.getLogger(__name__)

FAILURE_LOGS_PER_S = 10.0  # failed pulls logged per second at most (the rest are counted into the next line)
# on_done(stats of the request, its error or None): once per request, inside a tick
DoneCallback = Callable[[Pull, KVConnectError | None], None]


class DecodeSide:
    def __init__(
        self,
        peers: PeerSet,
        cache: KVCache,
        config: ConnectorConfig,
        engine_id: str,
        counters: Counters,
        on_done: DoneCallback,
    ) -> None:
        self.peers, self._cache, self._config = peers, cache, config
        self._engine_id, self._counters, self._on_done = engine_id, counters, on_done
        self._staging_wait: list[Pull] = []  # staging pulls waiting for free staging blocks
        self._posted: list[Pull] = []
        self.abandoned = AbandonedReads()  # given-up transfers that may still land
        self._confirm = LeaseConfirmation(config, cache, engine_id, self._succeed, self._fail)
        self._allowed = parse_allowlist(config.peer_allowlist)
        self.release = Releases(peers, engine_id, self._allowed)
        self.claims = Claims(peers, engine_id)
        self._failure_logs = LogLimiter(FAILURE_LOGS_PER_S)

    # --- any thread --------------------------------------------------------------------------------

    def prepare(
        self,
        params: KVTransferParams,
        local_block_ids: BlockIds,
        request_id: str | None,
        prompt_digest: bytes = b"",
        requested_s: float | None = None,
        leased: GroupedBlocks | None = None,
    ) -> tuple[PullHandle, Callable[[], None]]:
        """Validate a pull; returns its handle and the function that starts it at the next tick."""
        spec, timeout_s = self._cache.spec, self._config.pull_timeout_s
        pull = Pull.from_params(
            params, local_block_ids, request_id, spec, timeout_s, prompt_digest, requested_s, leased
        )
        self._allowed.check(pull.remote_host, "kv_transfer_params.remote_host")
        sources = self.peers.sources(pull.remote_tp)
        parts = pull.parts_for(sources.reads)

        def start() -> None:
            for part in parts:
                try:
                    self._start(part)
                except Exception as e:  # e.g. no socket for the peer: this pull fails, naming why
                    why = f"pull {part.handle.request_id}: could not start: {type(e).__name__}: {e}"
                    self._fail(part, e if isinstance(e, KVConnectError) else TransferError(why))
            for rank in sources.release_only:
                self.release.to_rank(params, rank)  # copies of heads nobody reads: free them now

        return pull.handle, start

    # --- inside a tick -----------------------------------------------------------------------------

    def busy(self) -> bool:  # a transfer or a confirmation in flight: the loop then spins instead of sleeping
        return bool(self._posted) or any(peer.confirming for peer in self.peers.all())

    def answer_fds(self) -> list[int]:  # the channels owing lease answers, when those are all it waits for
        owing = [peer.channel for peer in self.peers.all() if peer.confirming]
        busy = self._posted or self._staging_wait or self._confirm.pending or self.claims
        return [] if busy or any(x.has_answer() for x in owing) else [x.fd for x in owing]  # (has_answer: see there)

    def quiet(self) -> bool:  # nothing waits for a tick: no transfer, handshake, confirmation, claim or release
        busy = self._posted or self._staging_wait or self.claims or self.abandoned or self.peers.short
        return not (busy or self._confirm.pending or any(peer.waiting or peer.confirming for peer in self.peers.all()))

    def _start(self, pull: Pull) -> None:
        pull.handle.stats.queued_s = time.monotonic() - pull.requested_s
        assert pull.source is not None
        peer = self.peers.get(pull.peer_key)
        if peer is not None and self.peers.stale(peer, pull):
            self.claims.add(pull)  # a restart or a move, or forged params: checked before the peer is touched
            return
        if peer is None:
            peer = self.peers.new(
                pull.remote_engine_id, pull.remote_host, pull.remote_port, pull.source, pull.remote_tp, self._busy
            )
        if peer.ready:
            self._post(peer, pull)
            return
        peer.waiting.append(pull)
        if not peer.hello_sent_s:
            peer.hello_sent_s = time.monotonic()
            peer.channel.send(p.Hello(p.PROTOCOL_VERSION, self._engine_id))

    def _busy(self, peer: Peer) -> bool:
        """Whether `peer` serves anything now (a peer that does not may be forgotten at the peers' cap)."""
        posted = any(x.peer_key == peer.key for x in self._posted)
        return bool(peer.waiting or peer.confirming or posted or self.abandoned.uses(peer.agent_name))

    def _replace(self, claim: Peer, info: p.PeerInfo) -> None:
        """A proven claim (claims.py) replaces the known peer of its engine and rank."""
        current = self.peers.get(claim.key)
        if current is not None:  # (its waiting pulls fail too: they wait for an address or process that is gone)
            why = (
                f"restarted or its address changed: incarnation {info.incarnation_id[:12]} at {claim.host}:{claim.port}"
            )
            self._fail_peer(current, PeerGoneError(f"engine {current.engine_id} {why}"))
        self.peers.adopt(claim)
        self._peer_ready(claim, info)

    def _peer_ready(self, peer: Peer, info: p.PeerInfo) -> None:
        t0 = time.monotonic()
        try:
            self.peers.setup(peer, info)
        except Exception as e:  # a set-up that failed half way: the peer is dropped and handshaken again
            self._counters.handshake_failures += 1
            why = f"engine {peer.engine_id}: peer set-up failed: {type(e).__name__}: {e}"
            error = e if isinstance(e, KVConnectError) else HandshakeError(why)
            if not isinstance(e, KVConnectError):
                log.exception("peer %s: set-up failed", peer.key)
            self._fail_peer(peer, error)
            return
        self._counters.handshakes += 1
        handshake_s = time.monotonic() - peer.hello_sent_s
        self.peers.log_ready(peer, handshake_s, time.monotonic() - t0)
        waiting, peer.waiting = peer.waiting, []
        for pull in waiting:
            pull.handle.stats.handshake_s = handshake_s
            if pull.expected_incarnation not in (None, info.incarnation_id):
                self._fail(
                    pull,
                    LeaseLostError(
                        f"prefill engine {peer.engine_id} restarted (lease was granted by incarnation "
                        f"{pull.expected_incarnation[:12]}, peer is now {info.incarnation_id[:12]})"
                    ),
                )
            else:
                self._post(peer, pull)

    def _post(self, peer: Peer, pull: Pull) -> None:
        plan_src, transport, info = peer.plan, peer.transport, peer.info
        assert plan_src is not None and transport is not None and info is not None and pull.source is not None
        t0 = time.monotonic()
        try:
            ordered = self.peers.order(peer, pull)
        except InvalidRequestError as e:
            self._fail(pull, e)
            return
        if ordered is None:  # no staging space yet
            self._staging_wait.append(pull)
            return
        local, remote = ordered
        stats = pull.handle.stats
        stats.granularity = plan_src.pair.granularity.name
        stats.transport = transport.kind.value
        stats.path = plan_src.path.value
        notif = pull.notif(info.incarnation_id) if transport.notifies else b""  # (a digest of the ids: not free)
        t_pin = time.monotonic()
        stats.validate_s = t_pin - t0
        self._confirm.pin(peer, pull)  # before posting: the PIN's round trip runs while the transfer is posted
        t_launch = time.monotonic()
        try:
            pull.posted, state, plan = transport.post(local, remote, pull.num_tokens, notif)
        except KVConnectError as e:
            if isinstance(e, PeerGoneError):
                self._drop_peer(peer, str(e))
            self._fail(pull, e)
            return
        pull.posted_s = time.monotonic()
        stats.num_blocks, stats.bytes = plan.num_blocks, plan.total_bytes
        stats.num_descs, stats.num_descs_merged = plan.num_descs, plan.num_descs_merged
        stats.post_s, stats.pin_s, stats.launch_s = pull.posted_s - t0, t_launch - t_pin, pull.posted_s - t_launch
        pull.phase = PullPhase.POSTED
        self._posted.append(pull)
        self._confirm.posted(peer, pull)  # (while the transfer runs)
        self._check(pull, state)

    def _check(self, pull: Pull, state: XferState) -> None:
        if state is XferState.PROC:
            return
        self._posted.remove(pull)
        if state is XferState.ERR:
            release_posted(pull)
            self._fail(pull, TransferError(f"pull {pull.handle.request_id}: the transfer reported ERR"))
            return
        now = time.monotonic()
        pull.read_done_s = now
        pull.handle.stats.transfer_s = now - pull.posted_s
        if pull.posted is not None and self._config.telemetry:
            pull.handle.stats.num_descs_issued = pull.posted.issued_descs() or 0
        release_posted(pull)
        peer = self.peers.get(pull.peer_key)
        if pull.staging_ids is not None:
            if peer is None or peer.plan is None:
                pull.run_on_settled()
                self._fail(
                    pull, PeerGoneError(f"engine {pull.remote_engine_id} dropped before its staged blocks were placed")
                )
                return
            pull.handle.stats.scatter_s = place(self.peers.staging_pool(peer.plan), self._cache, pull)
        self._confirm.read_done(peer, pull)

    def progress(self) -> None:
        """One loop tick: replies, transfer states, cancellations and deadlines."""
        now = time.monotonic()
        for peer in self.peers.all():
            for ref, reply in peer.channel.receive():
                self._on_reply(peer, ref, reply)
        for pull in list(self._posted):
            assert pull.posted is not None
            if pull.posted.abandonable and (pull.handle.cancel_requested or now >= pull.deadline_s):
                self._abandon(pull, now)
                continue
            try:
                state = pull.posted.state()
            except KVConnectError as e:
                self._posted.remove(pull)
                release_posted(pull)
                owner = self.peers.get(pull.peer_key)
                if isinstance(e, PeerGoneError) and owner is not None:
                    self._drop_peer(owner, str(e))
                self._fail(pull, e)
                continue
            self._check(pull, state)
        waiting, self._staging_wait = self._staging_wait, []
        for pull in waiting:
            staged_for = self.peers.get(pull.peer_key)
            if pull.handle.cancel_requested or now >= pull.deadline_s or staged_for is None or not staged_for.ready:
                self.release.for_pull(pull)
                self._fail(
                    pull,
                    TransferTimeoutError(
                        f"pull {pull.handle.request_id}: no staging space before the deadline (raise staging_mb)"
                    ),
                )
            else:
                self._post(staged_for, pull)
        for claim, answer in self.claims.settled(now, self._config.handshake_timeout_s):
            if not self.claims.refuted(claim, answer, self._fail) and isinstance(answer, p.PeerInfo):
                self._replace(claim, answer)
        self._confirm.tick(now, lambda pull: self.peers.get(pull.peer_key))
        self._sweep_deadlines(now)
        self.abandoned.poll()
        self.peers.short.poll(now)

    def _sweep_deadlines(self, now: float) -> None:
        """Handshakes past their deadline fail their peer; any other waiting or confirming pull past its own
        deadline (or cancelled) fails alone, whatever its peer is doing."""
        timeout_s = self._config.handshake_timeout_s
        for peer in self.peers.all():
            if not peer.ready and peer.waiting and now - peer.hello_sent_s >= timeout_s:
                self._counters.handshake_failures += 1
                why = f"at {peer.host}:{peer.port}: no handshake answer within {timeout_s:.3g}s"
                self._fail_peer(peer, HandshakeTimeoutError(f"engine {peer.engine_id} {why}"))
                continue
            waiting, confirming = peer.take_overdue(now)
            if not peer.ready and not peer.waiting:  # nobody waits for its handshake (cancelled): free its slot
                self._drop_peer(peer, "no pull waits for its handshake")
            for late in waiting:
                self.release.for_pull(late)
                why = "cancelled" if late.handle.cancel_requested else f"peer {peer.key} not ready before its deadline"
                self._fail(late, TransferTimeoutError(f"pull {late.handle.request_id}: {why}"))
            for late in confirming:
                why = "lease not confirmed before the deadline; data discarded"
                self._fail(late, TransferTimeoutError(f"pull {late.handle.request_id}: {why}"))

    def _on_reply(self, peer: Peer, ref: str, reply: p.PeerInfo | p.LeaseReply | HandshakeError) -> None:
        if ref == "hello" or (isinstance(reply, HandshakeError) and not ref):
            if isinstance(reply, p.PeerInfo):
                if not peer.ready:
                    self._peer_ready(peer, reply)
            elif isinstance(reply, HandshakeError) and not peer.ready:
                self._counters.handshake_failures += 1
                self._fail_peer(peer, reply)
            return
        pull = peer.confirming.pop(ref, None)
        if pull is None or pull.phase in (PullPhase.DONE, PullPhase.FAILED):
            return
        assert not isinstance(reply, p.PeerInfo)
        self._confirm.answer_or_fail(peer, pull, reply)  # (the rest of the batch is handled whatever it does)

    def _abandon(self, pull: Pull, now: float) -> None:
        """Give up a transfer at its deadline or cancellation (failing the pull quarantines its blocks)."""
        self.release.for_pull(pull)
        rid, waited_s = pull.handle.request_id, now - pull.requested_s
        why = f"pull {rid} from {pull.remote_engine_id} not complete after {waited_s:.3g}s; abandoned"
        self._fail(
            pull, TransferError(f"pull {rid} cancelled") if pull.handle.cancel_requested else TransferTimeoutError(why)
        )

    def _succeed(self, pull: Pull) -> None:
        self._counters.bytes_pulled += pull.handle.stats.bytes
        pull.finish(None)
        self._report(pull, None)

    def _fail(self, pull: Pull, error: KVConnectError) -> None:
        if pull.phase in (PullPhase.DONE, PullPhase.FAILED):
            return
        if pull.pin is not PinState.NONE:  # drop our pin now rather than when it times out
            self.release.for_pull(pull)
        if self._failure_logs.allow():  # (clients choose how many pulls fail: a few lines a second, then a count)
            log.warning("%s%s", pull.failure_line(error), self._failure_logs.suppressed())
        if pull in self._posted:  # its transfer runs on (given up, refused, peer dropped): hold its blocks until it
            self._posted.remove(pull)  # ends, and a NIXL READ's remote agent with them
            peer = self.peers.get(pull.peer_key)
            abandonable = pull.posted is not None and pull.posted.abandonable
            self.abandoned.add(pull, peer.agent_name if peer is not None and abandonable else "")
        elif pull.posted is None:
            pull.run_on_settled()  # no transfer can land in its staging blocks any more
        pull.finish(error)
        self._report(pull, error)

    def _report(self, pull: Pull, error: KVConnectError | None) -> None:
        """Count and announce a finished request (a multi-source one once, when its group ends)."""
        if pull.group is not None:
            if not pull.group.part_done(pull, error):
                return
            pull = pull.group.parent
        if error is None:
            self._counters.pulls_ok += 1
        else:
            self._counters.failed(error)
        self._on_done(pull, error)

    def _fail_peer(self, peer: Peer, error: KVConnectError) -> None:
        waiting, peer.waiting = peer.waiting, []
        self._drop_peer(peer, str(error))
        for pull in waiting:
            self._fail(pull, error)

    def _drop_peer(self, peer: Peer, why: str) -> None:
        """Forget a peer: its remote agent, prepared lists, transport and channel. In-flight pulls fail."""
        log.info("dropping peer %s: %s", peer.key, why)
        for pull in [x for x in self._posted if x.peer_key == peer.key]:  # (_fail holds their blocks)
            self._fail(pull, PeerGoneError(f"engine {peer.engine_id} dropped: {why}"))
        for pull in list(peer.confirming.values()):  # (_fail releases a pinned pull: that edits `confirming`)
            self._fail(pull, PeerGoneError(f"engine {peer.engine_id} dropped before confirmation: {why}"))
        peer.confirming.clear()
        self.peers.forget(peer, keep_agent=self.abandoned.uses(peer.agent_name))

    def close(self) -> None:
        for claim in list(self.claims.close()):
            for pull in claim.waiting:
                self._fail(pull, PeerGoneError("connector closed"))
        for peer in self.peers.all():
            self._fail_peer(peer, PeerGoneError("connector closed"))
        for pull in list(self._posted):
            self._posted.remove(pull)
            release_posted(pull)
            self._fail(pull, TransferError("connector closed"))
        self.abandoned.close()
        self.peers.short.close()

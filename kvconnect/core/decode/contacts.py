"""The decode half's contact with its peers: first contact, handshake answers, proven claims, and peers lost.

A pull reaches its peer here (`reach`): a known, ready peer takes it at once; an unknown one gets a handshake
(bounded: `peers.py`); params that disagree with a known peer become a claim, checked before the peer is touched
(`claims.py`). A handshake answer makes the peer ready (its plan and link: `PeerSet.setup`) and hands back the pulls
that waited for it; a proven claim replaces the known peer. A peer that fails its set-up, its handshake deadline or
its connection is dropped, and every pull it held fails with the reason. These steps return the pulls ready to post;
posting them is the puller's (`puller.py`). Loop thread only, inside a tick.
"""

from __future__ import annotations

import logging
import time

from kvconnect.core.decode.claims import Claims
from kvconnect.core.decode.endings import Endings
from kvconnect.core.decode.peers import MAX_ALIASES, Peer, PeerSet
from kvconnect.core.decode.pull import Pull, PullPhase
from kvconnect.core.errors import (
    HandshakeError,
    HandshakeTimeoutError,
    KVConnectError,
    LeaseLostError,
    PeerGoneError,
    TransferTimeoutError,
)
from kvconnect.core.snapshot import Counters
from kvconnect.core.wire import protocol as p
from kvconnect.core.wire.logs import loggable

log = logging.getLogger(__name__)
Ready = list[tuple[Peer, Pull]]  # pulls whose peer is ready now: to post


class Contacts:
    def __init__(
        self, peers: PeerSet, endings: Endings, counters: Counters, engine_id: str, posted: list[Pull]
    ) -> None:
        """`posted`: the puller's pulls in flight (a dropped peer's fail with it)."""
        self.peers, self._endings, self._counters, self._engine_id = peers, endings, counters, engine_id
        self._posted = posted
        self.claims = Claims(peers, engine_id)

    def reach(self, pull: Pull) -> Peer | None:
        """The ready peer `pull` is posted to now, or None: it waits for a handshake or a claim's check."""
        assert pull.source is not None
        peer = self.peers.get(pull.peer_key)
        if peer is not None and self.peers.stale(peer, pull):
            # a restart or a move, or forged params: checked before the peer is touched
            self.claims.add(pull)
            return None
        if peer is None:
            peer = self.peers.new(
                pull.remote_engine_id, pull.remote_host, pull.remote_port, pull.source, pull.remote_tp, self._busy
            )
        if peer.ready:
            return peer
        peer.waiting.append(pull)
        if not peer.hello_sent_s:
            peer.hello_sent_s = time.monotonic()
            peer.channel.send(p.Hello(p.PROTOCOL_VERSION, self._engine_id))
        return None

    def answered(self, peer: Peer, reply: p.PeerInfo | HandshakeError) -> Ready:
        """The peer's handshake answer (or its refusal)."""
        if peer.ready:
            return []
        if isinstance(reply, p.PeerInfo):
            return self._setup(peer, reply)
        self._counters.handshake_failures += 1
        self.fail_peer(peer, reply)
        return []

    def settle_claims(self, now: float, timeout_s: float) -> Ready:
        """Claims answered or past their deadline: a refuted one fails its pulls, a proven one replaces the peer."""
        ready: Ready = []
        for claim, answer in self.claims.settled(now, timeout_s):
            if not self.claims.refuted(claim, answer, self._endings.fail) and isinstance(answer, p.PeerInfo):
                current = self.peers.get(claim.key)
                if current is not None and current.ready and current.info is not None:
                    if current.info.incarnation_id == answer.incarnation_id:
                        # the same process, reached by another spelling of its address or another interface: no
                        # restart; the claim's pulls go to the known peer, and its other pulls run on
                        log.info(
                            "peer %s answered at %s:%d too: the same incarnation", claim.key, claim.host, claim.port
                        )
                        claim.channel.close()
                        if len(current.aliases) < MAX_ALIASES:
                            current.aliases.add((claim.host, claim.port))
                        ready += [(current, pull) for pull in claim.waiting]
                        continue
                if current is not None:
                    # its waiting pulls fail too: they wait for an address or process that is gone
                    at = f"incarnation {answer.incarnation_id[:12]} at {claim.host}:{claim.port}"
                    why = f"engine {current.engine_id} restarted or its address changed: {at}"
                    self.fail_peer(current, PeerGoneError(why))
                self.peers.adopt(claim)
                ready += self._setup(claim, answer)
        return ready

    def sweep(self, now: float, timeout_s: float) -> None:
        """Handshakes past their deadline fail their peer; any other waiting or confirming pull past its own deadline
        (or cancelled) fails alone, whatever its peer is doing."""
        for peer in self.peers.all():
            if not peer.ready and peer.waiting and now - peer.hello_sent_s >= timeout_s:
                self._counters.handshake_failures += 1
                why = f"at {peer.host}:{peer.port}: no handshake answer within {timeout_s:.3g}s"
                self.fail_peer(peer, HandshakeTimeoutError(f"engine {peer.engine_id} {why}"))
                continue
            waiting, confirming = peer.take_overdue(now)
            if not peer.ready and not peer.waiting:  # nobody waits for its handshake (cancelled): free its slot
                self.drop(peer, "no pull waits for its handshake")
            for late in waiting:
                self._endings.releases.for_pull(late)
                rid = late.handle.request_id
                why = "cancelled" if late.handle.cancel_requested else f"peer {peer.key} not ready before its deadline"
                self._endings.fail(late, TransferTimeoutError(f"pull {rid}: {why}"))
            for late in confirming:
                why = "lease not confirmed before the deadline; data discarded"
                self._endings.fail(late, TransferTimeoutError(f"pull {late.handle.request_id}: {why}"))

    def fail_peer(self, peer: Peer, error: KVConnectError) -> None:
        """Drop `peer`; the pulls waiting for its handshake fail with `error`."""
        waiting, peer.waiting = peer.waiting, []
        self.drop(peer, str(error))
        for pull in waiting:
            self._endings.fail(pull, error)

    def drop(self, peer: Peer, why: str) -> None:
        """Forget a peer: its link and channel. Its pulls in flight or being confirmed fail."""
        log.info("dropping peer %s: %s", peer.key, loggable(why, 400))
        for pull in [x for x in self._posted if x.peer_key == peer.key and x.phase is PullPhase.POSTED]:
            self._endings.fail(pull, PeerGoneError(f"engine {peer.engine_id} dropped: {why}"))
        for pull in list(peer.confirming.values()):  # (failing a pinned pull releases it: that edits `confirming`)
            self._endings.fail(pull, PeerGoneError(f"engine {peer.engine_id} dropped before confirmation: {why}"))
        peer.confirming.clear()
        self.peers.forget(peer)

    def close(self) -> None:
        for claim in list(self.claims.close()):
            for pull in claim.waiting:
                self._endings.fail(pull, PeerGoneError("connector closed"))
        for peer in self.peers.all():
            self.fail_peer(peer, PeerGoneError("connector closed"))

    def _setup(self, peer: Peer, info: p.PeerInfo) -> Ready:
        t0 = time.monotonic()
        try:
            self.peers.setup(peer, info)
        except Exception as e:  # a set-up that failed half way: the peer is dropped and handshaken again
            self._counters.handshake_failures += 1
            why = f"engine {peer.engine_id}: peer set-up failed: {type(e).__name__}: {e}"
            if not isinstance(e, KVConnectError):
                log.exception("peer %s: set-up failed", peer.key)
            self.fail_peer(peer, e if isinstance(e, KVConnectError) else HandshakeError(why))
            return []
        self._counters.handshakes += 1
        handshake_s = time.monotonic() - peer.hello_sent_s
        self.peers.log_ready(peer, handshake_s, time.monotonic() - t0)
        waiting, peer.waiting = peer.waiting, []
        ready: Ready = []
        for pull in waiting:
            pull.handle.stats.handshake_s = handshake_s
            if pull.expected_incarnation in (None, info.incarnation_id):
                ready.append((peer, pull))
                continue
            was, now = pull.expected_incarnation[:12], info.incarnation_id[:12]
            why = f"lease was granted by incarnation {was}, peer is now {now}"
            self._endings.fail(pull, LeaseLostError(f"prefill engine {peer.engine_id} restarted ({why})"))
        return ready

    def _busy(self, peer: Peer) -> bool:
        """Whether `peer` serves anything now (a peer that does not may be forgotten at the peers' cap)."""
        posted = any(x.peer_key == peer.key for x in self._posted if x.phase is PullPhase.POSTED)
        return bool(peer.waiting or peer.confirming or posted or self._endings.abandoned.uses(peer.key))

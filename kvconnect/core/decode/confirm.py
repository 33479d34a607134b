"""Fail closed: a pull's data counts only if the prefill's lease held until its transfer ended.

Decode side, inside the connector's ticks. Two ways to know, per pull:

- **pin** (`pin_reads`, the default): just before the transfer is posted, ask the prefill to keep the blocks
  for this reader until it confirms (or until the pull's deadline). A HELD answer means no lease end can free
  the blocks under the read, so a transfer that ends under a held pin succeeds at once; the CONFIRM that
  follows only ends the pin (its answer is not awaited);
- **confirm**: after the transfer, ask whether the lease was still held (or completed by our own notification)
  when the read ended; only COMPLETED makes the pull usable.

A prefill that grants leases a little after their params leave (the vLLM plug-in grants on its next engine
step) says so in its handshake (`PeerInfo.lease_grace_ms`); a PIN or CONFIRM it answers with "never seen" is
then asked again, with backoff, until that grace or the pull's deadline ends. Such an engine holds the blocks
from before the params leave, so a READ posted before the grant read the request's data; whether the lease
held is still decided by the prefill's answer.

A pin that was refused (the lease had ended, or named blocks it does not hold) fails the pull. Without
`confirm_reads`, a transport whose transfer notifies the prefill by itself (NIXL) is trusted unasked; that is
not fail-closed, and the worker warns at start when it is configured.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable

from kvconnect.core.board import binding
from kvconnect.core.cache import KVCache
from kvconnect.core.config import ConnectorConfig
from kvconnect.core.decode.endings import Endings
from kvconnect.core.decode.peers import Peer
from kvconnect.core.decode.pull import PinState, Pull, PullPhase
from kvconnect.core.digest import applies, block_sums, digest
from kvconnect.core.errors import (
    DigestError,
    HandshakeError,
    KVConnectError,
    LeaseLostError,
    PeerGoneError,
    TransferError,
)
from kvconnect.core.plan.groups import GroupedBlocks
from kvconnect.core.plan.hetero import ReadPath
from kvconnect.core.wire import lease_client
from kvconnect.core.wire import protocol as p

ASK_AGAIN_S = (0.002, 0.05)  # first and longest wait before asking again about a lease not granted yet
log = logging.getLogger(__name__)


def refusal(pull: Pull, reply: p.LeaseReply) -> KVConnectError | None:
    """The error a PIN or CONFIRM refused as a reader means (`LeaseReply.refusal`). It reads like any other lost
    lease (LeaseLostError): whether the params named a live lease's other blocks is not for a client to learn.
    """
    rid = pull.handle.request_id
    if reply.refusal is p.Refusal.BLOCKS:
        return LeaseLostError(f"pull {rid}: the prefill refused kv_transfer_params.remote_block_ids ({reply.reason})")
    if reply.refusal is p.Refusal.PROMPT:
        return LeaseLostError(f"pull {rid}: the prefill refused the read: {reply.reason}; data discarded")
    if reply.refusal is p.Refusal.TOKEN:
        return LeaseLostError(f"pull {rid}: the prefill refused the read: {reply.reason}")
    return None


def board_binding(pull: Pull) -> bytes:
    """The binding (board.py) the lease this pull reads must show on the board: its id, this decode's prompt, and
    the lease's blocks, of which the pull's must be the tail (b"": they are not, so the board cannot decide).
    """
    if pull.leased is None:
        return b""
    named = GroupedBlocks(pull.remote_block_ids, pull.group_sizes or (pull.remote_block_ids.size,))
    if not named.is_tail_of(pull.leased):
        return b""
    return binding(pull.lease_id, pull.prompt_digest, pull.leased.ids, pull.leased.sizes)


def on_board(peer: Peer, pull: Pull) -> bool:
    """Whether the peer's lease board shows the lease this pull read held now, bound as `board_binding` says
    (worked out while the transfer ran, by `LeaseConfirmation.posted`). Asked after the read has ended."""
    if peer.board is None:
        return False
    expected = pull.board_binding if pull.board_binding is not None else board_binding(pull)
    return bool(expected) and peer.board.holds(pull.lease_id, expected)


def lease_problem(reply: p.LeaseReply) -> str:
    """How a lease reply says the data cannot be trusted: its state, and the refusal's reason if any."""
    return f"{reply.state.value} ({reply.reason})" if reply.reason else reply.state.value


class LeaseConfirmation:
    def __init__(self, config: ConnectorConfig, cache: KVCache, engine_id: str, endings: Endings) -> None:
        self._config = config
        self._cache = cache
        self._engine_id = engine_id
        self._succeed = endings.succeed
        self._fail = endings.fail
        self._asking_again: list[Pull] = []  # pulls whose lease the prefill had not granted yet

    @property
    def pending(self) -> bool:
        """Whether a PIN or CONFIRM waits to be asked again."""
        return bool(self._asking_again)

    def needed(self, peer: Peer) -> bool:
        """Whether the prefill side is asked about the lease: always, unless `confirm_reads` is off and the
        transport itself tells the prefill that the read ended."""
        assert peer.link is not None
        return self._config.confirm_reads or not peer.link.notifies

    def pin(self, peer: Peer, pull: Pull) -> None:
        """The transfer is about to be posted: pin the lease for it if configured. Sent first, so that the
        answer's round trip overlaps the posting (a short transfer would otherwise end before it and wait);
        a post that then fails drops the pin with the pull (`endings.py`)."""
        if not (self.needed(peer) and self._config.pin_reads):
            return
        self._send_pin(peer, pull)

    def _send_pin(self, peer: Peer, pull: Pull) -> None:
        assert pull.source is not None
        now = time.monotonic()
        pin_s = max(pull.deadline_s - now, 0.001)
        pull.pin_sent_s = now
        pull.pin_until_s = now + pin_s  # at most: the answer says how long the prefill really keeps it
        pull.pin = PinState.SENT
        msg = lease_client.pin(
            self._engine_id,
            pull.lease_id,
            pull.source,
            pull.remote_block_ids,
            pin_s,
            pull.read_token,
            pull.prompt_digest,
            pull.group_sizes,
        )
        peer.confirming[p.ref_of(msg)] = pull
        peer.channel.send(msg)

    def posted(self, peer: Peer, pull: Pull) -> None:
        """The transfer is in flight: work out what the board must show for it now, not after the read."""
        if peer.board is not None and pull.pin is PinState.SENT:
            pull.board_binding = board_binding(pull)

    def read_done(self, peer: Peer | None, pull: Pull) -> None:
        """The transfer ended well and its data landed (CONFIRMING): decide now, or once the pin is answered."""
        if peer is not None and not self.needed(peer):
            self._succeed_checked(peer, pull)  # (the transfer's own notification ends the lease)
            return
        if pull.pin is PinState.SENT and peer is not None and on_board(peer, pull):
            pull.handle.stats.on_board = True  # (the PIN's answer, when it comes, finds the pull done)
            self._usable(peer, pull)
        elif pull.pin is not PinState.SENT:
            self._decide(peer, pull)

    def answer_or_fail(self, peer: Peer, pull: Pull, reply: p.LeaseReply | HandshakeError) -> None:
        """`answer`; a failure while handling it fails this pull alone, logged: it never leaves the tick, where
        the rest of that peer's batch of replies would be lost and their pulls would wait for their deadline.
        """
        try:
            self.answer(peer, pull, reply)
        except Exception as e:
            log.exception("pull %s: handling the prefill's lease answer failed", pull.handle.request_id)
            why = f"handling the prefill's lease answer failed: {type(e).__name__}: {e}"
            self._fail(pull, TransferError(f"pull {pull.handle.request_id}: {why}"[:500]))

    def answer(self, peer: Peer, pull: Pull, reply: p.LeaseReply | HandshakeError) -> None:
        """The prefill's answer to this pull's PIN or CONFIRM."""
        refused = refusal(pull, reply) if isinstance(reply, p.LeaseReply) else None
        if refused is not None:  # refused as a reader: it holds no pin, and a release (what failing a pinned
            pull.pin = PinState.NONE  # pull sends) would end a lease it has no claim on: its owner's
        if (
            isinstance(reply, p.LeaseReply)
            and peer.info is not None
            and reply.incarnation_id not in ("", peer.info.incarnation_id)
        ):  # another process on the same address answered
            refused = LeaseLostError(
                f"pull {pull.handle.request_id}: prefill engine {peer.engine_id} restarted "
                f"(incarnation {reply.incarnation_id[:12]} answered, not "
                f"{peer.info.incarnation_id[:12]}); data discarded"
            )
        if refused is not None:
            self._fail(pull, refused)
            return
        if isinstance(reply, p.LeaseReply) and self._not_granted_yet(peer, pull, reply):
            return
        if (
            isinstance(reply, p.LeaseReply)
            and reply.kv_digest
            and reply.state in (p.LeaseState.HELD, p.LeaseState.COMPLETED)
        ):
            pull.remote_digest = reply.kv_digest
        if pull.pin is PinState.SENT:
            pull.handle.stats.pin_rtt_s = time.monotonic() - pull.pin_sent_s
            if isinstance(reply, HandshakeError):
                pull.pin, pull.pin_error = PinState.LOST, f"unpinned ({reply})"
            elif reply.state in (p.LeaseState.HELD, p.LeaseState.COMPLETED):
                pull.pin = PinState.HELD  # (COMPLETED: our READ's notification already ended the lease)
                if reply.state is p.LeaseState.HELD:  # the prefill pins from when it got the PIN, for pin_ms
                    pull.pin_until_s = min(pull.pin_until_s, pull.pin_sent_s + reply.pin_ms / 1000)
            else:
                pull.pin, pull.pin_error = PinState.LOST, lease_problem(reply)
            if pull.phase is PullPhase.CONFIRMING:  # the transfer is already done
                self._decide(peer, pull)
            return
        if isinstance(reply, HandshakeError):
            self._fail(pull, reply)
        elif reply.state is p.LeaseState.COMPLETED:
            pull.handle.stats.confirm_s = time.monotonic() - pull.read_done_s
            self._succeed_checked(peer, pull)
        else:
            self._fail(
                pull,
                LeaseLostError(
                    f"pull {pull.handle.request_id}: prefill lease was "
                    f"{lease_problem(reply)} when the read finished; data discarded"
                ),
            )

    def _not_granted_yet(self, peer: Peer, pull: Pull, reply: p.LeaseReply) -> bool:
        """The prefill has never seen this lease but may still grant it (its handshake said how late): ask
        again after a backoff, unless that grace or the pull's deadline has run out."""
        grace_s = peer.info.lease_grace_ms / 1000 if peer.info is not None else 0.0
        if reply.state is not p.LeaseState.UNKNOWN or reply.reason or grace_s <= 0:
            return False
        now = time.monotonic()
        if not pull.not_granted_since_s:
            pull.not_granted_since_s = now
        wait_s = min(ASK_AGAIN_S[0] * 2**pull.asked, ASK_AGAIN_S[1])
        if now + wait_s - pull.not_granted_since_s > grace_s or now + wait_s >= pull.deadline_s:
            return False
        pull.ask_again_s = now + wait_s
        pull.asked += 1
        self._asking_again.append(pull)
        return True

    def _succeed_checked(self, peer: Peer | None, pull: Pull) -> None:
        """Succeed, unless the pulled blocks' digest says they hold something else (kv_digest)."""
        problem = self._digest_problem(peer, pull)
        if problem:
            self._fail(pull, DigestError(f"pull {pull.handle.request_id}: {problem}; data discarded"))
        else:
            self._succeed(pull)

    def _digest_problem(self, peer: Peer | None, pull: Pull) -> str:
        """Why the blocks this pull wrote are not the prefill's ("" when they are, or are not checked)."""
        if not self._config.kv_digest or peer is None or peer.plan is None or peer.info is None:
            return ""
        whole = peer.plan.path is ReadPath.BLOCK and peer.plan.pair.block_for_block
        if not applies(self._cache.spec, peer.info.spec, whole, pull.group is None):
            return ""  # (blocks reassembled from pieces or several sources: not checked)
        if not pull.remote_digest:
            return "the prefill's lease answer carried no digest (is its kv_digest on?)"
        t0 = time.monotonic()
        mine = digest(block_sums(self._cache, pull.local_block_ids))
        pull.handle.stats.digest_s = time.monotonic() - t0
        if hmac.compare_digest(mine, pull.remote_digest):
            return ""
        return f"the pulled blocks' digest {mine.hex()[:16]} is not the prefill's {pull.remote_digest.hex()[:16]}"

    def tick(self, now: float, peer_of: Callable[[Pull], Peer | None]) -> None:
        """Repeat the PINs and CONFIRMs that are due (loop tick)."""
        if not self._asking_again:
            return
        live = [x for x in self._asking_again if not x.ended]
        self._asking_again = [x for x in live if x.ask_again_s > now]
        for pull in (x for x in live if x.ask_again_s <= now):
            peer = peer_of(pull)
            if peer is None:
                self._fail(pull, PeerGoneError(f"engine {pull.remote_engine_id} dropped before confirmation"))
            elif pull.pin is PinState.SENT:
                self._send_pin(peer, pull)
            else:
                self._decide(peer, pull)

    def _decide(self, peer: Peer | None, pull: Pull) -> None:
        """Transfer done, pin answered (or none asked): succeed under a live pin, else confirm and wait."""
        if peer is None:
            self._fail(pull, PeerGoneError(f"engine {pull.remote_engine_id} dropped before confirmation"))
            return
        if pull.pin is PinState.LOST:
            self._fail(
                pull,
                LeaseLostError(
                    f"pull {pull.handle.request_id}: prefill lease was {pull.pin_error} "
                    "before the read was pinned; data discarded"
                ),
            )
            return
        if pull.pin is PinState.HELD and time.monotonic() < pull.pin_until_s:
            self._usable(peer, pull)  # the pin held the blocks through the read
            return
        confirm = self._confirmation(pull)
        peer.confirming[p.ref_of(confirm)] = pull
        peer.channel.send(confirm)

    def _usable(self, peer: Peer, pull: Pull) -> None:
        """The lease held through the read (a pin, or the board): usable now, then the CONFIRM (not awaited)."""
        pull.handle.stats.confirm_s = time.monotonic() - pull.read_done_s
        try:
            self._succeed_checked(peer, pull)
        # whatever the success's callbacks do; a digest that did not match failed it, dropped the pin
        finally:
            if pull.phase is PullPhase.DONE:
                # ends our pin and, for the last reader, the lease
                peer.channel.send(self._confirmation(pull))

    def _confirmation(self, pull: Pull) -> p.LeaseRequest:
        assert pull.source is not None
        return lease_client.confirm(
            self._engine_id,
            pull.lease_id,
            pull.source,
            pull.remote_block_ids,
            pull.read_token,
            pull.prompt_digest,
            pull.group_sizes,
        )

"""The decode half of a connector: pulls driven from request to usable blocks.

Runs inside the connector's ticks (except `prepare`, which only validates). Each pull goes WAIT_PEER -> POSTED
-> CONFIRMING -> DONE, or FAILED from any of them (`pull.PullPhase`); this module moves it, `endings.py` ends
it:

- WAIT_PEER: its peer (`peers.py`) is handshaking, or the peer's link has no room for it yet (staging blocks);
  params that disagree with a known peer are a claim, checked before the peer is touched (`claims.py`);
- POSTED: the peer's link (`transports/`) moves the blocks; with `pin_reads` the lease is pinned just before
  the transfer is posted, so a transfer that ends under a held pin needs no round trip;
- CONFIRMING: the data has landed; a held pin, or the prefill's lease board showing the lease held (same host:
  `board.py`), makes the pull DONE; else the prefill is asked whether its lease held until the read ended
  (`confirm.py`: fail closed).

Every pull ends by its deadline whatever its peer is doing (`Contacts.sweep`, and the transfers' own deadlines
here). Peers are reached, made ready and dropped in `contacts.py`. A request read from several prefill ranks
(heterogeneous TP) runs as one pull per rank. With nothing in flight (`quiet`) the loop ticks rarely.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec
import numpy as np

from kvconnect.core.allowlist import parse_allowlist
from kvconnect.core.cache import KVCache
from kvconnect.core.config import ConnectorConfig
from kvconnect.core.decode.abandoned import AbandonedReads
from kvconnect.core.decode.confirm import LeaseConfirmation
from kvconnect.core.decode.contacts import Contacts
from kvconnect.core.decode.endings import DoneCallback, Endings
from kvconnect.core.decode.handle import PullHandle
from kvconnect.core.decode.peers import Peer, PeerSet
from kvconnect.core.decode.pull import BlockIds, Pull, PullPhase
from kvconnect.core.decode.releases import Releases
from kvconnect.core.errors import (
    HandshakeError,
    InvalidRequestError,
    KVConnectError,
    LeaseLostError,
    PeerGoneError,
    TransferError,
    TransferTimeoutError,
)
from kvconnect.core.plan.groups import GroupedBlocks
from kvconnect.core.plan.params import FIELD, TRANSFER_MODE, KVTransferParams
from kvconnect.core.plan.signing import Keyring, verify_params
from kvconnect.core.snapshot import Counters
from kvconnect.core.transports.base import XferState
from kvconnect.core.wire import protocol as p

log = logging.getLogger(__name__)


def trusted(params: KVTransferParams, keys: Keyring, prompt_digest: bytes | None) -> None:
    """Refuse `params` a decode must not act on: unsigned or badly signed ones where the decode holds keys, and expired
    ones (InvalidRequestError naming the field); with `prompt_digest` (the decode's own binding), ones granted for
    another prompt (LeaseLostError, as the prefill would answer: the lease is not this prompt's to read, nor to
    end)."""
    verify_params(params, keys, int(time.time() * 1000))
    if params.transfer_mode not in (None, TRANSFER_MODE):
        why = f"the prefill's params are for a {params.transfer_mode!r} transfer; this decode pulls ({TRANSFER_MODE!r})"
        raise InvalidRequestError(f"{FIELD}.transfer_mode", why)
    if params.remote_wire_version not in (None, p.PROTOCOL_VERSION):
        why = (
            f"the prefill speaks kvconnect wire version {params.remote_wire_version}, this decode {p.PROTOCOL_VERSION}"
        )
        raise InvalidRequestError(f"{FIELD}.remote_wire_version", f"{why}: pair pods of one wire version")
    bound = params.remote_prompt_digest
    if prompt_digest is None or bound is None or bound == prompt_digest.hex():
        return
    why = "the lease holds the KV of another prompt" if prompt_digest else "the lease is bound to a prompt; none named"
    raise LeaseLostError(f"{FIELD}.remote_prompt_digest: {why}; nothing read")


class Puller:
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
        self._engine_id, self._counters = engine_id, counters
        self._no_room: list[Pull] = []  # pulls whose peer's link had no room for them yet
        self._posted: list[Pull] = []  # pulls whose transfer is in flight (polled each tick)
        self._allowed = parse_allowlist(config.peer_allowlist)
        self._keys = config.keyring
        self.release = Releases(peers, engine_id, self._allowed)
        self.endings = Endings(self.release, counters, on_done)
        self._confirm = LeaseConfirmation(config, cache, engine_id, self.endings)
        self.contacts = Contacts(peers, self.endings, counters, engine_id, self._posted)
        self.claims = self.contacts.claims
        self.on_loop_thread: Callable[[], bool] = lambda: True  # (the connector's loop says, once it exists)

    @property
    def abandoned(self) -> AbandonedReads:
        return self.endings.abandoned

    # --- any thread --------------------------------------------------------------------------------

    def prepare(
        self,
        params: KVTransferParams,
        local_block_ids: BlockIds,
        request_id: str | None,
        prompt_digest: bytes = b"",
        requested_s: float | None = None,
        tail: GroupedBlocks | None = None,
        skip_tokens: int = 0,
        state_ids: BlockIds | None = None,
    ) -> tuple[PullHandle, Callable[[], None]]:
        """Validate a pull; returns its handle and the function that starts it at the next tick. Params this decode
        cannot trust (signed: `plan/signing.py`), or granted for another prompt, are refused here: before anything
        is dialled. `tail`: the blocks to read, a tail of each group of the params'; `skip_tokens`: the lease's first
        tokens the caller holds already; `state_ids`: the local blocks that hold state (`KVConnector.pull`)."""
        spec, timeout_s = self._cache.spec, self._config.pull_timeout_s
        trusted(params, self._keys, prompt_digest)
        field = f"{FIELD}.remote_block_ids"
        leased = GroupedBlocks.flat(params.remote_block_ids or [], params.remote_group_sizes, field)
        if tail is not None:
            if not tail.is_tail_of(leased):
                raise InvalidRequestError(field, "the blocks to read are not a tail of each group of the params'")
            wanted = tail.wire_sizes()
            params = msgspec.structs.replace(
                params, remote_block_ids=tail.ids.tolist(), remote_group_sizes=wanted, remote_num_tokens=None
            )
        if skip_tokens and (tail is not None or len(leased.sizes) > 1 or skip_tokens % spec.block_size):
            raise InvalidRequestError(field, f"{skip_tokens} tokens to skip: whole blocks of one KV cache group only")
        pull = Pull.from_params(
            params, local_block_ids, request_id, spec, timeout_s, prompt_digest, requested_s, leased
        )
        pull.skip_tokens = skip_tokens
        if state_ids is not None:
            pull.state_ids = np.asarray(state_ids, dtype=np.int64).reshape(-1)
            if not np.isin(pull.state_ids, pull.local_block_ids).all():
                raise InvalidRequestError("state_ids", "names blocks this pull does not load")
        self._allowed.check(pull.remote_host, "kv_transfer_params.remote_host")
        sources = self.peers.sources(pull.remote_tp)
        parts = pull.parts_for(sources.reads)

        def start() -> None:
            for part in parts:
                try:
                    self._start(part)
                except Exception as e:  # e.g. no socket for the peer: this pull fails, naming why
                    why = f"pull {part.handle.request_id}: could not start: {type(e).__name__}: {e}"
                    self.endings.fail(part, e if isinstance(e, KVConnectError) else TransferError(why))
            for rank in sources.release_only:
                self.release.to_rank(params, rank)  # copies of heads nobody reads: free them now

        return pull.handle, start

    # --- inside a tick: the pull's steps ------------------------------------------------------------

    def _start(self, pull: Pull) -> None:
        pull.handle.stats.queued_s = time.monotonic() - pull.requested_s
        peer = self.contacts.reach(pull)
        if peer is not None:
            self._post(peer, pull)

    def _post(self, peer: Peer, pull: Pull) -> None:
        plan, link, info = peer.plan, peer.link, peer.info
        assert plan is not None and link is not None and info is not None and pull.source is not None
        t0 = time.monotonic()
        try:
            move = self.peers.prepare(peer, pull)
        except InvalidRequestError as e:
            self.endings.fail(pull, e)
            return
        if move is None:
            self._no_room.append(pull)
            return
        pull.move = move
        stats = pull.handle.stats
        stats.granularity, stats.transport, stats.path = plan.pair.granularity.name, link.kind, plan.path.value
        stats.posted_on = "loop" if self.on_loop_thread() else "engine"
        notif = pull.notif(info.incarnation_id) if link.notifies else b""  # (a digest of the ids: not free)
        t_pin = time.monotonic()
        stats.validate_s = t_pin - t0
        # before posting: the PIN's round trip runs while the transfer is posted
        self._confirm.pin(peer, pull)
        t_launch = time.monotonic()
        try:
            state, moved = move.post(notif)
        except KVConnectError as e:
            if isinstance(e, PeerGoneError):
                self.contacts.drop(peer, str(e))
            self.endings.fail(pull, e)
            return
        pull.posted_s = time.monotonic()
        stats.num_blocks, stats.bytes = moved.num_blocks, moved.total_bytes
        stats.num_descs, stats.num_descs_merged = moved.num_descs, moved.num_descs_merged
        stats.post_s, stats.pin_s, stats.launch_s = pull.posted_s - t0, t_launch - t_pin, pull.posted_s - t_launch
        pull.enter(PullPhase.POSTED)
        self._posted.append(pull)
        self._confirm.posted(peer, pull)  # (while the transfer runs)
        self._ended(pull, state)

    def _ended(self, pull: Pull, state: XferState) -> None:
        """The transfer's state as just polled: once it ended, land its data and decide whether it is usable."""
        if state is XferState.PROC:
            return
        self._posted.remove(pull)
        move = pull.move
        assert move is not None
        if state is XferState.ERR:
            move.settle()
            pull.move = None
            self.endings.fail(pull, TransferError(f"pull {pull.handle.request_id}: the transfer reported ERR"))
            return
        now = time.monotonic()
        pull.read_done_s = now
        pull.handle.stats.transfer_s = now - pull.posted_s
        if self._config.telemetry:
            pull.handle.stats.num_descs_issued = move.issued_descs() or 0
        pull.enter(PullPhase.CONFIRMING)
        move.release()
        try:
            pull.handle.stats.scatter_s = move.land()
        except Exception as e:
            log.exception("pull %s: placing its data failed", pull.handle.request_id)
            self.endings.fail(pull, TransferError(f"pull {pull.handle.request_id}: placing its data failed: {e}"[:500]))
            return
        move.settle()
        self._confirm.read_done(self.peers.get(pull.peer_key), pull)

    # --- inside a tick: the loop -----------------------------------------------------------------------

    def busy(self) -> bool:  # a transfer or a confirmation in flight: the loop then spins instead of sleeping
        return bool(self._posted) or any(peer.confirming for peer in self.peers.all())

    def answer_fds(self) -> list[int]:  # the channels owing lease answers, when those are all it waits for
        owing = [peer.channel for peer in self.peers.all() if peer.confirming]
        busy = self._posted or self._no_room or self._confirm.pending or self.claims
        # has_answer: see there
        return [] if busy or any(x.has_answer() for x in owing) else [x.fd for x in owing]

    # nothing waits for a tick: no transfer, handshake, confirmation, claim or release
    def quiet(self) -> bool:
        busy = self._posted or self._no_room or self.claims or self.abandoned or self.peers.short
        return not (busy or self._confirm.pending or any(peer.waiting or peer.confirming for peer in self.peers.all()))

    def progress(self) -> None:
        """One loop tick: replies, transfer states, cancellations and deadlines."""
        now = time.monotonic()
        for peer in self.peers.all():
            for ref, reply in peer.channel.receive():
                self._on_reply(peer, ref, reply)
        # ended elsewhere: abandoned
        self._posted[:] = [x for x in self._posted if x.phase is PullPhase.POSTED]
        for pull in list(self._posted):
            if pull.phase is not PullPhase.POSTED:  # (failed in this loop: its peer was dropped)
                continue
            assert pull.move is not None
            if pull.move.abandonable and (pull.handle.cancel_requested or now >= pull.deadline_s):
                self._abandon(pull, now)
                continue
            try:
                state = pull.move.state()
            except KVConnectError as e:
                self._posted.remove(pull)
                pull.move.settle()
                pull.move = None
                owner = self.peers.get(pull.peer_key)
                if isinstance(e, PeerGoneError) and owner is not None:
                    self.contacts.drop(owner, str(e))
                self.endings.fail(pull, e)
                continue
            self._ended(pull, state)
        waiting, self._no_room = self._no_room, []
        for pull in waiting:
            owner = self.peers.get(pull.peer_key)
            if pull.handle.cancel_requested or now >= pull.deadline_s or owner is None or not owner.ready:
                self.release.for_pull(pull)
                why = "no room on its peer's link before the deadline (staging: raise staging_mb)"
                self.endings.fail(pull, TransferTimeoutError(f"pull {pull.handle.request_id}: {why}"))
            else:
                self._post(owner, pull)
        for peer, pull in self.contacts.settle_claims(now, self._config.handshake_timeout_s):
            self._post(peer, pull)
        self._confirm.tick(now, lambda pull: self.peers.get(pull.peer_key))
        self.contacts.sweep(now, self._config.handshake_timeout_s)
        self.abandoned.poll()
        self.peers.short.poll(now)

    def _on_reply(self, peer: Peer, ref: str, reply: p.PeerInfo | p.LeaseReply | HandshakeError) -> None:
        if ref == "hello" or (isinstance(reply, HandshakeError) and not ref):
            if isinstance(reply, (p.PeerInfo, HandshakeError)):
                for ready, waited in self.contacts.answered(peer, reply):
                    self._post(ready, waited)
            return
        pull = peer.confirming.pop(ref, None)
        if pull is None or pull.ended:
            return
        assert not isinstance(reply, p.PeerInfo)
        self._confirm.answer_or_fail(peer, pull, reply)  # (the rest of the batch is handled whatever it does)

    def _abandon(self, pull: Pull, now: float) -> None:
        """Give up a transfer at its deadline or cancellation (its blocks wait for it: `endings.py`)."""
        self.release.for_pull(pull)
        rid, waited_s = pull.handle.request_id, now - pull.requested_s
        if pull.handle.cancel_requested:
            self.endings.fail(pull, TransferError(f"pull {rid} cancelled"))
            return
        why = f"pull {rid} from {pull.remote_engine_id} not complete after {waited_s:.3g}s; abandoned"
        self.endings.fail(pull, TransferTimeoutError(why))

    def close(self) -> None:
        self.contacts.close()
        for pull in [x for x in self._posted if x.phase is PullPhase.POSTED]:
            assert pull.move is not None
            pull.move.settle()
            pull.move = None
            self.endings.fail(pull, TransferError("connector closed"))
        self._posted.clear()
        self.abandoned.close()
        self.peers.short.close()

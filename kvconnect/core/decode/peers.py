"""The decode's prefill peers: the ones it knows, and what a handshake sets up for each.

A peer is one prefill rank (engine id + TP rank): its side channel, the incarnation and cache spec it answered
with, the plan chosen for it (`hetero.SourcePlan`) and the link a transport opened for that plan
(`transports/`). A peer is *ready* once its link exists; that is the last step of `PeerSet.setup`, so a set-up
that fails half way leaves a peer that is not ready and is dropped. How a link moves bytes is its transport's
business: nothing here knows NIXL. Loop thread only.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import zmq

from kvconnect.core.board import BoardReader
from kvconnect.core.cache import KVCache
from kvconnect.core.config import ConnectorConfig
from kvconnect.core.decode.pull import PullPhase
from kvconnect.core.errors import CapacityError, HandshakeError, InvalidRequestError, LayoutMismatchError
from kvconnect.core.plan.descriptors import token_span
from kvconnect.core.plan.hetero import ReadPath, Source, SourcePlan, Sources, plan_source, plan_sources
from kvconnect.core.plan.signing import Keyring
from kvconnect.core.transports.base import Link, Move
from kvconnect.core.transports.registry import Transports
from kvconnect.core.wire import protocol as p
from kvconnect.core.wire.handshake import PeerChannel
from kvconnect.core.wire.lease_client import ShortChannels
from kvconnect.core.wire.logs import loggable

if TYPE_CHECKING:
    from kvconnect.core.decode.pull import Pull

log = logging.getLogger(__name__)
MAX_PEERS = 256  # prefill ranks known at once; beyond, an idle one is forgotten (or a first contact refused)
MAX_HANDSHAKING = 32  # first contacts in flight at once (each one a socket to wherever its params point)
MAX_ALIASES = 8  # other addresses a peer is remembered to answer at
_ID = re.compile(r"[\x21-\x7e]{1,256}")  # what a peer's ids must be: printable ASCII, no spaces


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
    plan: SourcePlan | None = None
    link: Link | None = None  # its transport's link, opened for `plan`
    waiting: list[Pull] = field(default_factory=list)  # pulls waiting for the handshake
    confirming: dict[str, Pull] = field(default_factory=dict)  # by message ref: a PIN or CONFIRM answer due
    board: BoardReader | None = None  # its lease board, when it is on this host (board.py)
    # other (host, port) spellings it proved to answer at as this incarnation (`Contacts.settle_claims`)
    aliases: set[tuple[str, int]] = field(default_factory=set)

    @property
    def ready(self) -> bool:
        return self.link is not None

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
    """The known peers."""

    def __init__(
        self, transports: Transports, cache: KVCache, config: ConnectorConfig, ctx: zmq.Context, secret: Keyring
    ) -> None:
        self._transports = transports
        self._cache = cache
        self._config = config
        self._ctx = ctx
        self._secret = secret
        self._peers: dict[str, Peer] = {}
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
            self.forget(idle)
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

    def forget(self, peer: Peer) -> None:
        """Remove `peer`: its link (moves still in flight keep what they use until they settle), its board and
        its channel."""
        if self._peers.get(peer.key) is peer:
            del self._peers[peer.key]
        if peer.link is not None:
            peer.link.close()
            peer.link = None
        if peer.board is not None:
            peer.board.close()
            peer.board = None
        peer.channel.close()

    def stale(self, peer: Peer, pull: Pull) -> str:
        """How `pull`'s params disagree with what `peer` is ("" when they do not): another side-channel
        address, other heads, another incarnation. A claim to check, not a fact (decode/claims.py)."""
        address = (pull.remote_host, pull.remote_port)
        if peer.remote_tp != pull.remote_tp or (address != (peer.host, peer.port) and address not in peer.aliases):
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
        malformed = [name for name in ("incarnation_id", "agent_name") if not _ID.fullmatch(getattr(info, name))]
        if malformed:  # (ids a peer chose end up in log lines and NIXL calls: printable tokens only)
            raise HandshakeError(f"peer at {peer.host}:{peer.port}: malformed handshake answer: {', '.join(malformed)}")
        if (info.spec.tp_size, info.spec.tp_rank) != (peer.remote_tp, peer.source.rank):
            raise LayoutMismatchError(
                {"tp_rank": (peer.source.rank, info.spec.tp_rank), "tp_size": (peer.remote_tp, info.spec.tp_size)},
                f"peer at {peer.host}:{peer.port} is rank {info.spec.tp_rank} of {info.spec.tp_size}, expected "
                f"rank {peer.source.rank} of {peer.remote_tp} (ranks listen on base port + rank)",
            )
        staging_blocks = config.staging_mb * 2**20 // info.spec.block_bytes
        plan = plan_source(spec, info.spec, peer.source, config.hetero_path.value, staging_blocks)
        peer.info, peer.plan = info, plan
        if config.lease_board and not config.kv_digest:  # (the digest comes only with the PIN's answer)
            peer.board = BoardReader.open(info.lease_board, info.incarnation_id, info.boot_id)
        peer.link = self._transports.open(info, plan, peer.key)

    def log_ready(self, peer: Peer, handshake_s: float, setup_s: float) -> None:
        assert peer.plan is not None and peer.link is not None and peer.info is not None
        log.info(
            "peer %s ready: incarnation %s, %s<-%s, %s, %d descriptors per block, over %s, handshake %.1f ms "
            "(setup %.1f ms)",
            peer.key,
            loggable(peer.info.incarnation_id, 12),
            self._cache.spec.kind.value,
            peer.info.spec.kind.value,
            peer.plan.describe(),
            peer.plan.descs_per_block,
            peer.link.kind,
            handshake_s * 1e3,
            setup_s * 1e3,
        )

    def _skip(self, pull: Pull, remote_block: int, pieces: bool) -> None:
        """Read only the lease's tokens past the decode's own prefix-cache hit (`Pull.skip_tokens`): the prefill's
        blocks from the one that holds the first token past it. A hit that ends inside a prefill block (the
        decode's blocks smaller) reads that block from the token after the hit (`Pull.remote_offset`), which only
        a path moving pieces of blocks can (`pieces`); anything else would write the hit's blocks, shared with
        other requests, and is refused."""
        skip, field = pull.skip_tokens, "kv_transfer_params.remote_block_ids"
        if skip % remote_block and not pieces:
            raise InvalidRequestError(
                field,
                f"this decode's prefix cache holds the first {skip} tokens, which end inside a prefill block of "
                f"{remote_block} tokens: the rest cannot be read into whole blocks of its own",
            )
        if pull.num_tokens is not None:
            if pull.num_tokens <= skip:
                raise InvalidRequestError(field, f"the lease holds {pull.num_tokens} tokens, {skip} are held here")
            pull.num_tokens -= skip
        first = skip // remote_block
        if first >= pull.remote_block_ids.size:
            raise InvalidRequestError(field, f"{pull.remote_block_ids.size} blocks hold no tokens past {skip}")
        pull.remote_block_ids = pull.remote_block_ids[first:]
        pull.remote_offset, pull.skip_tokens = skip % remote_block, 0

    def prepare(self, peer: Peer, pull: Pull) -> Move | None:
        """`pull`'s move through the peer's link (None: no room on the link now, ask again later), with the
        tokens its blocks hold worked out where block sizes differ. InvalidRequestError when the ids do not
        fit the peer."""
        plan, link, info = peer.plan, peer.link, peer.info
        assert plan is not None and link is not None and info is not None
        if pull.skip_tokens:
            self._skip(pull, info.spec.block_size, plan.path is ReadPath.DIRECT and not plan.pair.block_for_block)
        by_block = plan.path is ReadPath.BLOCK or plan.pair.state_from  # (state pages split by TP: block for block)
        if len(pull.group_sizes) > 1 and not (by_block and plan.pair.block_for_block):
            raise InvalidRequestError(
                "kv_transfer_params.remote_group_sizes",
                f"a hybrid model's blocks (KV cache groups {list(pull.group_sizes)}) move only between caches "
                f"with the same block size (local {self._cache.spec.block_size}, remote {info.spec.block_size})",
            )
        if not plan.pair.block_for_block or plan.path is ReadPath.STAGING:
            pull.num_tokens = token_span(
                len(pull.local_block_ids),
                self._cache.spec.block_size,
                len(pull.remote_block_ids),
                info.spec.block_size,
                pull.num_tokens,
                pull.remote_offset,
            )
        return link.prepare(
            pull.local_block_ids, pull.remote_block_ids, pull.num_tokens, pull.remote_offset, pull.state_ids
        )

"""The prefill half of a connector: it lends a finished request's blocks to the decode that will read them.

It owns its lease table (`table.py`) and, on one host, the lease board decodes there read (`board.py`): a
grant holds the blocks and returns the `kv_transfer_params` to hand to the decode; the table shows every grant
and end on the board before any block goes back; an end hands the blocks back to the engine
(`on_blocks_freed`).

Inside a connector tick (under its lock, on the loop thread or a driving engine thread) it answers decodes: a
PIN, CONFIRM, RENEW or RELEASE names a lease by id and the blocks it is about; one that names blocks its lease
does not hold, another prompt, or a PIN/CONFIRM without a read token is refused (`LeaseReply.refusal` says
which) and leaves the lease as it is. A RENEW (the decode's request still waits in its queue) holds the lease
another TTL, never past `lease_max_s` from its grant. A NIXL notification (sent by the decode's READ when it
ends) completes the lease for its reader, but only when it names this incarnation and carries the digest of
exactly the leased blocks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from kvconnect.core.agent import NixlAgent
from kvconnect.core.board import BoardWriter
from kvconnect.core.cache import KVCache
from kvconnect.core.config import ConnectorConfig
from kvconnect.core.digest import block_sums, digest
from kvconnect.core.errors import KVConnectError
from kvconnect.core.plan.groups import GroupedBlocks
from kvconnect.core.plan.params import KVTransferParams, lease_params, new_lease_id, validate_block_ids
from kvconnect.core.plan.signing import params_expiry_ms, sign_params
from kvconnect.core.prefill.lease import Lease
from kvconnect.core.prefill.table import LeaseTable
from kvconnect.core.snapshot import Counters
from kvconnect.core.wire import protocol as p
from kvconnect.core.wire.logs import LogLimiter, loggable

log = logging.getLogger(__name__)
READ_OK = (p.LeaseState.HELD, p.LeaseState.COMPLETED)  # answers that let a read count: they carry the digest
REFUSAL_LOGS_PER_S = 5.0  # refused lease requests logged per second at most (a peer chooses how many)


class Lender:
    def __init__(
        self,
        cache: KVCache,
        config: ConnectorConfig,
        incarnation_id: str,
        counters: Counters,
        on_blocks_freed: Callable[[list[int]], None],
        on_lease_ended: Callable[[str, p.LeaseState], None],
        clock: Callable[[], float] = time.monotonic,
        expire_read: Callable[[], bool] | None = None,
    ) -> None:
        self._cache, self._config, self._incarnation_id, self._counters = cache, config, incarnation_id, counters
        self._keys = config.keyring
        self._on_blocks_freed, self._on_lease_ended = on_blocks_freed, on_lease_ended
        self.board = BoardWriter.create(incarnation_id) if config.lease_board else None
        self.leases = LeaseTable(
            config.lease_ttl_s,
            clock,
            self._blocks_freed,
            grace_s=config.lease_grace_s,
            expire_read=expire_read,
            max_blocks=max(1, int(config.lease_cache_share * cache.spec.num_blocks)),
            on_state=self._show,
            max_s=config.lease_max_s,
            share_min_idle_s=config.lease_share_min_idle_s,
        )
        self._agent: NixlAgent | None = None  # (its notifications: `serve`)
        self._refusal_logs = LogLimiter(REFUSAL_LOGS_PER_S)

    def serve(self, agent: NixlAgent) -> None:
        """Read notifications from `agent` (the connector's NIXL agent) from now on."""
        self._agent = agent

    # --- the engine's calls (any thread) --------------------------------------------------------------

    def lend(
        self,
        request_id: str,
        block_ids: Sequence[int],
        num_tokens: int | None,
        lease_id: str | None,
        prompt_digest: bytes,
        group_sizes: Sequence[int],
        side_channel_port: int,
    ) -> KVTransferParams:
        """Lease `block_ids` and return the params a decode reads them with (`KVConnector.lease` says the rest)."""
        spec = self._cache.spec
        ids = validate_block_ids("block_ids", block_ids, spec.num_blocks).tolist()
        lease_id = lease_id or new_lease_id()
        content = block_sums(self._cache, ids) if self._config.kv_digest else ()
        groups = GroupedBlocks.flat(ids, list(group_sizes), "group_sizes")
        self.leases.grant(
            lease_id, ids, label=request_id, content=content, prompt=prompt_digest, group_sizes=groups.sizes
        )
        params = lease_params(
            engine_id=self._config.engine_id,
            host=self._config.advertise_host,
            base_port=side_channel_port - spec.tp_rank,
            tp_size=spec.tp_size,
            incarnation_id=self._incarnation_id,
            request_id=request_id,
            lease_id=lease_id,
            block_ids=ids,
            num_tokens=num_tokens,
            group_sizes=groups.wire_sizes(),
            prompt=prompt_digest,
            wire_version=p.PROTOCOL_VERSION,
        )
        # (valid as long as renewals may hold the lease: a request may wait that long in a decode's queue)
        return sign_params(params, self._keys, params_expiry_ms(self._config.lease_max_s))

    def _show(self, lease: Lease) -> None:  # (a grant or an end, under the lease table's lock)
        if self.board is None:
            return
        if lease.state is p.LeaseState.HELD:
            self.board.held(lease.lease_id, lease.prompt, lease.block_ids, lease.groups)
        else:
            self.board.ended(lease.lease_id)

    def _blocks_freed(self, lease: Lease, block_ids: list[int]) -> None:
        try:
            if block_ids:
                self._on_blocks_freed(block_ids)
            self._on_lease_ended(lease.label, lease.state)
        except Exception:
            log.exception("lease %s: the freed-blocks callback failed for %d blocks", lease.request_id, len(block_ids))

    # --- a decode's requests and notifications (inside a tick) ----------------------------------------

    def answer(self, msg: p.LeaseRequest) -> p.LeaseReply:
        """A decode's lease request, answered with the lease's state (or a refusal and its reason)."""
        # a notification may be queued behind this request; a PIN needs
        if msg.action is not p.LeaseAction.PIN:
            # none drained first: another reader's pending end cannot free the blocks it pins
            self.drain_notifs()
        lease_id = msg.lease_id
        # ids come from a peer; a lease id is secret
        shown, peer = loggable(lease_id, 8), loggable(msg.engine_id)
        refusal, problem = p.Refusal.BLOCKS, self.leases.blocks_problem(lease_id, msg.block_ids, msg.group_sizes)
        reads = msg.action in (p.LeaseAction.PIN, p.LeaseAction.CONFIRM)
        if not problem and reads and not msg.read_token:
            refusal, problem = p.Refusal.TOKEN, "read_token: required for a pin or a confirmation"
        if not problem and msg.action is not p.LeaseAction.RELEASE:
            refusal, problem = p.Refusal.PROMPT, self.leases.prompt_problem(lease_id, msg.prompt_digest)
        if problem:  # refused as a reader: the lease left as it is
            if self._refusal_logs.allow():
                more = self._refusal_logs.suppressed()
                log.warning("lease %s: %s refused from %s: %s%s", shown, msg.action.value, peer, problem, more)
            unknown = p.LeaseState.UNKNOWN
            return p.LeaseReply(lease_id, unknown, self._incarnation_id, reason=problem, seq=msg.seq, refusal=refusal)
        pin_s = min(msg.pin_ms / 1000, self.leases.ttl_s)  # a client-sent pin lasts no longer than a lease
        if msg.action is p.LeaseAction.RENEW:
            state, held_s = self.leases.renew(lease_id)
            log.debug("lease %s: renewal from %s answered %s, held %.3g s more", shown, peer, state.value, held_s)
            if state is p.LeaseState.UNKNOWN:
                self._counters.unknown_lease_requests += 1
            return p.LeaseReply(lease_id, state, self._incarnation_id, seq=msg.seq, held_ms=round(held_s * 1000))
        if msg.action is p.LeaseAction.CONFIRM:
            state = self.leases.complete(lease_id, msg.reader, msg.readers, msg.read_token)
        elif msg.action is p.LeaseAction.PIN:
            state = self.leases.pin(lease_id, msg.reader, pin_s, msg.read_token)
        else:
            state = self.leases.release(lease_id, msg.reader, msg.block_ids, msg.read_token)
            if state is p.LeaseState.RELEASED:
                log.info("lease %s released by %s", shown, peer)
        if state is p.LeaseState.UNKNOWN:
            # not granted yet (lease_grace_s), forgotten, or made up
            self._counters.unknown_lease_requests += 1
        elif state is p.LeaseState.CONSUMED:
            log.warning("lease %s: %s from %s refused: another reader's", shown, msg.action.value, peer)
        sums = self.leases.content_of(lease_id, msg.block_ids) if state in READ_OK else None
        kv_digest = digest(sums) if sums else b""
        granted_ms = round(pin_s * 1000) if msg.action is p.LeaseAction.PIN and state is p.LeaseState.HELD else 0
        return p.LeaseReply(lease_id, state, self._incarnation_id, seq=msg.seq, kv_digest=kv_digest, pin_ms=granted_ms)

    def drain_notifs(self) -> None:
        """Complete the leases whose READs have ended, as their notifications say."""
        if self._agent is None:
            return
        for agent_name, messages in self._agent.notifs().items():
            for raw in messages:
                try:
                    notif = p.decode_notif(raw)
                except KVConnectError as e:
                    log.warning("ignoring malformed notification from %s: %s", loggable(agent_name), e)
                    continue
                if (
                    notif.incarnation_id != self._incarnation_id
                    or not notif.read_token
                    or not self.leases.digest_matches(
                        notif.lease_id, notif.num_blocks, notif.blocks_digest, notif.group_sizes
                    )
                    or self.leases.prompt_problem(notif.lease_id, notif.prompt_digest)
                ):
                    self._counters.stale_notifs += 1  # another incarnation's, or a read of blocks not leased
                    continue
                self._counters.notifs += 1
                self.leases.complete(notif.lease_id, notif.reader, notif.readers, notif.read_token)

    def close(self) -> None:
        if self.board is not None:
            self.board.close()

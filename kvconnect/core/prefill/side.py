"""Prefill side of a connector: what its handshake says, and its lease table's answers to decodes.

Inside a connector tick only (under its lock, on the loop thread or a driving engine thread). A decode's PIN,
CONFIRM or RELEASE names a lease by id and the blocks it is about; one that names blocks its lease does not hold,
or a PIN/CONFIRM without a read token, is refused and leaves the lease as it is. A NIXL notification (sent by
the decode's READ when it ends) completes the lease for its reader, but only when it names this incarnation and
carries the digest of exactly the leased blocks.
"""

from __future__ import annotations

import logging

from kvconnect.core.agent import NixlAgent
from kvconnect.core.cache import KVCache
from kvconnect.core.config import ConnectorConfig
from kvconnect.core.digest import digest
from kvconnect.core.errors import KVConnectError
from kvconnect.core.prefill.lease import LeaseTable
from kvconnect.core.snapshot import Counters
from kvconnect.core.wire import protocol as p
from kvconnect.core.wire.logs import LogLimiter, loggable

log = logging.getLogger(__name__)
READ_OK = (p.LeaseState.HELD, p.LeaseState.COMPLETED)  # answers that let a read count: they carry the digest
REFUSAL_LOGS_PER_S = 5.0  # refused lease requests logged per second at most (a peer chooses how many)


def peer_info(
    engine_id: str,
    incarnation_id: str,
    agent: NixlAgent,
    cache: KVCache,
    config: ConnectorConfig,
    offers: dict[str, bytes],
    board: str = "",
) -> p.PeerInfo:
    """The handshake answer: the agent, the cache's spec and regions, what each fast path offers
    (`transports/registry.py`), and the name of the lease board (`board.py`; "": none)."""
    return p.PeerInfo(
        protocol_version=p.PROTOCOL_VERSION,
        engine_id=engine_id,
        incarnation_id=incarnation_id,
        agent_name=agent.name,
        agent_metadata=agent.metadata(),
        spec=cache.spec,
        base_addrs=cache.base_addrs(),
        device_id=cache.device_id,
        lease_grace_ms=round(config.lease_grace_s * 1000),
        offers=dict(offers),
        lease_board=board,
    )


class PrefillSide:
    def __init__(self, leases: LeaseTable, agent: NixlAgent, counters: Counters, incarnation_id: str) -> None:
        self._leases = leases
        self._agent = agent
        self._counters = counters
        self._incarnation_id = incarnation_id
        self._refusal_logs = LogLimiter(REFUSAL_LOGS_PER_S)

    def answer(self, msg: p.LeaseRequest) -> p.LeaseReply:
        """A decode's lease request, answered with the lease's state (or a refusal and its reason)."""
        if msg.action is not p.LeaseAction.PIN:  # a notification may be queued behind this request; a PIN needs
            self.drain_notifs()  # none drained first: another reader's pending end cannot free the blocks it pins
        lease_id = msg.lease_id
        shown, peer = loggable(lease_id, 8), loggable(msg.engine_id)  # (ids come from a peer; a lease id is secret)
        problem = self._leases.blocks_problem(lease_id, msg.block_ids, msg.group_sizes)
        if not problem and msg.action is not p.LeaseAction.RELEASE and not msg.read_token:
            problem = "read_token: required for a pin or a confirmation"
        if not problem and msg.action is not p.LeaseAction.RELEASE:
            problem = self._leases.prompt_problem(lease_id, msg.prompt_digest)
        if problem:  # names blocks its lease does not hold: refused, the lease left as it is
            if self._refusal_logs.allow():
                more = self._refusal_logs.suppressed()
                log.warning("lease %s: %s refused from %s: %s%s", shown, msg.action.value, peer, problem, more)
            return p.LeaseReply(lease_id, p.LeaseState.UNKNOWN, self._incarnation_id, reason=problem, seq=msg.seq)
        pin_s = min(msg.pin_ms / 1000, self._leases.ttl_s)  # a client-sent pin lasts no longer than a lease
        if msg.action is p.LeaseAction.CONFIRM:
            state = self._leases.complete(lease_id, msg.reader, msg.readers, msg.read_token)
        elif msg.action is p.LeaseAction.PIN:
            state = self._leases.pin(lease_id, msg.reader, pin_s, msg.read_token)
        else:
            state = self._leases.release(lease_id, msg.reader, msg.block_ids, msg.read_token)
            if state is p.LeaseState.RELEASED:
                log.info("lease %s released by %s", shown, peer)
        if state is p.LeaseState.UNKNOWN:
            self._counters.unknown_lease_requests += 1  # not granted yet (lease_grace_s), forgotten, or made up
        elif state is p.LeaseState.CONSUMED:
            log.warning("lease %s: %s from %s refused: another reader's", shown, msg.action.value, peer)
        sums = self._leases.content_of(lease_id, msg.block_ids) if state in READ_OK else None
        kv_digest = digest(sums) if sums else b""
        granted_ms = round(pin_s * 1000) if msg.action is p.LeaseAction.PIN and state is p.LeaseState.HELD else 0
        return p.LeaseReply(lease_id, state, self._incarnation_id, seq=msg.seq, kv_digest=kv_digest, pin_ms=granted_ms)

    def drain_notifs(self) -> None:
        """Complete the leases whose READs have ended, as their notifications say."""
        for agent_name, messages in self._agent.notifs().items():
            for raw in messages:
                try:
                    notif = p.decode_notif(raw)
                except KVConnectError as e:
                    log.warning("ignoring malformed notification from %s: %s", agent_name, e)
                    continue
                if (
                    notif.incarnation_id != self._incarnation_id
                    or not notif.read_token
                    or not self._leases.digest_matches(
                        notif.lease_id, notif.num_blocks, notif.blocks_digest, notif.group_sizes
                    )
                    or self._leases.prompt_problem(notif.lease_id, notif.prompt_digest)
                ):
                    self._counters.stale_notifs += 1  # another incarnation's, or a read of blocks not leased
                    continue
                self._counters.notifs += 1
                self._leases.complete(notif.lease_id, notif.reader, notif.readers, notif.read_token)

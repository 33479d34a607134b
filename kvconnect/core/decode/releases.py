"""Decode side: giving a prefill's lease back, as a reader of one pull or for params nobody will read, and
keeping the lease of a request that waits in the decode's queue (a renewal, sent like a non-reader's release).

Loop thread only. A reader releases as itself on its peer's channel (that also drops its pin). Params a
decode will not read (refused, cancelled, or copies of heads nobody reads) are released on every rank of
the prefill's TP group as a non-reader, but never to a host outside the peer allow-list, never to more
ranks than the prefill's handshake said it runs, and, for a rank with no peer, over a short-lived channel
(`lease_client.ShortChannels`): params come from a client, and each rank they name is a socket.
"""

from __future__ import annotations

import logging

from kvconnect.core.allowlist import AllowList
from kvconnect.core.decode.peers import PeerSet, peer_key
from kvconnect.core.decode.pull import Pull
from kvconnect.core.plan.params import KVTransferParams
from kvconnect.core.wire import lease_client
from kvconnect.core.wire import protocol as p

log = logging.getLogger(__name__)


class Releases:
    def __init__(self, peers: PeerSet, engine_id: str, allowed: AllowList) -> None:
        self._peers = peers
        self._engine_id = engine_id
        self._allowed = allowed

    def for_pull(self, pull: Pull) -> None:
        """Release the lease this pull reads (as its reader: that also drops its pin)."""
        peer = self._peers.get(pull.peer_key)
        if peer is not None:
            for ref in [r for r, x in peer.confirming.items() if x is pull]:
                del peer.confirming[ref]
                peer.channel.forget(ref)
            reader = pull.source.reader if pull.source is not None else lease_client.NON_READER
            peer.channel.send(
                lease_client.release(
                    self._engine_id, pull.lease_id, pull.remote_block_ids, reader, pull.read_token, pull.group_sizes
                )
            )

    def for_params(self, params: KVTransferParams) -> None:
        """Release the lease on every rank of the prefill's TP group, as a non-reader (no pin is dropped)."""
        for rank, host, port in self._targets(params):
            self._send(params, rank, host, port)

    def renew(self, leases: list[tuple[KVTransferParams, bytes]]) -> None:
        """Renew each (params, prompt binding)'s lease on every rank of its prefill's TP group: their requests
        still wait to be scheduled. Over the channel of a ready peer that answers renewals; to a rank with no
        such peer, one short channel per rank for all its renewals (one rank's batch counts once at the cap)."""
        batches: dict[tuple[str, int], list[p.LeaseRequest]] = {}
        for params, binding in leases:
            if not params.remote_engine_id:
                continue
            msg = lease_client.renew(
                self._engine_id,
                params.remote_lease_id or "",
                params.remote_block_ids or [],
                binding,
                params.remote_group_sizes or (),
            )
            for rank, host, port in self._targets(params):
                peer = self._peers.get(peer_key(params.remote_engine_id, rank))
                if peer is None:
                    batches.setdefault((host, port), []).append(msg)
                elif peer.ready and peer.info is not None and peer.info.renews:
                    peer.channel.send(msg)
        for (host, port), msgs in batches.items():
            self._peers.short.send_all(host, port, msgs)

    def to_rank(self, params: KVTransferParams, rank: int) -> None:
        """Release as a non-reader on rank `rank`: on its peer's channel if there is one, else a short one."""
        targets = self._targets(params)
        if rank < len(targets):
            self._send(params, *targets[rank])

    def _send(self, params: KVTransferParams, rank: int, host: str, port: int) -> None:
        if not params.remote_engine_id:
            return
        msg = lease_client.release(
            self._engine_id,
            params.remote_lease_id or "",
            params.remote_block_ids or [],
            group_sizes=params.remote_group_sizes or (),
        )
        peer = self._peers.get(peer_key(params.remote_engine_id, rank))
        if peer is not None:
            peer.channel.send(msg)
            return
        short = self._peers.short
        if not short.send(host, port, msg) and short.dropped % 100 == 1:
            log.warning(
                "%d releases or renewals dropped so far: %d release-only channels open (those leases end by their TTL)",
                short.dropped,
                len(short),
            )

    def _targets(self, params: KVTransferParams) -> list[tuple[int, str, int]]:
        if not self._allowed.allows(params.remote_host or ""):
            return []
        return lease_client.release_targets(params, self._peers.known_tp(params.remote_engine_id or ""))

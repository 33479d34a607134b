"""Requests to a prefill worker's lease table, built in one place for every client.

The decode loop sends them over its long-lived peer channels (non-blocking); the proxy and tools send
them with `release_everywhere` (blocking, one short-lived socket per rank). Rules every client follows:

- every request names the blocks it is about (`block_ids`): the prefill refuses one that names a block
  its lease does not hold, and leaves the lease intact;
- a reader (a decode rank that pinned or will confirm) speaks as itself; anyone else releases as a
  non-reader (reader -1), which never drops a reader's pin: a pinned READ in flight keeps its blocks and
  its confirmation decides, so a release cannot turn a lost lease into a silent success;
- a release goes to every rank of the prefill's TP group (rank r listens on remote_port + r), since each
  rank leased the same block ids under the same lease id;
- every request names the lease by the prefill's lease id (`remote_lease_id`), and a reader's by its read
  token as well (`Pull.read_token`): the first token claims the reader's slot (lease.py);
- a release to a rank the decode holds no peer for goes over a short-lived channel (`ShortChannels`):
  closed once answered or after `SHORT_CHANNEL_S`, and never more than `SHORT_CHANNELS_MAX` open, so params
  naming many ranks cannot pile up sockets (a release dropped at the cap leaves the lease to its TTL).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import zmq

from kvconnect.core.errors import AuthError, InvalidRequestError, KVConnectError, LeaseLostError
from kvconnect.core.plan.hetero import Source
from kvconnect.core.plan.params import KVTransferParams
from kvconnect.core.plan.signing import Keyring
from kvconnect.core.wire import protocol as p
from kvconnect.core.wire.handshake import PeerChannel, request

NON_READER = -1
SHORT_CHANNELS_MAX = 64  # release-only channels open at once, across every prefill
SHORT_CHANNEL_S = 2.0  # a release-only channel is closed this long after its release, answered or not
_seq = itertools.count(1)  # every request's own number: a reply answers exactly the request it names


def _request(
    action: p.LeaseAction,
    engine_id: str,
    lease_id: str,
    block_ids: Sequence[int] | np.ndarray,
    group_sizes: Sequence[int],
    **fields: Any,
) -> p.LeaseRequest:
    """A lease request with its own sequence number, naming the blocks (per KV cache group where several)."""
    return p.LeaseRequest(
        p.PROTOCOL_VERSION,
        engine_id,
        lease_id,
        action,
        block_ids=block_ids.tolist() if isinstance(block_ids, np.ndarray) else [int(b) for b in block_ids],
        seq=next(_seq),
        group_sizes=[int(n) for n in group_sizes] if len(group_sizes) > 1 else [],  # (one group: none named)
        **fields,
    )


def pin(
    engine_id: str,
    lease_id: str,
    source: Source,
    block_ids: Sequence[int] | np.ndarray,
    pin_s: float,
    read_token: bytes,
    prompt_digest: bytes = b"",
    group_sizes: Sequence[int] = (),
) -> p.LeaseRequest:
    """Keep the blocks for this reader until it confirms, or for `pin_s` at most."""
    return _request(
        p.LeaseAction.PIN,
        engine_id,
        lease_id,
        block_ids,
        group_sizes,
        reader=source.reader,
        readers=source.readers,
        pin_ms=int(pin_s * 1000),
        read_token=read_token,
        prompt_digest=prompt_digest,
    )


def confirm(
    engine_id: str,
    lease_id: str,
    source: Source,
    block_ids: Sequence[int] | np.ndarray,
    read_token: bytes,
    prompt_digest: bytes = b"",
    group_sizes: Sequence[int] = (),
) -> p.LeaseRequest:
    """This reader's read is done: was the lease (or its pin) held until then?"""
    return _request(
        p.LeaseAction.CONFIRM,
        engine_id,
        lease_id,
        block_ids,
        group_sizes,
        reader=source.reader,
        readers=source.readers,
        read_token=read_token,
        prompt_digest=prompt_digest,
    )


def release(
    engine_id: str,
    lease_id: str,
    block_ids: Sequence[int] | np.ndarray,
    reader: int = NON_READER,
    read_token: bytes = b"",
    group_sizes: Sequence[int] = (),
) -> p.LeaseRequest:
    """Give the blocks back now; a reader releasing as itself (with its token) also drops its own pin."""
    return _request(
        p.LeaseAction.RELEASE, engine_id, lease_id, block_ids, group_sizes, reader=reader, read_token=read_token
    )


def renew(
    engine_id: str,
    lease_id: str,
    block_ids: Sequence[int] | np.ndarray,
    prompt_digest: bytes = b"",
    group_sizes: Sequence[int] = (),
) -> p.LeaseRequest:
    """The request that will read the lease still waits in the decode's queue: hold it another TTL (as a
    non-reader: a renewal claims no reader slot)."""
    return _request(
        p.LeaseAction.RENEW,
        engine_id,
        lease_id,
        block_ids,
        group_sizes,
        reader=NON_READER,
        prompt_digest=prompt_digest,
    )


def release_after_failure(error: KVConnectError) -> bool:
    """Whether a pull that failed with `error` should release its lease now (rather than leave it to its TTL):
    not when the lease is already gone (LeaseLostError), the peer refused us (AuthError: it would refuse the
    release too), or the params name an engine other than the one at that address."""
    if isinstance(error, (LeaseLostError, AuthError)):
        return False
    return not (isinstance(error, InvalidRequestError) and error.field.endswith("remote_engine_id"))


def release_targets(params: KVTransferParams, known_tp: int = 0) -> list[tuple[int, str, int]]:
    """(rank, host, port) of every rank of the TP group that leased `params` (empty if it names none); no
    more than `known_tp` ranks when the prefill's handshake said how many it runs (the params come from a
    client)."""
    if not (params.remote_host and params.remote_port and params.remote_lease_id and params.remote_block_ids):
        return []
    ranks = max(params.tp_size, 1) if known_tp <= 0 else min(max(params.tp_size, 1), known_tp)
    return [(rank, params.remote_host, params.remote_port + rank) for rank in range(ranks)]


class ShortChannels:
    """Release-only channels for the decode loop (loop thread only): one per release, or per batch of
    renewals to one rank, dropped when its answers arrive or `SHORT_CHANNEL_S` after it was sent,
    `SHORT_CHANNELS_MAX` at most. Their answers are not read: a peer that cannot parse a request harms none."""

    def __init__(self, ctx: zmq.Context, secret: bytes | Keyring) -> None:
        self._ctx = ctx
        self._secret = secret
        self._open: list[list[Any]] = []  # [channel, when to close it, answers still due]
        self.dropped = 0  # requests not sent because the cap was reached

    def __len__(self) -> int:
        return len(self._open)

    def send(self, host: str, port: int, msg: p.LeaseRequest) -> bool:
        """Send `msg` on a channel of its own; False (nothing sent) at the cap."""
        return self.send_all(host, port, [msg])

    def send_all(self, host: str, port: int, msgs: Sequence[p.LeaseRequest]) -> bool:
        """Send `msgs` on one channel of their own (one rank's renewals); False (nothing sent) at the cap."""
        if len(self._open) >= SHORT_CHANNELS_MAX:
            self.dropped += len(msgs)
            return False
        channel = PeerChannel(self._ctx, host, port, self._secret)
        try:
            for msg in msgs:
                channel.send(msg)
        except KVConnectError:
            channel.close()
            return False
        self._open.append([channel, time.monotonic() + SHORT_CHANNEL_S, len(msgs)])
        return True

    def poll(self, now: float) -> None:
        """Close every channel whose requests were all answered (the answers are not needed) or whose time is up."""
        keep = []
        for entry in self._open:
            entry[2] -= len(entry[0].receive())
            if entry[2] <= 0 or now >= entry[1]:
                entry[0].close()
            else:
                keep.append(entry)
        self._open = keep

    def close(self) -> None:
        for entry in self._open:
            entry[0].close()
        self._open = []


def release_everywhere(
    ctx: zmq.Context, params: KVTransferParams, engine_id: str, secret: bytes | Keyring, timeout_s: float
) -> dict[int, str]:
    """Release `params`' lease on every rank as a non-reader (blocking); returns each rank's answer: the
    lease state it ended in, or the error (a rank that is gone cannot hold anything)."""
    out: dict[int, str] = {}
    for rank, host, port in release_targets(params):
        msg = release(
            engine_id,
            params.remote_lease_id or "",
            params.remote_block_ids or [],
            group_sizes=params.remote_group_sizes or (),
        )
        try:
            reply = request(ctx, host, port, msg, timeout_s, secret)
        except KVConnectError as e:
            out[rank] = f"error: {e}"
            continue
        out[rank] = reply.state.value if isinstance(reply, p.LeaseReply) else "?"
    return out

"""The decode half's claims: params that disagree with a known peer, checked before anything is replaced.

A pull whose params name another incarnation, side-channel address or TP size than the known peer of its
engine and rank claims that the prefill restarted or moved. Params come from a client, and a forged claim must
not drop the peer and fail every pull it serves: the claim gets a handshake of its own (over its own channel,
authenticated like any other when a secret is set) and the known peer is left alone meanwhile:

- proven (the answer comes from that engine and rank, is the incarnation the params name, and runs the TP
  size they name): the known peer is replaced, as a restart or a move requires;
- refuted (another incarnation answers, another engine, no answer within the handshake deadline): only the
  pulls that made the claim fail.

One claim per engine and rank at a time (a second, different one is refused), `MAX_CLAIMS` in all.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from kvconnect.core.decode.peers import Peer, PeerSet
from kvconnect.core.decode.pull import Pull
from kvconnect.core.errors import (
    CapacityError,
    HandshakeError,
    HandshakeTimeoutError,
    KVConnectError,
    LeaseLostError,
)
from kvconnect.core.wire import protocol as p

MAX_CLAIMS = 8  # claims being checked at once, across every prefill


class Claims:
    def __init__(self, peers: PeerSet, engine_id: str) -> None:
        self._peers = peers
        self._engine_id = engine_id
        self._open: dict[str, Peer] = {}  # by peer key: the claimed peer, with its own channel
        self.refused = 0  # claims their own handshake refuted

    def __len__(self) -> int:
        return len(self._open)

    def add(self, pull: Pull) -> None:
        """Check `pull`'s claim (it waits on it); CapacityError when it cannot be checked now."""
        assert pull.source is not None
        claim = self._open.get(pull.peer_key)
        if claim is not None:
            same = (claim.host, claim.port, claim.remote_tp, claim.source) == (
                pull.remote_host,
                pull.remote_port,
                pull.remote_tp,
                pull.source,
            )
            if not same or not all(x.expected_incarnation == pull.expected_incarnation for x in claim.waiting):
                raise CapacityError(f"another claim about engine {pull.remote_engine_id} is being checked")
        else:
            if len(self._open) >= MAX_CLAIMS:
                raise CapacityError(f"{len(self._open)} claims about prefill peers are being checked already")
            claim = self._peers.open(
                pull.remote_engine_id, pull.remote_host, pull.remote_port, pull.source, pull.remote_tp
            )
            self._open[pull.peer_key] = claim
            claim.hello_sent_s = time.monotonic()
            claim.channel.send(p.Hello(p.PROTOCOL_VERSION, self._engine_id))
        claim.waiting.append(pull)

    def settled(self, now: float, timeout_s: float) -> Iterator[tuple[Peer, p.PeerInfo | KVConnectError]]:
        """The claims answered (or past the handshake deadline) since the last call, each with its answer."""
        for key, claim in list(self._open.items()):
            answer: p.PeerInfo | KVConnectError | None = None
            for ref, reply in claim.channel.receive():
                if ref == "hello" or (isinstance(reply, HandshakeError) and not ref):
                    answer = reply if isinstance(reply, (p.PeerInfo, KVConnectError)) else answer
            if answer is None and now - claim.hello_sent_s >= timeout_s:
                answer = HandshakeTimeoutError(f"no answer within {timeout_s:.3g}s")
            if answer is not None:
                del self._open[key]
                yield claim, answer

    @staticmethod
    def refutation(claim: Peer, info: p.PeerInfo) -> str:
        """Why the answer to a claim's handshake does not prove it ("" when it does)."""
        expected = sorted(x.expected_incarnation for x in claim.waiting if x.expected_incarnation is not None)
        if info.engine_id != claim.engine_id:
            return f"the side channel at {claim.host}:{claim.port} is another engine's"
        if expected and info.incarnation_id not in expected:
            return (
                f"the engine answers as incarnation {info.incarnation_id[:12]}, not {expected[0][:12]} (the lease's "
                "incarnation restarted since, or the params are forged)"
            )
        if (info.spec.tp_size, info.spec.tp_rank) != (claim.remote_tp, claim.source.rank):
            return f"the engine runs rank {info.spec.tp_rank} of {info.spec.tp_size}, not of {claim.remote_tp}"
        return ""

    def refuted(
        self, claim: Peer, answer: p.PeerInfo | KVConnectError, fail: Callable[[Pull, KVConnectError], None]
    ) -> bool:
        """Fail the pulls of a claim its answer refutes (they alone: the known peer is kept) and say so."""
        why = str(answer) if isinstance(answer, KVConnectError) else self.refutation(claim, answer)
        if not why:
            return False
        claim.channel.close()
        self.refused += 1
        for pull in claim.waiting:
            fail(
                pull,
                LeaseLostError(
                    f"pull {pull.handle.request_id}: its params disagree with engine {claim.engine_id}'s known "
                    f"peer, and the check failed: {why}; the known peer is kept"
                ),
            )
        return True

    def close(self) -> Iterator[Peer]:
        for claim in self._open.values():
            claim.channel.close()
            yield claim
        self._open.clear()

"""ZMQ side channel: the server a prefill worker answers on, and the client a decode worker asks with.

The server is a ROUTER socket driven by its owner's loop (`poll`), never a thread of its own, so the
handler may touch NIXL safely. Every message is checked before it is believed: size cap (ZMQ drops
oversized frames), msgpack schema, protocol version, and when a secret is set an HMAC with a fresh
nonce and a timestamp window (replays are refused). Bad input is answered with a named `ErrorReply` or
dropped; the server keeps serving. The client opens a short-lived DEALER socket per request, so a dead
or hung peer costs exactly its deadline and leaves nothing behind.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable

import msgspec
import zmq

from kvconnect.core.errors import AuthError, HandshakeError, HandshakeTimeoutError, ProtocolError
from kvconnect.core.plan.signing import Keyring
from kvconnect.core.wire import protocol as p
from kvconnect.core.wire.logs import LogLimiter, loggable

log = logging.getLogger(__name__)

CLOCK_SKEW_S = 120.0  # a signed message is accepted within this many seconds of the receiver's clock
# Seen nonces are kept until their timestamp leaves the window (a replay after that is refused by its age).
# The cache is bounded by count too: when it is full of nonces still inside the window, new messages are
# refused rather than old nonces forgotten, so nothing becomes replayable. 1,000,000 nonces over the 240 s
# window is a sustained ~4,000 signed messages/s per worker (each pull sends two or three).
MAX_NONCES = 1_000_000
MAX_PER_POLL = 64  # messages one poll serves: a flood must not hold the loop's tick lock (the rest wait a tick)
REFUSAL_LOGS_PER_S = 5.0  # refusal log lines per second at most (the rest are counted into the next line)


def now_ms() -> int:
    return int(time.time() * 1000)


def zmq_address(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class SideChannelServer:
    """ROUTER socket answering `Hello` and `LeaseRequest` through a handler callback."""

    def __init__(
        self,
        ctx: zmq.Context,
        host: str,
        port: int,
        handler: Callable[[p.Request], p.Reply],
        secret: bytes | Keyring = b"",
        max_nonces: int = MAX_NONCES,
    ) -> None:
        """`secret`: the keyring (or one secret) requests must be signed under; empty: none is checked."""
        self._handler = handler
        self._secret = Keyring.of(secret)
        self._max_nonces = max_nonces
        self._seen: OrderedDict[bytes, int] = OrderedDict()  # nonce -> its message's timestamp (ms)
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_REQUEST_BYTES)  # (a larger frame: its connection is dropped)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if ":" in host:
            self.sock.setsockopt(zmq.IPV6, 1)
        if port == 0:
            self.port = self.sock.bind_to_random_port(zmq_address(host, 0).rsplit(":", 1)[0])
        else:
            self.sock.bind(zmq_address(host, port))
            self.port = port
        self.num_refused = 0
        self._refusal_logs = LogLimiter(REFUSAL_LOGS_PER_S)

    def poll(self, timeout_ms: int, max_messages: int = MAX_PER_POLL) -> int:
        """Serve the messages that arrive within `timeout_ms`, at most `max_messages` of them (the caller
        polls again: the socket stays readable); returns how many were handled."""
        handled = 0
        if not self.sock.poll(timeout_ms):
            return 0
        while handled < max_messages:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return handled
            handled += 1
            if len(frames) < 2:
                continue  # not from a DEALER/REQ peer; nothing to answer
            ident, payload = frames[0], frames[-1]
            envelope = frames[1:-1]
            reply = self._answer(payload)
            try:
                self.sock.send_multipart([ident, *envelope, p.encode(reply)], zmq.NOBLOCK)
            except zmq.ZMQError as e:  # the peer left, or its queue is full: drop
                log.debug("side channel: reply dropped: %s", e)
        return handled

    def _log_refusal(self, what: str, engine_id: str, problem: str) -> None:
        """A refusal's log line, rate-limited (a peer chooses how often it is refused, and its id)."""
        if self._refusal_logs.allow():
            more = self._refusal_logs.suppressed()
            log.warning("side channel: refused %s from engine %r: %s%s", what, loggable(engine_id), problem, more)

    def _answer(self, payload: bytes) -> p.Reply:
        try:
            msg = p.decode_request(payload)
        except ProtocolError as e:
            self.num_refused += 1
            code = p.ErrorCode.VERSION if "protocol version" in str(e) else p.ErrorCode.BAD_MESSAGE
            return p.ErrorReply(code, str(e)[:500])
        reply: p.Reply
        key = p.request_key(self._secret, msg) if self._secret and msg.mac else None
        problem = self._auth_problem(msg, key) if self._secret else ""
        if problem:
            self.num_refused += 1
            self._log_refusal(type(msg).__name__, msg.engine_id, problem)
            reply = p.ErrorReply(p.ErrorCode.AUTH, problem, ref=p.ref_of(msg))
        else:
            try:
                reply = self._handler(msg)
            except Exception as e:  # a handler bug must not kill the loop
                log.exception("side channel handler failed")
                reply = p.ErrorReply(p.ErrorCode.INTERNAL, f"{type(e).__name__}: {e}"[:500], ref=p.ref_of(msg))
        # every answer to a decodable request is signed (under the key its request was signed under), refusals
        # too: a client holding the secret believes only answers from a peer that holds it
        return p.sign_reply(key or self._secret.signing, msg.nonce, reply) if self._secret else reply

    def _auth_problem(self, msg: p.Hello | p.LeaseRequest, key: bytes | None) -> str:
        if not msg.mac:
            return "authentication required"
        if len(msg.nonce) < 16:
            return "nonce too short"
        if abs(now_ms() - msg.ts_ms) > CLOCK_SKEW_S * 1000:
            return "timestamp outside the accepted window"
        if key is None:
            return "bad MAC (wrong secret?)"
        if msg.nonce in self._seen:
            return "replayed nonce"
        oldest = now_ms() - int(CLOCK_SKEW_S * 1000)
        while self._seen and next(iter(self._seen.values())) < oldest:  # (arrival order ~ timestamp order)
            self._seen.popitem(last=False)
        if len(self._seen) >= self._max_nonces:
            return f"too many signed messages within {CLOCK_SKEW_S:.0f} s ({self._max_nonces}); try again"
        self._seen[msg.nonce] = msg.ts_ms
        return ""

    def close(self) -> None:
        self.sock.close(linger=0)


def request(
    ctx: zmq.Context,
    host: str,
    port: int,
    msg: p.Hello | p.LeaseRequest,
    timeout_s: float,
    secret: bytes | Keyring = b"",
) -> p.PeerInfo | p.LeaseReply:
    """Send one request and wait for its reply; raises HandshakeError and subclasses.

    The blocking form of `PeerChannel` (CLI, proxy, tests): same signing, decoding and MAC checks.
    """
    channel = PeerChannel(ctx, host, port, secret)
    try:
        channel.send(msg)
        want = p.ref_of(msg)
        deadline = time.monotonic() + timeout_s
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0 or not channel.sock.poll(remaining_ms):
                raise HandshakeTimeoutError(f"side channel {channel.addr}: no answer within {timeout_s:.3g}s")
            for ref, reply in channel.receive():
                if ref not in (want, ""):  # "" = a reply that could not be matched: undecodable or refused
                    continue
                if isinstance(reply, HandshakeError):
                    raise reply
                return reply
    except zmq.ZMQError as e:
        raise HandshakeError(f"side channel {zmq_address(host, port)}: {e}") from e
    finally:
        channel.close()


class PeerChannel:
    """A long-lived DEALER to one peer's side channel, for the owner's non-blocking loop.

    `send` queues a request (ZMQ delivers it once connected); `receive` returns (ref, reply or error)
    for every answer that has arrived, MAC-checked against the nonce its request carried.
    """

    def __init__(self, ctx: zmq.Context, host: str, port: int, secret: bytes | Keyring = b"") -> None:
        self.addr = zmq_address(host, port)
        self._secret = Keyring.of(secret)
        self._nonces: dict[str, bytes] = {}
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_MESSAGE_BYTES)
        if ":" in host:
            self.sock.setsockopt(zmq.IPV6, 1)
        self.sock.connect(self.addr)
        self.fd: int = int(self.sock.getsockopt(zmq.FD))  # signals when an answer may have come (`poll` it only)

    def send(self, msg: p.Hello | p.LeaseRequest) -> None:
        if self._secret:
            msg = p.sign_request(self._secret, msgspec.structs.replace(msg, nonce=os.urandom(16), ts_ms=now_ms()))
        self._nonces[p.ref_of(msg)] = msg.nonce
        try:
            self.sock.send_multipart([b"", p.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            raise HandshakeError(f"side channel {self.addr}: {e}") from e

    def has_answer(self) -> bool:
        """Whether an answer waits to be received. `fd` signals only news: an answer whose arrival ZMQ already took
        in (during a send, say) waits unsignalled, so ask this before waiting on `fd`."""
        return bool(int(self.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)

    def receive(self) -> list[tuple[str, p.PeerInfo | p.LeaseReply | HandshakeError]]:
        out: list[tuple[str, p.PeerInfo | p.LeaseReply | HandshakeError]] = []
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                reply = p.decode_reply(frames[-1])
            except ProtocolError as e:
                out.append(("", HandshakeError(f"side channel {self.addr}: {e}")))
                continue
            if isinstance(reply, p.ErrorReply):
                nonce = self._nonces.pop(reply.ref, None)
                if self._secret and (nonce is None or not p.reply_mac_ok(self._secret, nonce, reply)):
                    # not from a peer holding our secret (or answering nothing we sent): trust none of it
                    out.append(
                        (
                            reply.ref if nonce is not None else "",
                            AuthError(f"side channel {self.addr} refused us with an unsigned answer (another secret?)"),
                        )
                    )
                    continue
                err = AuthError if reply.code is p.ErrorCode.AUTH else HandshakeError
                out.append((reply.ref, err(f"side channel {self.addr} refused: {reply.code.value}: {reply.message}")))
                continue
            ref = p.ref_of(reply)
            nonce = self._nonces.pop(ref, None)
            if nonce is None:
                continue  # unsolicited or duplicate: ignore
            if self._secret and not p.reply_mac_ok(self._secret, nonce, reply):
                out.append((ref, AuthError(f"side channel {self.addr}: reply not signed with our secret")))
                continue
            out.append((ref, reply))

    def forget(self, ref: str) -> None:
        self._nonces.pop(ref, None)

    def close(self) -> None:
        self.sock.close(linger=0)

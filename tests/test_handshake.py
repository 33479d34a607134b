"""ZMQ side channel: authentication, bad input, dead peers; the server keeps serving good peers."""

from __future__ import annotations

import os
import socket
import threading
import time

import msgspec
import pytest
import zmq

from kvconnect.core.errors import AuthError, HandshakeError, HandshakeTimeoutError
from kvconnect.core.plan.layout import CacheSpec, LayoutKind
from kvconnect.core.wire import protocol as p
from kvconnect.core.wire.handshake import PeerChannel, SideChannelServer, now_ms, request, zmq_address

SPEC = CacheSpec(
    kind=LayoutKind.BLOCKS_FIRST, dtype="float16", num_layers=2, num_blocks=8, block_size=16, num_kv_heads=1, head_dim=8
)
INFO = p.PeerInfo(p.PROTOCOL_VERSION, "srv", "inc-1", "agent", b"metadata", SPEC, [4096, 8192])


def handler(msg: p.Request) -> p.Reply:
    if isinstance(msg, p.Hello):
        return INFO
    return p.LeaseReply(msg.lease_id, p.LeaseState.COMPLETED, "inc-1", seq=msg.seq)


class Running:
    def __init__(self, secret: bytes = b"") -> None:
        self.ctx = zmq.Context()
        self.server = SideChannelServer(self.ctx, "127.0.0.1", 0, handler, secret)
        self.port = self.server.port
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.server.poll(5)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.server.close()
        self.ctx.term()


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.term()


@pytest.fixture(params=[b"", b"s3cret"], ids=["open", "secret"])
def server(request):
    s = Running(request.param)
    s.secret = request.param
    yield s
    s.close()


def hello() -> p.Hello:
    return p.Hello(p.PROTOCOL_VERSION, "client")


def test_good_peer_gets_info(ctx, server) -> None:
    reply = request(ctx, "127.0.0.1", server.port, hello(), 5, server.secret)
    assert isinstance(reply, p.PeerInfo) and reply.agent_metadata == b"metadata"


def test_wrong_or_missing_secret_gets_nothing(ctx) -> None:
    s = Running(b"right")
    try:
        for secret in (b"", b"wrong"):
            with pytest.raises(AuthError) as e:
                request(ctx, "127.0.0.1", s.port, hello(), 5, secret)
            assert "metadata" not in str(e.value)
        assert s.server.num_refused == 2
        assert isinstance(request(ctx, "127.0.0.1", s.port, hello(), 5, b"right"), p.PeerInfo)
    finally:
        s.close()


def test_replayed_request_is_refused(ctx) -> None:
    s = Running(b"k")
    try:
        signed = p.sign_request(
            b"k", msgspec.structs.replace(hello(), nonce=os.urandom(16), ts_ms=int(time.time() * 1000))
        )
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(zmq_address("127.0.0.1", s.port))
        answers = []
        for _ in range(2):
            sock.send_multipart([b"", p.encode(signed)])
            assert sock.poll(5000)
            answers.append(p.decode_reply(sock.recv_multipart()[-1]))
        sock.close()
        assert isinstance(answers[0], p.PeerInfo)
        assert isinstance(answers[1], p.ErrorReply) and answers[1].code is p.ErrorCode.AUTH
        assert "replayed" in answers[1].message
    finally:
        s.close()


def test_garbage_truncated_oversized_and_wrong_version(ctx, server) -> None:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(zmq_address("127.0.0.1", server.port))
    good = p.encode(hello())
    cases = [os.urandom(64), good[: len(good) // 2], p.encode(p.Hello(7, "old")), b""]
    for payload in cases:
        sock.send_multipart([b"", payload])
        assert sock.poll(5000), "server stopped answering"
        reply = p.decode_reply(sock.recv_multipart()[-1])
        assert isinstance(reply, p.ErrorReply)
        assert reply.code in (p.ErrorCode.BAD_MESSAGE, p.ErrorCode.VERSION)
    sock.send_multipart([b"", b"\x00" * (p.MAX_MESSAGE_BYTES + 10)])  # ZMQ drops the connection
    sock.close()
    raw = socket.create_connection(("127.0.0.1", server.port), timeout=5)  # not even ZMTP
    raw.sendall(os.urandom(300))
    raw.close()
    assert isinstance(request(ctx, "127.0.0.1", server.port, hello(), 5, server.secret), p.PeerInfo)


def test_a_frame_over_the_request_cap_drops_its_connection_before_any_check(ctx, server) -> None:
    """A request is KiB: a connection announcing a larger frame is dropped by ZMQ as soon as it reads the
    frame's size, before the secret is checked (the cap was the 4 MiB of a reply, so 150 unauthenticated
    connections each withholding the last byte of such a frame held 600 MiB)."""
    import zmq.utils.monitor as zmon

    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    sock.connect(zmq_address("127.0.0.1", server.port))
    events = []
    sock.send_multipart([b"", b"\x00" * (p.MAX_REQUEST_BYTES + 1)])
    deadline = time.monotonic() + 10
    while zmq.EVENT_DISCONNECTED not in events and time.monotonic() < deadline:
        if monitor.poll(100):
            events.append(zmon.recv_monitor_message(monitor)["event"])
    sock.disable_monitor()
    monitor.close()
    sock.close()
    assert zmq.EVENT_DISCONNECTED in events, events
    assert p.MAX_REQUEST_BYTES <= 256 * 1024 < p.MAX_MESSAGE_BYTES
    assert isinstance(request(ctx, "127.0.0.1", server.port, hello(), 5, server.secret), p.PeerInfo)


def test_burst_of_connections(ctx, server) -> None:
    socks = []
    for _ in range(100):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(zmq_address("127.0.0.1", server.port))
        s.send_multipart([b"", os.urandom(16)])
        socks.append(s)
    answered = sum(1 for s in socks if s.poll(5000) and s.recv_multipart())
    for s in socks:
        s.close()
    assert answered == 100
    assert isinstance(request(ctx, "127.0.0.1", server.port, hello(), 5, server.secret), p.PeerInfo)


def test_dead_address_fails_within_deadline(ctx) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nobody listens there
    t0 = time.monotonic()
    with pytest.raises(HandshakeTimeoutError, match="within 0.5s"):
        request(ctx, "127.0.0.1", port, hello(), 0.5)
    assert time.monotonic() - t0 < 3


def test_peer_channel_correlates_replies(ctx, server) -> None:
    ch = PeerChannel(ctx, "127.0.0.1", server.port, server.secret)
    ch.send(hello())
    ch.send(p.LeaseRequest(p.PROTOCOL_VERSION, "client", "r9", p.LeaseAction.CONFIRM, seq=1))
    ch.send(p.LeaseRequest(p.PROTOCOL_VERSION, "client", "r9", p.LeaseAction.CONFIRM, seq=2))  # same request id
    got: dict = {}
    deadline = time.monotonic() + 5
    while len(got) < 3 and time.monotonic() < deadline:
        ch.sock.poll(50)
        got.update(ch.receive())
    ch.close()
    assert isinstance(got["hello"], p.PeerInfo)
    for ref in ("lease:r9:1", "lease:r9:2"):  # each reply answers its own message, not merely its request id
        assert (
            isinstance(got[ref], p.LeaseReply)
            and got[ref].state is p.LeaseState.COMPLETED
            and got[ref].seq == int(ref[-1])
        )


def test_reply_signed_with_another_secret_is_rejected(ctx) -> None:
    s = Running(b"server-key")
    try:
        with pytest.raises(HandshakeError):
            request(ctx, "127.0.0.1", s.port, hello(), 5, b"client-key")
    finally:
        s.close()


def _signed_hello(secret: bytes, ts_ms: int | None = None) -> p.Hello:
    return p.sign_request(
        secret,
        msgspec.structs.replace(
            hello(),
            nonce=os.urandom(16),  # type: ignore[return-value]
            ts_ms=int(time.time() * 1000) if ts_ms is None else ts_ms,
        ),
    )


def _answer(server: SideChannelServer, msg: p.Hello | p.LeaseRequest) -> p.Reply:
    return server._answer(p.encode(msg))


def test_the_replay_cache_is_bounded_by_time_and_refuses_rather_than_forgets(ctx, monkeypatch) -> None:
    """A nonce is remembered until its message is too old to be accepted anyway; when the cache is full of
    nonces still in the window, new messages are refused: an evicted nonce would be replayable."""
    from kvconnect.core.wire import handshake

    clock = [1_000_000_000]
    monkeypatch.setattr(handshake, "now_ms", lambda: clock[0])
    server = SideChannelServer(ctx, "127.0.0.1", 0, handler, b"k", max_nonces=3)
    try:
        first = _signed_hello(b"k", clock[0])
        assert isinstance(_answer(server, first), p.PeerInfo)
        for _ in range(2):
            assert isinstance(_answer(server, _signed_hello(b"k", clock[0])), p.PeerInfo)
        full = _answer(server, _signed_hello(b"k", clock[0]))
        assert isinstance(full, p.ErrorReply) and "too many signed messages" in full.message
        again = _answer(server, first)  # the first nonce was not forgotten to make room: still refused
        assert isinstance(again, p.ErrorReply) and "replayed" in again.message
        clock[0] += int(handshake.CLOCK_SKEW_S * 1000) + 1  # those messages are now too old to replay at all
        assert isinstance(_answer(server, _signed_hello(b"k", clock[0])), p.PeerInfo)  # room again
        old = _answer(server, first)
        assert isinstance(old, p.ErrorReply) and "window" in old.message
    finally:
        server.close()


def test_refusals_are_signed_and_a_client_trusts_no_unsigned_one(ctx) -> None:
    s = Running(b"k")
    try:  # the server's own refusal (a replay) carries a MAC bound to the refused request's nonce
        msg = _signed_hello(b"k")
        assert isinstance(_answer(s.server, msg), p.PeerInfo)
        refusal = _answer(s.server, msg)
        assert isinstance(refusal, p.ErrorReply) and refusal.mac and p.reply_mac_ok(b"k", msg.nonce, refusal)
    finally:
        s.close()
    fake = ctx.socket(zmq.ROUTER)  # something on the path answering our hello with an unsigned refusal
    fake.setsockopt(zmq.LINGER, 0)
    port = fake.bind_to_random_port("tcp://127.0.0.1")
    ch = PeerChannel(ctx, "127.0.0.1", port, b"k")
    try:
        ch.send(hello())
        assert fake.poll(5000)
        ident, *rest = fake.recv_multipart()
        forged = p.ErrorReply(p.ErrorCode.VERSION, "upgrade to evil 2.0", ref="hello")
        fake.send_multipart([ident, b"", p.encode(forged)])
        deadline = time.monotonic() + 5
        got: list = []
        while not got and time.monotonic() < deadline:
            ch.sock.poll(50)
            got = ch.receive()
        assert got and isinstance(got[0][1], AuthError) and "unsigned" in str(got[0][1])
        assert "evil" not in str(got[0][1])
    finally:
        ch.close()
        fake.close()


def test_a_flood_is_served_in_bounded_batches_so_the_loop_keeps_ticking(ctx) -> None:
    """poll() drained the socket whole while the connector held its tick lock: garbage frames at a prefill
    kept its loop from expiring leases, draining notifications or driving pulls. One poll now serves at most
    MAX_PER_POLL messages; the rest wait for the next one."""
    from kvconnect.core.wire.handshake import MAX_PER_POLL

    server = SideChannelServer(ctx, "127.0.0.1", 0, handler, b"s3cret")
    flood = ctx.socket(zmq.DEALER)
    flood.setsockopt(zmq.LINGER, 0)
    flood.connect(zmq_address("127.0.0.1", server.port))
    try:
        sent = 5 * MAX_PER_POLL
        for _ in range(sent):
            flood.send_multipart([b"", b"\xc1garbage"])
        handled, polls = 0, 0
        deadline = time.monotonic() + 10
        while handled < sent and time.monotonic() < deadline:
            n = server.poll(100)
            assert n <= MAX_PER_POLL
            handled, polls = handled + n, polls + (n > 0)
        assert handled == sent and polls >= 5
    finally:
        flood.close()
        server.close()


def test_refusals_are_logged_rate_limited_and_truncated(ctx, caplog) -> None:
    """Five 4 MiB Hellos under a wrong secret wrote 20 MB of log: a peer's id is logged truncated, and
    refusals past a few per second are only counted."""
    import logging

    server = SideChannelServer(ctx, "127.0.0.1", 0, handler, b"s3cret")
    try:
        with caplog.at_level(logging.WARNING, logger="kvconnect.core.wire.handshake"):
            for _ in range(50):
                msg = p.sign_request(b"wrong", p.Hello(p.PROTOCOL_VERSION, "x" * 100_000, os.urandom(16), now_ms()))
                server._answer(p.encode(msg))
        lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert 1 <= len(lines) <= 10 and max(len(x) for x in lines) < 300
        assert server.num_refused == 50
    finally:
        server.close()

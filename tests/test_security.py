"""Side-channel security and request validation at the worker level (real processes, real NIXL), plus
fuzzing of the decoders and parsers not covered by test_protocol.py.

The cluster: a prefill worker with a shared secret, a decode worker holding it ("decode", recompute
policy, so a 400 shows a bad request is refused, not recomputed) and one without it ("decode-nosecret").
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import socket
import threading

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconnect.core.errors import AuthError, InvalidRequestError, ProtocolError
from kvconnect.core.plan.params import KVTransferParams, parse_kv_transfer_params
from kvconnect.core.plan.signing import Keyring, params_expiry_ms, sign_params
from kvconnect.core.wire import lease_client
from kvconnect.core.wire import protocol as p
from kvconnect.core.wire.handshake import request as side_request
from kvconnect.core.wire.handshake import zmq_address
from kvconnect.harness.cluster import Cluster
from kvconnect.serving import openai_api as api
from tests.faultkit import decode_leg, health, idle, metric, poll_until, prefill_leg, reference

SECRET = "kvconnect-test-secret"
PROMPT = "x" * 40  # 41 tokens with BOS: the KV of 40 tokens, 3 blocks of 16
MAX_TOKENS = 5
FAILED = "kvconnect_nixl_num_failed_transfers_total"


@pytest.fixture(scope="module")
def cluster():
    if os.environ.get("KVCONNECT_SKIP_SLOW"):  # pragma: no cover
        pytest.skip("KVCONNECT_SKIP_SLOW set")
    with Cluster(
        "cross_layer",
        "cross_layer",
        decodes=("decode", "decode-nosecret"),
        aggregated=False,
        extra_args={"decode": ["--failure-policy", "recompute"]},
        extra_env={
            "prefill": {"KVCONNECT_SECRET": SECRET},
            "decode": {"KVCONNECT_SECRET": SECRET},
            "proxy": {"KVCONNECT_SECRET": SECRET},
        },
    ) as c:
        yield c


@pytest.fixture(scope="module")
def expected(cluster: Cluster) -> list[int]:
    """PROMPT's completion computed by the decode worker itself (no transfer)."""
    return reference(cluster.urls["decode"], PROMPT, MAX_TOKENS)


def side_port(cluster: Cluster) -> int:
    return int(health(cluster.urls["prefill"])["side_channel_port"])


def test_decode_without_the_secret_gets_a_clear_502_and_no_metadata(cluster: Cluster, expected: list[int]) -> None:
    urls = cluster.urls
    refused = metric(urls["prefill"], "kvconnect_side_channel_refused_total")
    params = prefill_leg(urls["prefill"], PROMPT, "nosecret-1")
    r = decode_leg(urls["decode-nosecret"], PROMPT, params, MAX_TOKENS, "nosecret-1")
    assert r["status"] == 502, r
    assert "AuthError" in r["error"] and "authentication required" in r["error"], r
    assert metric(urls["decode-nosecret"], "kvconnect_handshakes_total") == 0  # it never learned the peer
    assert metric(urls["decode-nosecret"], "kvconnect_handshake_failures_total") >= 1
    assert metric(urls["decode-nosecret"], FAILED, reason="AuthError") == 1
    assert metric(urls["prefill"], "kvconnect_side_channel_refused_total") >= refused + 1
    poll_until(lambda: idle(urls["decode-nosecret"]), what="its blocks freed")
    # the refused reader could not touch the lease: the decode worker holding the secret still reads it
    assert health(urls["prefill"])["leased_blocks"] == len(params["remote_block_ids"])
    good = decode_leg(urls["decode"], PROMPT, params, MAX_TOKENS, "nosecret-1-good")
    assert good["status"] == 200 and good["token_ids"] == expected, good
    poll_until(lambda: idle(urls["prefill"]), what="lease completed")


def test_unauthenticated_peer_gets_no_metadata_and_cannot_release_leases(cluster: Cluster) -> None:
    ctx = zmq.Context()
    port = side_port(cluster)
    try:
        params = prefill_leg(cluster.urls["prefill"], PROMPT, "victim-1")
        for secret in (b"", b"not-the-secret"):
            with pytest.raises(AuthError):
                side_request(ctx, "127.0.0.1", port, p.Hello(p.PROTOCOL_VERSION, "intruder"), 5, secret)
            release = p.LeaseRequest(p.PROTOCOL_VERSION, "intruder", params["remote_lease_id"], p.LeaseAction.RELEASE)
            with pytest.raises(AuthError):
                side_request(ctx, "127.0.0.1", port, release, 5, secret)
        # raw, to see every byte that comes back: an ErrorReply, never a PeerInfo
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(zmq_address("127.0.0.1", port))
        sock.send_multipart([b"", p.encode(p.Hello(p.PROTOCOL_VERSION, "intruder"))])
        assert sock.poll(5000)
        raw = sock.recv_multipart()[-1]
        sock.close()
        reply = p.decode_reply(raw)
        assert isinstance(reply, p.ErrorReply) and reply.code is p.ErrorCode.AUTH
        assert b"agent" not in raw and str(port).encode() not in raw
        assert health(cluster.urls["prefill"])["leased_blocks"] == len(params["remote_block_ids"])
        info = side_request(ctx, "127.0.0.1", port, p.Hello(p.PROTOCOL_VERSION, "friend"), 5, SECRET.encode())
        assert isinstance(info, p.PeerInfo) and info.engine_id == "demo-prefill"
        nameless = p.LeaseRequest(p.PROTOCOL_VERSION, "friend", params["remote_lease_id"], p.LeaseAction.RELEASE)
        reply = side_request(ctx, "127.0.0.1", port, nameless, 5, SECRET.encode())  # names no blocks: refused
        assert isinstance(reply, p.LeaseReply) and reply.state is p.LeaseState.UNKNOWN and "block_ids" in reply.reason
        by_label = lease_client.release("friend", "victim-1", params["remote_block_ids"])  # the request's id
        reply = side_request(ctx, "127.0.0.1", port, by_label, 5, SECRET.encode())  # is no key to its lease
        assert isinstance(reply, p.LeaseReply) and reply.state is p.LeaseState.UNKNOWN
        assert health(cluster.urls["prefill"])["leased_blocks"] == len(params["remote_block_ids"])
        release = lease_client.release("friend", params["remote_lease_id"], params["remote_block_ids"])
        reply = side_request(ctx, "127.0.0.1", port, release, 5, SECRET.encode())
        assert isinstance(reply, p.LeaseReply) and reply.state is p.LeaseState.RELEASED
        assert idle(cluster.urls["prefill"])
    finally:
        ctx.term()


def _abuse(port: int, stop: threading.Event, counts: dict[str, int]) -> None:
    """Garbage of every kind at the side channel until told to stop."""
    ctx = zmq.Context()
    try:
        good = p.encode(p.Hello(p.PROTOCOL_VERSION, "fuzzer"))
        payloads = [
            good[: len(good) // 2],
            p.encode(p.Hello(7, "old")),
            b"",
            b"\xc1" * 33,
            msgspec.msgpack.encode({"type": "hello", "protocol_version": "1"}),
        ]
        while not stop.is_set():
            socks = []
            for i in range(50):  # a burst of connections, each with one bad message
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.connect(zmq_address("127.0.0.1", port))
                s.send_multipart([b"", payloads[i % len(payloads)] if i % 2 else os.urandom(64 + i)])
                socks.append(s)
            for s in socks:
                if s.poll(5000):
                    reply = p.decode_reply(s.recv_multipart()[-1])
                    counts["answered" if isinstance(reply, p.ErrorReply) else "unexpected"] += 1
                s.close()
            big = ctx.socket(zmq.DEALER)  # oversized: ZMQ drops the connection
            big.setsockopt(zmq.LINGER, 0)
            big.connect(zmq_address("127.0.0.1", port))
            big.send_multipart([b"", b"\x00" * (p.MAX_MESSAGE_BYTES + 10)])
            big.close()
            with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:  # not even ZMTP
                raw.sendall(os.urandom(512))
            counts["rounds"] += 1
    finally:
        ctx.term()


def test_side_channel_survives_abuse_while_serving_good_peers(cluster: Cluster, expected: list[int]) -> None:
    urls, port = cluster.urls, side_port(cluster)
    refused = metric(urls["prefill"], "kvconnect_side_channel_refused_total")
    stop, counts = threading.Event(), {"answered": 0, "unexpected": 0, "rounds": 0}
    abuser = threading.Thread(target=_abuse, args=(port, stop, counts), daemon=True)
    abuser.start()
    try:
        poll_until(lambda: counts["rounds"] >= 1, what="abuse under way")

        def one(i: int) -> dict:
            params = prefill_leg(urls["prefill"], PROMPT, f"abused-{i}")
            return decode_leg(urls["decode"], PROMPT, params, MAX_TOKENS, f"abused-{i}")

        with cf.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(one, range(12)))
        poll_until(lambda: counts["rounds"] >= 3, timeout_s=60, what="more abuse rounds")
    finally:
        stop.set()
        abuser.join(60)
    assert not abuser.is_alive()
    assert all(r["status"] == 200 and r["token_ids"] == expected for r in results), results
    assert counts["answered"] >= 150 and counts["unexpected"] == 0  # every bad message: a named error
    assert metric(urls["prefill"], "kvconnect_side_channel_refused_total") >= refused + counts["answered"]
    poll_until(lambda: idle(urls["prefill"]), what="nothing leased")


NEEDED = 3  # blocks PROMPT needs


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"remote_block_ids": [0, 1, 1_000_000]}, "kv_transfer_params.remote_block_ids"),  # out of range
        ({"remote_block_ids": [0, -1, 2]}, "kv_transfer_params.remote_block_ids"),
        ({"remote_block_ids": [4, 4, 5]}, "kv_transfer_params.remote_block_ids"),
        ({"remote_block_ids": [1, 2, 3, 4]}, "kv_transfer_params.remote_block_ids"),  # more than needed
        ({"remote_block_ids": [1, 2]}, "kv_transfer_params.remote_block_ids"),  # fewer: counts mismatch
        ({"remote_engine_id": "no-such-engine"}, "kv_transfer_params.remote_engine_id"),  # unknown engine
        ({"remote_port": 70000}, "kv_transfer_params.remote_port"),
        ({"remote_request_id": None}, "kv_transfer_params.remote_request_id"),
        ({"tp_size": 0}, "kv_transfer_params.tp_size"),
    ],
    ids=[
        "out_of_range",
        "negative",
        "duplicated",
        "more",
        "fewer",
        "unknown_engine",
        "port",
        "no_request_id",
        "tp_size",
    ],
)
def test_bad_transfer_params_get_400_naming_the_field_and_nothing_is_read(
    cluster: Cluster, patch: dict, field: str
) -> None:
    urls = cluster.urls
    rid = f"bad-{field}-{len(str(patch))}-{os.urandom(3).hex()}"
    params = prefill_leg(urls["prefill"], PROMPT, rid)
    assert len(params["remote_block_ids"]) == NEEDED
    watched = [
        ("decode", "kvconnect_pulls_ok_total"),
        ("decode", "kvconnect_nixl_bytes_transferred_count"),
        ("decode", "kvconnect_nixl_bytes_transferred_sum"),
        ("prefill", "kvconnect_notifs_total"),
        ("prefill", "kvconnect_leases_ended"),
    ]

    def read() -> list[float]:
        return [metric(urls[w], n, **({"outcome": "completed"} if "leases" in n else {})) for w, n in watched]

    before = read()
    bad = resigned({k: v for k, v in {**params, **patch}.items() if v is not None})  # (as if the prefill sent them)
    r = decode_leg(urls["decode"], PROMPT, bad, MAX_TOKENS, rid)
    assert r["status"] == 400, r  # refused, not recomputed, although this decode worker recomputes failures
    assert r["param"] == field, r
    assert health(urls["prefill"])["engine_id"] not in r["error"], r  # (a wrong engine id never learns the real one)
    assert read() == before  # nothing was read, no lease completed
    poll_until(lambda: idle(urls["decode"]), what="decode blocks freed")
    ctx = zmq.Context()  # clean up a lease the request did not name well enough for the decode to release
    try:
        msg = lease_client.release("test", params["remote_lease_id"], params["remote_block_ids"])
        reply = side_request(ctx, "127.0.0.1", side_port(cluster), msg, 5, SECRET.encode())
        assert isinstance(reply, p.LeaseReply) and reply.state is p.LeaseState.RELEASED
    finally:
        ctx.term()
    poll_until(lambda: idle(urls["prefill"]), what="lease gone")


def resigned(params: dict) -> dict:
    """`params` signed again under the cluster's secret: what a decode checks after the signature."""
    fields = {k: v for k, v in params.items() if k not in ("remote_mac", "remote_key_id", "remote_expires_ms")}
    raw = msgspec.convert(fields, KVTransferParams)
    signed = sign_params(raw, Keyring.parse(SECRET), params_expiry_ms(60))
    return msgspec.to_builtins(signed)


ALTERATIONS = {  # each changes one signed field of the params the prefill gave (or drops the signature)
    "blocks": lambda p: {**p, "remote_block_ids": [b + 1 for b in p["remote_block_ids"]]},
    "host": lambda p: {**p, "remote_host": "localhost" if p["remote_host"] != "localhost" else "127.0.0.1"},
    "unsigned": lambda p: {k: v for k, v in p.items() if k != "remote_mac"},
}


@pytest.mark.parametrize("alter", sorted(ALTERATIONS))
def test_params_altered_after_the_prefill_signed_them_are_refused_before_anything_is_dialled(
    cluster: Cluster, alter: str
) -> None:
    """A client (or anything between the prefill and the decode) that changes one signed field, or drops the
    signature, gets a 400 naming the signature; the decode dials nothing, reads nothing."""
    urls = cluster.urls
    params = prefill_leg(urls["prefill"], PROMPT, f"altered-{os.urandom(3).hex()}")
    handshakes = metric(urls["decode"], "kvconnect_handshakes_total")
    before = metric(urls["decode"], "kvconnect_pulls_ok_total")
    bad = ALTERATIONS[alter](params)
    assert bad != params  # (a fixed edit, e.g. ids [0, 1, 2], equalled a fresh prefill's own blocks at times)
    r = decode_leg(urls["decode"], PROMPT, bad, MAX_TOKENS, "altered")
    assert r["status"] == 400 and r["param"] == "kv_transfer_params.remote_mac", r
    assert metric(urls["decode"], "kvconnect_pulls_ok_total") == before
    assert metric(urls["decode"], "kvconnect_handshakes_total") == handshakes
    good = decode_leg(urls["decode"], PROMPT, params, MAX_TOKENS, "altered-good")  # (the lease itself is intact)
    assert good["status"] == 200, good


def test_refused_leg_releases_the_lease_it_names(cluster: Cluster) -> None:
    """A leg refused for its own reasons (here, a prompt shorter than what the blocks hold) frees its lease at
    once, since it names the lease's blocks."""
    released = metric(cluster.urls["prefill"], "kvconnect_leases_ended", outcome="released")
    params = prefill_leg(cluster.urls["prefill"], PROMPT, "short-1")
    r = decode_leg(cluster.urls["decode"], PROMPT[:10], params, MAX_TOKENS, "short-1")
    assert r["status"] == 400 and r["param"] == "kv_transfer_params.remote_num_tokens", r
    poll_until(lambda: idle(cluster.urls["prefill"]), timeout_s=10, what="lease released at once")
    assert metric(cluster.urls["prefill"], "kvconnect_leases_ended", outcome="released") == released + 1


def test_params_edited_to_other_blocks_are_refused_like_any_lost_lease_and_the_real_leases_end_normally(
    cluster: Cluster, expected: list[int]
) -> None:
    """A client reaching the decode worker itself points its params at another request's blocks, or at a
    made-up lease: the prefill refuses both, nothing of theirs is used, no lease is ended by it, and the
    client cannot tell the two apart (this decode recomputes either; a fail-policy one answers both with
    LEASE_NOT_READABLE). Both real requests then decode as usual."""
    urls = cluster.urls
    a = prefill_leg(urls["prefill"], PROMPT, "mine-1")
    b = prefill_leg(urls["prefill"], PROMPT, "theirs-1")
    ended = {o: metric(urls["prefill"], "kvconnect_leases_ended", outcome=o) for o in ("released", "completed")}
    lost = metric(urls["decode"], FAILED, reason="LeaseLostError")
    answers = []
    # (signed again as a prefill would: what the prefill refuses on its own, behind the decode's signature check)
    for edited in ({**a, "remote_block_ids": b["remote_block_ids"]}, {**a, "remote_lease_id": "made-up"}):
        r = decode_leg(urls["decode"], PROMPT, resigned(edited), MAX_TOKENS, "mine-1")
        answers.append((r["status"], r.get("token_ids"), r.get("error")))
    assert answers == [(200, expected, None)] * 2, answers  # recomputed from the prompt, nothing read
    assert metric(urls["decode"], FAILED, reason="LeaseLostError") == lost + 2
    assert {o: metric(urls["prefill"], "kvconnect_leases_ended", outcome=o) for o in ended} == ended
    assert health(urls["prefill"])["leased_blocks"] == 2 * NEEDED
    for rid, params in (("mine-1", a), ("theirs-1", b)):
        got = decode_leg(urls["decode"], PROMPT, params, MAX_TOKENS, rid)
        assert got["status"] == 200 and got["token_ids"] == expected, got
    poll_until(lambda: idle(urls["prefill"]), what="both leases completed by their own readers")
    assert metric(urls["prefill"], "kvconnect_leases_ended", outcome="completed") == ended["completed"] + 2


def test_a_prompt_sent_with_another_prompts_params_is_never_decoded_from_that_kv(
    cluster: Cluster, expected: list[int]
) -> None:
    """A client asks the prefill for prompt P's KV, then sends the decode prompt Q (same length) with P's
    params. The lease is bound to P's token ids: the prefill refuses the read, the decode recomputes Q (this
    decode's policy), and P's lease is untouched for P's own decode leg."""
    urls = cluster.urls
    other = "y" * len(PROMPT)
    other_expected = reference(urls["decode"], other, MAX_TOKENS)
    assert other_expected != expected  # (else the test could not tell P's continuation from Q's)
    params = prefill_leg(urls["prefill"], PROMPT, "victim-1")
    lost = metric(urls["decode"], FAILED, reason="LeaseLostError")
    got = decode_leg(urls["decode"], other, params, MAX_TOKENS, "swap-1")
    assert got["status"] == 200 and got["token_ids"] == other_expected, got
    assert metric(urls["decode"], FAILED, reason="LeaseLostError") == lost + 1
    assert health(urls["prefill"])["leased_blocks"] == NEEDED  # P's lease is still held
    mine = decode_leg(urls["decode"], PROMPT, params, MAX_TOKENS, "victim-1")
    assert mine["status"] == 200 and mine["token_ids"] == expected, mine
    poll_until(lambda: idle(urls["prefill"]), what="P's lease completed by its own reader")


# --- fuzzing what test_protocol.py does not: replies, notifications, OpenAI bodies -------------------


@settings(max_examples=1000, deadline=None)
@given(st.binary(max_size=512))
def test_reply_decoder_fuzz_random_bytes(data: bytes) -> None:
    """What a malicious or broken prefill may send a decode worker."""
    try:
        reply = p.decode_reply(data)
    except ProtocolError:
        return
    assert isinstance(reply, (p.PeerInfo, p.LeaseReply, p.ErrorReply))


def _valid_replies() -> list[bytes]:
    from kvconnect.core.plan.layout import CacheSpec, LayoutKind

    spec = CacheSpec(
        kind=LayoutKind.CROSS_LAYER,
        dtype="float16",
        num_layers=2,
        num_blocks=4,
        block_size=16,
        num_kv_heads=1,
        head_dim=8,
    )
    return [
        p.encode(p.PeerInfo(p.PROTOCOL_VERSION, "e", "inc", "agent", b"meta", spec, [1, 2])),
        p.encode(p.LeaseReply("r", p.LeaseState.COMPLETED, "inc")),
        p.encode(p.ErrorReply(p.ErrorCode.AUTH, "no")),
    ]


@settings(max_examples=500, deadline=None)
@given(st.sampled_from(_valid_replies()), st.integers(0, 300), st.binary(max_size=8))
def test_reply_decoder_fuzz_truncated_and_mutated(data: bytes, cut: int, junk: bytes) -> None:
    for candidate in (data[:cut], data[:cut] + junk + data[cut:], junk + data):
        try:
            p.decode_reply(candidate)
        except ProtocolError:
            pass


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=128))
def test_notification_decoder_fuzz(data: bytes) -> None:
    try:
        notif = p.decode_notif(data)
    except ProtocolError:
        return
    assert isinstance(notif.lease_id, str) and isinstance(notif.incarnation_id, str)


_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
_json = st.recursive(
    _scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=12), c, max_size=5), max_leaves=15
)
_fields = st.sampled_from(
    [
        "prompt",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "seed",
        "n",
        "stream",
        "ignore_eos",
        "return_token_ids",
        "kv_transfer_params",
        "model",
    ]
)


@settings(max_examples=500, deadline=None)
@given(st.dictionaries(_fields, _json, max_size=6), st.booleans())
def test_openai_body_parser_fuzz_only_raises_named_errors(obj: dict, chat: bool) -> None:
    raw = msgspec.json.encode(obj)
    for candidate in (raw, raw[: len(raw) // 2], b"\xff" + raw):
        try:
            body = api.parse_body(candidate, chat)
        except InvalidRequestError as e:
            assert e.field
            continue
        assert body.limit >= 1 and body.n == 1
        try:  # a body that parses hands its kv_transfer_params to the second parser
            parse_kv_transfer_params(body.kv_transfer_params)
        except InvalidRequestError as e:
            assert e.field.startswith("kv_transfer_params")


if os.environ.get("KVCONNECT_SKIP_SLOW"):  # pragma: no cover
    pytestmark = pytest.mark.skip("KVCONNECT_SKIP_SLOW set")

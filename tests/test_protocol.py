"""Wire formats: kv_transfer_params parsing, message decoding under fuzz, MACs."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconnect.core.errors import InvalidRequestError, ProtocolError
from kvconnect.core.plan.layout import CacheSpec, LayoutKind
from kvconnect.core.plan.params import parse_kv_transfer_params
from kvconnect.core.wire import protocol as p

GOOD = {
    "do_remote_prefill": True,
    "remote_engine_id": "prefill-0",
    "remote_block_ids": [3, 4, 9],
    "remote_host": "10.0.0.5",
    "remote_port": 5600,
    "remote_request_id": "cmpl-1",
    "tp_size": 1,
    "remote_lease_id": "Zq3w8W7m0xJ2V9b1kK4d0pQe",
}


def test_vllm_params_parse_and_ignore_unknown_fields() -> None:
    params = parse_kv_transfer_params({**GOOD, "some_future_field": {"x": 1}})
    assert params is not None and params.remote_block_ids == [3, 4, 9] and params.remote_port == 5600
    assert parse_kv_transfer_params(None) is None
    assert parse_kv_transfer_params({"do_remote_decode": True}).do_remote_decode  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "missing",
    ["remote_engine_id", "remote_block_ids", "remote_host", "remote_port", "remote_request_id", "remote_lease_id"],
)
def test_missing_field_is_named(missing: str) -> None:
    body = {k: v for k, v in GOOD.items() if k != missing}
    with pytest.raises(InvalidRequestError) as e:
        parse_kv_transfer_params(body)
    assert e.value.field == f"kv_transfer_params.{missing}"


@pytest.mark.parametrize(
    ("field", "value"),
    [("remote_port", "5600"), ("remote_block_ids", [1, "2"]), ("do_remote_prefill", "yes"), ("tp_size", 1.5)],
)
def test_mistyped_field_is_named(field: str, value: object) -> None:
    with pytest.raises(InvalidRequestError) as e:
        parse_kv_transfer_params({**GOOD, field: value})
    assert e.value.field.startswith(f"kv_transfer_params.{field}")


@pytest.mark.parametrize("tp_size", [0, 65, 1100])
def test_a_tp_size_outside_the_cap_is_refused_before_anything_is_dialled(tp_size: int) -> None:
    """A decode releases a lease on every rank the params name: tp_size=1100 once opened 1,100 sockets."""
    with pytest.raises(InvalidRequestError) as e:
        parse_kv_transfer_params({**GOOD, "tp_size": tp_size})
    assert e.value.field == "kv_transfer_params.tp_size"


def test_ids_are_bounded() -> None:
    with pytest.raises(InvalidRequestError) as e:
        parse_kv_transfer_params({**GOOD, "remote_lease_id": "x" * 300})
    assert e.value.field == "kv_transfer_params.remote_lease_id"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("remote_engine_id", "prefill-0\n(kvconnect) INFO forged line"),
        ("remote_request_id", "cmpl-1\r\nx"),
        ("remote_lease_id", "Zq3w8W7m 0xJ2"),
        ("remote_incarnation_id", "\x1b[31mred"),
        ("remote_host", "10.0.0.5\n"),
        ("remote_engine_id", "préfill"),
    ],
)
def test_ids_outside_printable_ascii_are_refused_at_the_edge(field: str, value: str) -> None:
    """A newline in an id would forge a whole log line wherever the id is logged (review: log injection)."""
    with pytest.raises(InvalidRequestError, match="printable ASCII") as e:
        parse_kv_transfer_params({**GOOD, field: value})
    assert e.value.field == f"kv_transfer_params.{field}"
    assert parse_kv_transfer_params({**GOOD, "remote_request_id": "my request 7"}) is not None  # (spaces: labels)


def test_what_peers_send_reaches_a_log_line_printable_truncated_and_rate_limited() -> None:
    from kvconnect.core.wire.logs import LogLimiter, loggable

    assert loggable("e\n(kvconnect) forged") == "e?(kvconnect) forged"
    assert loggable("x" * 100) == "x" * 64 + "..." and loggable("abc", 2) == "ab..."
    now = [0.0]
    limiter = LogLimiter(per_s=3, clock=lambda: now[0])
    allowed = [limiter.allow() for _ in range(50)]
    assert allowed[:3] == [True] * 3 and not any(allowed[3:])
    assert limiter.suppressed() == " (47 more suppressed)" and limiter.suppressed() == ""
    now[0] += 1.0  # a second later: three more lines
    assert [limiter.allow() for _ in range(4)] == [True, True, True, False]


def test_port_range_and_non_object() -> None:
    with pytest.raises(InvalidRequestError, match="remote_port"):
        parse_kv_transfer_params({**GOOD, "remote_port": 70000})
    with pytest.raises(InvalidRequestError, match="must be an object"):
        parse_kv_transfer_params([1, 2])


@settings(max_examples=500, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
        lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=20), c, max_size=6),
        max_leaves=20,
    )
)
def test_params_parser_fuzz_only_raises_named_errors(obj: object) -> None:
    for candidate in (obj, {**GOOD, "remote_block_ids": obj}, {**GOOD, "remote_host": obj}):
        try:
            parse_kv_transfer_params(candidate)
        except InvalidRequestError as e:
            assert e.field.startswith("kv_transfer_params")


@settings(max_examples=1000, deadline=None)
@given(st.binary(max_size=512))
def test_request_decoder_fuzz_random_bytes(data: bytes) -> None:
    try:
        msg = p.decode_request(data)
    except ProtocolError:
        return
    assert isinstance(msg, (p.Hello, p.LeaseRequest))


def _valid_request_bytes() -> list[bytes]:
    return [
        p.encode(p.Hello(p.PROTOCOL_VERSION, "e")),
        p.encode(p.LeaseRequest(p.PROTOCOL_VERSION, "e", "r", p.LeaseAction.CONFIRM)),
    ]


@settings(max_examples=500, deadline=None)
@given(st.sampled_from(_valid_request_bytes()), st.integers(0, 200), st.binary(max_size=8))
def test_request_decoder_fuzz_truncated_and_mutated(data: bytes, cut: int, junk: bytes) -> None:
    for candidate in (data[:cut], data[:cut] + junk + data[cut:], junk + data):
        try:
            p.decode_request(candidate)
        except ProtocolError:
            pass


def test_wrong_version_and_oversize_are_protocol_errors() -> None:
    with pytest.raises(ProtocolError, match="protocol version"):
        p.decode_request(p.encode(p.Hello(99, "e")))
    with pytest.raises(ProtocolError, match="exceeds"):
        p.decode_request(b"\x00" * (p.MAX_MESSAGE_BYTES + 1))


def test_peer_info_round_trip_and_bad_spec() -> None:
    spec = CacheSpec(
        kind=LayoutKind.CROSS_LAYER,
        dtype="bfloat16",
        num_layers=2,
        num_blocks=4,
        block_size=16,
        num_kv_heads=1,
        head_dim=8,
    )
    info = p.PeerInfo(p.PROTOCOL_VERSION, "e", "inc", "agent", b"meta", spec, [1, 2])
    assert p.decode_reply(p.encode(info)) == info
    raw = msgspec.msgpack.decode(p.encode(info))
    raw["spec"]["num_layers"] = -1
    with pytest.raises(ProtocolError, match="num_layers"):
        p.decode_reply(msgspec.msgpack.encode(raw))


def test_macs_bind_secret_and_nonce() -> None:
    hello = p.Hello(p.PROTOCOL_VERSION, "e", nonce=b"n" * 16, ts_ms=1)
    signed = p.sign_request(b"secret", hello)
    assert p.request_mac_ok(b"secret", signed)
    assert not p.request_mac_ok(b"other", signed)
    assert not p.request_mac_ok(b"secret", msgspec.structs.replace(signed, engine_id="x"))
    reply = p.LeaseReply("r", p.LeaseState.COMPLETED)
    sr = p.sign_reply(b"secret", b"n" * 16, reply)
    assert p.reply_mac_ok(b"secret", b"n" * 16, sr)
    assert not p.reply_mac_ok(b"secret", b"m" * 16, sr)


def test_notification_round_trip() -> None:
    assert p.decode_notif(p.encode_notif("req", "inc")) == p.PullNotif("req", "inc")
    with pytest.raises(ProtocolError):
        p.decode_notif(b"\xff\x00")

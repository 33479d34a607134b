"""Params nobody can forge (core/plan/signing.py), and a decode that acts on nothing it cannot trust.

A prefill holding the side-channel secret signs the `kv_transfer_params` it hands out; a decode holding it refuses
unsigned, altered, foreign or expired params before it dials, claims, handshakes or pulls. Secrets rotate without a
flag day (a keyring: the first signs, any verifies; the side channel likewise). Around it, the fourth review's
findings on what crosses the decode's boundary: a prefill reached by another spelling of its address is not a
restart (finding 3), forged params cannot hold the handshake slots (finding 4), and nothing a peer sends reaches the
log raw (finding 8). Real connectors over real NIXL and ZMQ on loopback, in this process.
"""

from __future__ import annotations

import logging
import socket
import time
import uuid
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from kvconnect.core.cache import KVCache
from kvconnect.core.connector import KVConnector
from kvconnect.core.decode.peers import MAX_HANDSHAKING
from kvconnect.core.errors import AuthError, HandshakeError, InvalidRequestError, KVConnectError
from kvconnect.core.plan.layout import LayoutKind
from kvconnect.core.plan.params import KVTransferParams, lease_params
from kvconnect.core.plan.signing import Keyring, key_id, sign_params, verify_params
from kvconnect.core.wire import protocol as p
from kvconnect.core.wire.handshake import SideChannelServer
from kvconnect.core.wire.handshake import request as side_request
from tests.fake_transport import FakeTransport, Wire
from tests.faultkit import poll_until
from tests.helpers import config_for_tests, spec

KEYS = Keyring.parse("current-secret\nprevious-secret")


def granted(**over: object) -> KVTransferParams:
    raw = lease_params(
        engine_id="prefill-0",
        host="10.0.0.7",
        base_port=5600,
        tp_size=2,
        incarnation_id="a" * 32,
        request_id="req-1",
        lease_id="lease-abc",
        block_ids=[4, 5, 6],
        num_tokens=40,
        group_sizes=None,
        prompt=b"\x01" * 16,
    )
    return msgspec.structs.replace(raw, **over) if over else raw


NOW_MS = 1_800_000_000_000


def signed(params: KVTransferParams | None = None, keys: Keyring = KEYS) -> KVTransferParams:
    return sign_params(params or granted(), keys, NOW_MS + 60_000)


# --- the signature itself (pure) ------------------------------------------------------------------------------


def test_signed_params_verify_and_every_signed_field_changed_fails() -> None:
    good = signed()
    verify_params(good, KEYS, NOW_MS)
    assert good.remote_key_id == key_id(b"current-secret") and "current-secret" not in repr(KEYS)
    changes = {
        "remote_engine_id": "prefill-1",
        "remote_incarnation_id": "b" * 32,
        "remote_host": "10.0.0.8",
        "remote_port": 5601,
        "tp_size": 1,
        "remote_request_id": "req-2",
        "remote_lease_id": "lease-abd",
        "remote_block_ids": [4, 5, 7],
        "remote_group_sizes": [1, 2],
        "remote_num_tokens": 41,
        "remote_prompt_digest": "02" * 16,
        "remote_expires_ms": NOW_MS + 10**9,
        "transfer_mode": "push",
        "remote_wire_version": 99,
    }
    for name, value in changes.items():
        with pytest.raises(InvalidRequestError, match="remote_mac: does not match"):
            verify_params(msgspec.structs.replace(good, **{name: value}), KEYS, NOW_MS)
    for name in ("remote_incarnation_id", "remote_prompt_digest", "remote_num_tokens"):  # (left out: changed too)
        with pytest.raises(InvalidRequestError, match="remote_mac"):
            verify_params(msgspec.structs.replace(good, **{name: None}), KEYS, NOW_MS)


def test_unsigned_foreign_and_expired_params_are_refused_by_name_and_no_keys_check_nothing() -> None:
    with pytest.raises(InvalidRequestError, match="remote_mac: required"):
        verify_params(granted(), KEYS, NOW_MS)
    with pytest.raises(InvalidRequestError, match="remote_key_id: .* a key this decode does not hold"):
        verify_params(signed(keys=Keyring.parse("someone-else")), KEYS, NOW_MS)
    with pytest.raises(InvalidRequestError, match="remote_expires_ms: the params expired"):
        verify_params(signed(), KEYS, NOW_MS + 60_000 + 31_000)  # (30 s of clock skew allowed)
    verify_params(signed(), KEYS, NOW_MS + 60_000 + 29_000)
    verify_params(granted(), Keyring(), NOW_MS)  # (no secret: loopback use, nothing signed or checked)


def test_a_secret_rotates_without_a_flag_day() -> None:
    """Step 1: every worker holds both secrets, the old one first; step 2: the new one first; step 3: the old one
    gone. Params and side-channel messages pass between any two workers one step apart."""
    old_first, new_first, new_only = (Keyring.parse(t) for t in ("old\nnew", "new\nold", "new"))
    for signer, checker in ((old_first, new_first), (new_first, old_first), (new_first, new_only)):
        verify_params(signed(keys=signer), checker, NOW_MS)
    with pytest.raises(InvalidRequestError, match="remote_key_id"):  # (two steps apart: refused, by name)
        verify_params(signed(keys=old_first), new_only, NOW_MS)
    ctx = zmq.Context()
    server = SideChannelServer(
        ctx, "127.0.0.1", 0, lambda msg: p.ErrorReply(p.ErrorCode.INTERNAL, "seen", ref=p.ref_of(msg)), old_first
    )
    try:
        for client in (new_first, Keyring.parse("old")):
            reply = _ask(ctx, server, client)
            assert isinstance(reply, HandshakeError) and "seen" in str(reply), reply  # (answered, reply verified)
        assert isinstance(_ask(ctx, server, Keyring.parse("neither")), AuthError)
    finally:
        server.sock.close(linger=0)
        ctx.term()


def _ask(ctx: zmq.Context, server: SideChannelServer, keys: Keyring) -> object:
    import threading

    stop = threading.Event()
    serving = threading.Thread(target=lambda: [server.poll(10) for _ in iter(stop.is_set, True)], daemon=True)
    serving.start()
    try:
        return side_request(ctx, "127.0.0.1", server.port, p.Hello(p.PROTOCOL_VERSION, "d"), 5, keys)
    except KVConnectError as e:
        return e
    finally:
        stop.set()
        serving.join(5)


# --- connectors: a decode that holds the secret acts on nothing it cannot verify ----------------------------------


@pytest.fixture(scope="module")
def prefill() -> Iterator[KVConnector]:
    cache = KVCache.allocate(spec(LayoutKind.BLOCKS_FIRST))
    cache.fill_pattern(5)
    with KVConnector(cache, config_for_tests(secret="s3cret")) as conn:
        yield conn


def decoder(**config: object) -> KVConnector:
    return KVConnector(KVCache.allocate(spec(LayoutKind.BLOCKS_FIRST, 64)), config_for_tests(**config))


def rid() -> str:
    return f"sig-{uuid.uuid4().hex[:8]}"


def test_a_prefill_with_a_secret_signs_and_its_decode_reads_what_it_signed(prefill) -> None:
    params = prefill.lease(rid(), [3, 4], 32, prompt_digest=b"\x07" * 16)
    assert params.remote_mac and params.remote_key_id == key_id(b"s3cret") and params.remote_prompt_digest == "07" * 16
    assert params.remote_expires_ms is not None and params.remote_expires_ms > time.time() * 1000
    with decoder(secret="s3cret") as dec:
        dec.pull(params, [0, 1], prompt_digest=b"\x07" * 16).wait(20)
        assert dec.cache.block_bytes(1) == prefill.cache.block_bytes(4)
        tail = msgspec.structs.replace(params, remote_block_ids=[4])  # (a decode's own prefix hit: it reads less)
        with pytest.raises(InvalidRequestError, match="remote_mac"):  # (cut by hand: no longer what was signed)
            dec.pull(tail, [2], prompt_digest=b"\x07" * 16)


def test_forged_params_cannot_hold_the_handshake_slots(prefill) -> None:
    """Finding 4: params naming made-up engines at a mute address took every first-contact slot for the handshake
    deadline, and a pull from a prefill the decode had not met yet failed with CapacityError. Unsigned, they are
    refused before any socket exists."""
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(64)
    try:
        with decoder(secret="s3cret", handshake_timeout_s=30) as dec:
            for i in range(MAX_HANDSHAKING):
                forged = KVTransferParams(
                    do_remote_prefill=True,
                    remote_engine_id=f"ghost-{i}",
                    remote_block_ids=[1],
                    remote_host="127.0.0.1",
                    remote_port=mute.getsockname()[1],
                    remote_request_id=f"r{i}",
                    remote_lease_id=f"l{i}",
                )
                with pytest.raises(InvalidRequestError, match="remote_mac: required"):
                    dec.pull(forged, [i])
            dec.wait_idle()
            assert dec._decode.peers.all() == []  # (nothing dialled)
            params = prefill.lease(rid(), [7], 16)  # a prefill this decode has not met yet
            dec.pull(params, [40]).wait(20)
            assert dec.cache.block_bytes(40) == prefill.cache.block_bytes(7)
            assert dec.snapshot().pull_failures == {"InvalidRequestError": MAX_HANDSHAKING}  # (counted, by class)
    finally:
        mute.close()


def test_a_release_with_params_this_decode_cannot_verify_dials_nothing(prefill) -> None:
    params = prefill.lease(rid(), [9], 16)
    with decoder(secret="s3cret") as dec:
        dec.release_remote(msgspec.structs.replace(params, remote_host="127.0.0.2"))  # (altered: dropped)
        dec.wait_idle()
        assert len(dec._decode.peers.short) == 0 and prefill.lease_state(params.remote_lease_id).value == "held"
        dec.release_remote(params)
        poll_until(lambda: prefill.lease_state(params.remote_lease_id).value == "released", what="released")


# --- finding 3: the same prefill spelled differently is not a restart -------------------------------------------


@pytest.fixture(scope="module")
def open_prefill() -> Iterator[KVConnector]:
    cache = KVCache.allocate(spec(LayoutKind.CROSS_LAYER))
    cache.fill_pattern(9)
    with KVConnector(cache, config_for_tests(), transports=(FakeTransport,)) as conn:
        yield conn


def test_the_same_prefill_reached_by_another_name_is_not_taken_for_a_restart(open_prefill) -> None:
    """Finding 3: params naming the known peer's address in another spelling (`localhost` for 127.0.0.1) claimed a
    restart, the claim proved itself with the same incarnation, and the known peer was replaced: every other
    pull in flight from it failed. Now the claim's pulls go to the known peer and the rest run on."""
    wire = Wire()
    wire.serve(open_prefill._peer_info.agent_name, open_prefill.cache)
    cache = KVCache.allocate(spec(LayoutKind.BLOCKS_FIRST, 32))
    with KVConnector(cache, config_for_tests(), transports=(wire.path(),)) as dec:
        dec.pull(open_prefill.lease(rid(), [1], 16), [0]).wait(10)  # (the peer known, at 127.0.0.1)
        wire.hold = True
        first = dec.pull(open_prefill.lease(rid(), [2], 16), [1])
        poll_until(lambda: wire.posted and len(wire.posted) >= 2, what="the first transfer in flight")
        other = msgspec.structs.replace(open_prefill.lease(rid(), [3], 16), remote_host="localhost")
        second = dec.pull(other, [2])
        poll_until(lambda: len(wire.posted) >= 3, what="the other spelling's transfer posted to the known peer")
        wire.land()
        first.wait(10)
        second.wait(10)
        assert dec.cache.block_bytes(2) == open_prefill.cache.block_bytes(3)
        assert dec.snapshot().handshakes == 1 and len(dec._decode.peers.all()) == 1
        third = msgspec.structs.replace(open_prefill.lease(rid(), [4], 16), remote_host="localhost")
        dec.pull(third, [3]).wait(10)  # (the alias is remembered: no claim, no handshake)
        assert dec.snapshot().handshakes == 1 and len(dec._decode.claims) == 0


@pytest.mark.parametrize("host", ["[127.0.0.1]", "127.000.000.001", "2130706433"])
def test_an_ip_address_in_another_spelling_is_no_host_and_passes_no_allow_list(open_prefill, host: str) -> None:
    params = msgspec.structs.replace(open_prefill.lease(rid(), [5], 16), remote_host=host)
    with decoder(peer_allowlist="127.0.0.0/8") as dec, pytest.raises(InvalidRequestError, match="remote_host"):
        dec.pull(params, [0])
    open_prefill.release(params.remote_lease_id)


# --- finding 8: nothing a peer sends reaches the log raw -----------------------------------------------------------


def test_a_peers_refusals_and_ids_never_reach_the_log_raw(caplog) -> None:
    """A side channel named by params answers with a newline-laden refusal, or with a handshake answer whose ids
    carry control characters: every kvconnect log line stays one printable line."""
    forged_line = "bad\n2026-12-05 00:00:00 INFO kvconnect: all pulls verified OK\r\x1b[2J"
    cache = KVCache.allocate(spec(LayoutKind.BLOCKS_FIRST))
    with KVConnector(cache, config_for_tests()) as real:
        info = msgspec.structs.replace(real._peer_info, engine_id="evil", incarnation_id=forged_line)

    def answer(msg: p.Request) -> p.Reply:
        if isinstance(msg, p.Hello) and msg.engine_id.endswith("-refused"):
            return p.ErrorReply(p.ErrorCode.INTERNAL, forged_line, ref=p.ref_of(msg))
        return info

    ctx = zmq.Context()
    server = SideChannelServer(ctx, "127.0.0.1", 0, answer)
    import threading

    stop = threading.Event()
    serving = threading.Thread(target=lambda: [server.poll(10) for _ in iter(stop.is_set, True)], daemon=True)
    serving.start()
    caplog.set_level(logging.DEBUG, logger="kvconnect")
    try:
        for engine in ("refused", "answers"):
            with decoder(engine_id=f"dec-{engine}" + ("-refused" if engine == "refused" else "")) as dec:
                params = KVTransferParams(
                    do_remote_prefill=True,
                    remote_engine_id="evil",
                    remote_block_ids=[1],
                    remote_host="127.0.0.1",
                    remote_port=server.port,
                    remote_request_id="r",
                    remote_lease_id="l",
                )
                with pytest.raises(KVConnectError):
                    dec.pull(params, [0]).wait(10)
    finally:
        stop.set()
        serving.join(5)
        server.sock.close(linger=0)
        ctx.term()
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("kvconnect")]
    assert any("malformed handshake answer" in line for line in lines), lines
    raw = [line for line in lines if any(c in line for c in "\n\r\x1b")]
    assert not raw, raw


# --- the wire contract: readable in the params, checked before anything is dialled ----------------------------


def test_params_say_how_they_are_read_and_a_decode_of_another_wire_version_refuses_them_before_dialling(
    prefill,
) -> None:
    """vLLM's routers tell push from pull by `transfer_mode` (NixlPushConnector's params say "push"); kvconnect's
    params also carry the wire version, so two releases that cannot pair are refused by the decode before any
    handshake, naming both versions, instead of by the prefill's side channel after a dial."""
    params = prefill.lease(rid(), [11], 16)
    assert params.transfer_mode == "pull" and params.remote_wire_version == p.PROTOCOL_VERSION
    keys = Keyring.parse("s3cret")
    with decoder(secret="s3cret") as dec:
        expires = params.remote_expires_ms or 0
        older = sign_params(msgspec.structs.replace(params, remote_wire_version=p.PROTOCOL_VERSION - 1), keys, expires)
        with pytest.raises(
            InvalidRequestError, match=f"wire version {p.PROTOCOL_VERSION - 1}, this decode {p.PROTOCOL_VERSION}"
        ):
            dec.pull(older, [0])
        pushed = sign_params(msgspec.structs.replace(params, transfer_mode="push"), keys, expires)
        with pytest.raises(InvalidRequestError, match="transfer_mode: the prefill's params are for a 'push'"):
            dec.pull(pushed, [0])
        dec.wait_idle()
        assert dec._decode.peers.all() == []  # (nothing dialled)
    prefill.release(params.remote_lease_id)

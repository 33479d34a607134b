"""Leases that live as long as their request waits: a decode renews the lease of a request still in its queue,
the prefill holds it another TTL but never past `lease_max_s` from its grant, and a decode that stops renewing
(it died) loses the lease one TTL later. The table with an injected clock; the side channel with a real prefill
process and a real decode connector."""

from __future__ import annotations

import socket
import threading
import time
import types

import msgspec
import pytest
import zmq

from kvconnect.core.allowlist import parse_allowlist
from kvconnect.core.cache import KVCache
from kvconnect.core.config import ConnectorConfig
from kvconnect.core.connector import KVConnector
from kvconnect.core.decode.releases import Releases
from kvconnect.core.errors import ConfigError
from kvconnect.core.plan.layout import CacheSpec, LayoutKind
from kvconnect.core.plan.params import KVTransferParams
from kvconnect.core.prefill.table import LeaseTable
from kvconnect.core.wire import lease_client
from kvconnect.core.wire import protocol as p
from kvconnect.core.wire.handshake import request
from kvconnect.core.wire.protocol import LeaseState
from kvconnect.harness.prefill import PrefillProcess
from tests.helpers import config_for_tests, params_to

SPEC = CacheSpec(
    kind=LayoutKind.BLOCKS_FIRST,
    dtype="float16",
    num_layers=2,
    num_blocks=16,
    block_size=16,
    num_kv_heads=2,
    head_dim=32,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def table(ttl: float = 10.0, max_s: float = 35.0, max_blocks: int | None = None) -> tuple[LeaseTable, Clock, list[int]]:
    clock, freed = Clock(), []
    t = LeaseTable(ttl, clock, lambda lease, ids: freed.extend(ids), max_s=max_s, max_blocks=max_blocks)
    return t, clock, freed


def test_a_renewed_lease_is_held_a_ttl_from_its_last_renewal_and_then_expires() -> None:
    t, clock, freed = table(ttl=10, max_s=100)
    t.grant("a", [1, 2])
    for _ in range(5):  # renewed every 8 s: held for 40 s, four TTLs
        clock.now += 8
        assert t.renew("a") == (LeaseState.HELD, 10.0)
        assert t.expire() == []
    clock.now += 9.9  # the decode died: no renewal since
    assert t.expire() == [] and t.state("a") is LeaseState.HELD
    clock.now += 0.2
    assert [x.lease_id for x in t.expire()] == ["a"] and freed == [1, 2]
    assert t.renew("a") == (LeaseState.EXPIRED, 0.0)  # a renewal never revives an ended lease
    assert t.renewals == 5


def test_renewals_never_hold_a_lease_past_its_bound() -> None:
    t, clock, freed = table(ttl=10, max_s=35)
    t.grant("a", [3])
    held = []
    for _ in range(6):
        clock.now += 6
        held.append(t.renew("a")[1])
        t.expire()
    # granted at 100, bound at 135: the renewal at 130 holds it 5 s, not 10; it is gone by 136
    assert held == [10.0, 10.0, 10.0, 10.0, 5.0, 0.0]
    assert t.state("a") is LeaseState.EXPIRED and freed == [3]
    assert clock.now == 136.0


def test_a_renewal_claims_no_reader_slot_and_the_read_completes_as_before() -> None:
    t, clock, freed = table()
    t.grant("a", [1])
    t.renew("a")
    assert t.pin("a", 0, 5.0, b"reader-token") is LeaseState.HELD
    assert t.complete("a", 0, 1, b"reader-token") is LeaseState.COMPLETED and freed == [1]


def test_a_grant_past_the_share_expires_the_leases_least_recently_granted_or_renewed_first() -> None:
    """`lease_cache_share`: a grant past the bound ends leases nobody pinned. A lease a decode's queue keeps
    renewing is wanted; one granted long ago and never renewed is likely a prefill leg whose decode never came,
    so it goes first, even though it is younger than the renewed one."""
    t, clock, freed = table(ttl=60, max_s=600, max_blocks=4)
    t.grant("waited-for", [1, 2])
    clock.now += 1
    t.grant("abandoned", [3, 4])
    clock.now += 5
    t.renew("waited-for")
    clock.now += 1
    t.grant("new", [5, 6])
    assert t.state("abandoned") is LeaseState.EXPIRED and t.state("waited-for") is LeaseState.HELD
    clock.now += 1
    t.grant("newer", [7])  # now "waited-for" (renewed 2 s ago) is less recent than "new" (1 s ago)
    assert t.state("waited-for") is LeaseState.EXPIRED and t.state("new") is LeaseState.HELD
    assert sorted(freed) == [1, 2, 3, 4]


def test_a_renewal_after_the_ttl_ran_out_ends_the_lease_instead_of_reviving_it() -> None:
    t, clock, freed = table(ttl=10, max_s=100)
    t.grant("a", [1])
    clock.now += 10.5  # (no tick since: the table has not ended it yet)
    assert t.renew("a") == (LeaseState.EXPIRED, 0.0) and freed == [1]
    t.grant("b", [2])
    assert t.pin("b", 0, 30.0, b"tok") is LeaseState.HELD
    clock.now += 15  # past its TTL but pinned: a read is in flight, the renewal holds it on
    assert t.renew("b")[0] is LeaseState.HELD


def test_the_bound_must_cover_the_ttl_and_the_renewal_period_is_not_negative() -> None:
    with pytest.raises(ConfigError, match="lease_max_s"):
        ConnectorConfig(lease_ttl_s=60, lease_max_s=30)
    with pytest.raises(ConfigError, match="lease_renew_s"):
        ConnectorConfig(lease_renew_s=-1)
    assert ConnectorConfig(lease_renew_s=0).lease_renew_s == 0  # (off)


def renew_until(dec: KVConnector, params: KVTransferParams, done: threading.Event, period_s: float) -> None:
    """What the vLLM plug-in does while the request waits in its queue: renew every `period_s`."""
    while not done.wait(period_s):  # (pacing the renewals, not waiting for a result)
        dec.renew_remote([(params, b"")])


def test_over_the_side_channel_a_renewed_lease_outlives_its_ttl_until_the_bound() -> None:
    """A real prefill (TTL 2 s, bound 6 s) grants three leases at once; a decode renews two of them. The third
    expires at its TTL while both renewed ones are held; then one renewer stops (its decode died) and that lease
    expires a TTL later, while the other is still held; that one expires at the bound, renewals or not."""
    pre = PrefillProcess.start(SPEC, seed=5, lease_ttl_s=2.0, lease_max_s=6.0)
    done, died = threading.Event(), threading.Event()
    try:
        kept, dead = pre.lease("kept", [1, 2]), pre.lease("dead", [4])
        pre.lease("left", [3])
        with KVConnector(KVCache.allocate(SPEC), config_for_tests()) as dec:
            renewers = [
                threading.Thread(target=renew_until, args=(dec, params, stop, 0.3), daemon=True)
                for params, stop in ((kept, done), (dead, died))
            ]
            for renewer in renewers:
                renewer.start()
            assert pre.settle("left", 10) == "expired"
            assert pre.ask("state", "kept") == pre.ask("state", "dead") == "held"  # past their TTL: renewed
            died.set()
            assert pre.settle("dead", 10) == "expired"
            assert pre.ask("state", "kept") == "held"
            assert pre.settle("kept", 15) == "expired"  # at the bound, though renewals go on
            assert renewers[0].is_alive()
    finally:
        done.set()
        died.set()
        pre.stop()


def test_a_renewal_is_answered_with_how_long_the_lease_is_held_and_names_no_reader() -> None:
    pre = PrefillProcess.start(SPEC, seed=6, lease_ttl_s=30.0, lease_max_s=40.0)
    ctx = zmq.Context()
    try:
        params = pre.lease("r", [4])
        msg = lease_client.renew("decode-x", params.remote_lease_id or "", [4])
        assert msg.reader == lease_client.NON_READER and not msg.read_token
        reply = request(ctx, "127.0.0.1", pre.port, msg, 10)
        assert isinstance(reply, p.LeaseReply) and reply.state is LeaseState.HELD
        assert 29_000 <= reply.held_ms <= 30_000
        made_up = request(ctx, "127.0.0.1", pre.port, lease_client.renew("decode-x", "no-such-lease", [4]), 10)
        assert isinstance(made_up, p.LeaseReply) and made_up.state is LeaseState.UNKNOWN and made_up.held_ms == 0
        other = request(
            ctx, "127.0.0.1", pre.port, lease_client.renew("decode-x", params.remote_lease_id or "", [9]), 10
        )
        assert isinstance(other, p.LeaseReply) and other.refusal is p.Refusal.BLOCKS  # (blocks it does not hold)
    finally:
        ctx.term()
        pre.stop()


def test_params_stay_valid_as_long_as_renewals_may_hold_their_lease() -> None:
    """A signed params' expiry is the lease's bound, not its TTL: a request queued past the TTL (its lease
    renewed) is not refused as expired when its pull finally starts."""
    pre = PrefillProcess.start(SPEC, seed=7, lease_ttl_s=5.0, lease_max_s=500.0, secret="s3cret")
    try:
        params = pre.lease("r", [1])
        assert params.remote_expires_ms is not None
        left_s = params.remote_expires_ms / 1000 - time.time()
        assert 400 < left_s <= 500
    finally:
        pre.stop()


def test_a_renewed_lease_never_holds_back_the_expiry_of_the_leases_granted_after_it() -> None:
    """vLLM #58222: NixlConnector's reaper walks its leases in grant order and stops at the first one not due,
    so a heartbeated old lease strands every expired lease behind it. Here each lease is due at its own time."""
    t, clock, freed = table(ttl=10, max_s=100)
    t.grant("old", [1])
    clock.now += 1
    t.grant("young", [2])
    for _ in range(3):
        clock.now += 5
        t.renew("old")
        t.expire()
    assert t.state("young") is LeaseState.EXPIRED and t.state("old") is LeaseState.HELD and freed == [2]


def test_a_backlog_of_renewals_to_a_prefill_never_contacted_goes_in_one_channel_and_none_is_dropped() -> None:
    """A decode with many queued requests for a prefill it has no peer for yet (a fresh decode, a new prefill
    pod): a period's renewals to one rank share one short channel, instead of taking one each of the 64
    release-only channels (past which they were dropped, and their leases expired)."""
    with socket.socket() as s:  # (a port nobody listens on: the renewals wait unanswered)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with KVConnector(KVCache.allocate(SPEC), config_for_tests()) as dec:
        leases = [(params_to(port, "gone", block_ids=(1,), request_id=f"r{i}"), b"") for i in range(100)]
        dec.renew_remote(leases)
        dec.wait_idle()
        short = dec._decode.peers.short
        assert len(short) == 1 and short.dropped == 0 and dec._decode.peers.all() == []


def test_a_renewal_goes_over_a_peers_channel_only_when_its_handshake_said_it_answers_renewals() -> None:
    """A prefill from before renewals refuses RENEW as malformed, with an answer that names no request: on a
    peer's channel it would read as a failed handshake. Such a peer gets no renewal (its lease keeps its TTL)."""
    sent: list[p.LeaseRequest] = []
    channel = types.SimpleNamespace(send=sent.append)
    info = p.PeerInfo(p.PROTOCOL_VERSION, "pre", "a" * 32, "agent", b"", SPEC, [0, 0, 0, 0])
    peer = types.SimpleNamespace(ready=True, info=info, channel=channel)
    short = types.SimpleNamespace(send_all=lambda host, port, msgs: sent.extend(msgs))
    peers = types.SimpleNamespace(get=lambda key: peer, short=short, known_tp=lambda engine_id: 1)
    releases = Releases(peers, "decode", parse_allowlist(""))  # type: ignore[arg-type]
    params = params_to(5600, "pre", block_ids=(1, 2), request_id="r")
    releases.renew([(params, b"")])
    assert sent == []
    peer.info = msgspec.structs.replace(info, renews=True)
    releases.renew([(params, b"")])
    assert [m.action for m in sent] == [p.LeaseAction.RENEW] and sent[0].lease_id == params.remote_lease_id
    peer.ready = False  # (a handshake in flight: nothing but its answer on that channel)
    releases.renew([(params, b"")])
    assert len(sent) == 1

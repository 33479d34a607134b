"""Leases that live as long as their request waits: a decode renews the lease of a request still in its queue,
the prefill holds it another TTL but never past `lease_max_s` from its grant, and a decode that stops renewing
(it died) loses the lease one TTL later. The table with an injected clock; the side channel with a real prefill
process and a real decode connector."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from kvconnect.core.cache import KVCache
from kvconnect.core.config import ConnectorConfig
from kvconnect.core.connector import KVConnector
from kvconnect.core.errors import ConfigError
from kvconnect.core.plan.layout import CacheSpec, LayoutKind
from kvconnect.core.plan.params import KVTransferParams
from kvconnect.core.prefill.table import LeaseTable
from kvconnect.core.wire import lease_client
from kvconnect.core.wire import protocol as p
from kvconnect.core.wire.handshake import request
from kvconnect.core.wire.protocol import LeaseState
from kvconnect.harness.prefill import PrefillProcess
from tests.helpers import config_for_tests

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


def test_a_grant_past_the_share_expires_unrenewed_leases_before_renewed_ones() -> None:
    """`lease_cache_share`: a grant past the bound ends the oldest leases nobody pinned. A renewed lease has a
    decode waiting for it in its queue; a lease never renewed may be a prefill leg whose decode never came, so
    those go first, even when younger."""
    t, clock, freed = table(ttl=60, max_s=600, max_blocks=4)
    t.grant("waited-for", [1, 2])
    clock.now += 1
    t.grant("abandoned", [3, 4])
    t.renew("waited-for")
    t.grant("new", [5, 6])
    assert t.state("abandoned") is LeaseState.EXPIRED and t.state("waited-for") is LeaseState.HELD
    t.grant("newer", [7])  # "new" is the oldest unrenewed lease: it goes, the older renewed one stays
    assert t.state("new") is LeaseState.EXPIRED and t.state("waited-for") is LeaseState.HELD
    t.grant("big", [8, 9, 10])  # ending every unrenewed lease is not enough room: then the renewed one goes
    assert t.state("newer") is LeaseState.EXPIRED and t.state("waited-for") is LeaseState.EXPIRED
    assert t.state("big") is LeaseState.HELD and sorted(freed) == [1, 2, 3, 4, 5, 6, 7]


def test_the_bound_must_cover_the_ttl_and_the_renewal_period_is_not_negative() -> None:
    with pytest.raises(ConfigError, match="lease_max_s"):
        ConnectorConfig(lease_ttl_s=60, lease_max_s=30)
    with pytest.raises(ConfigError, match="lease_renew_s"):
        ConnectorConfig(lease_renew_s=-1)
    assert ConnectorConfig(lease_renew_s=0).lease_renew_s == 0  # (off)


def renew_until(dec: KVConnector, params: KVTransferParams, done: threading.Event, period_s: float) -> None:
    """What the vLLM plug-in does while the request waits in its queue: renew every `period_s`."""
    while not done.wait(period_s):  # (pacing the renewals, not waiting for a result)
        dec.renew_remote(params)


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

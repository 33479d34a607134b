"""The lease table's expiry looks only at leases with something due (a heap of due times), and ends, frees and
forgets exactly what a scan of every lease would. Every connector tick calls `expire`, on the engine's thread
too; ended leases stay as tombstones for a minute, so a scan walked over a thousand of them at 20 requests a
second (0.37 ms a tick on a 2-core machine at 1,200, `benchmarks/lease_tick_cost.py`)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvconnect.core.prefill.early import EarlyReleases
from kvconnect.core.prefill.holds import Holds
from kvconnect.core.prefill.lease import Lease
from kvconnect.core.prefill.table import LeaseTable
from kvconnect.core.wire.protocol import LeaseState

TTL_S, TOMB_S = 10.0, 30.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class ScanningTable(LeaseTable):
    """The reference: an `expire` that looks at every lease the table remembers."""

    def _due_ids(self, now: float) -> list[str]:
        return list(self._leases)


def make(kind: type[LeaseTable]) -> tuple[LeaseTable, Clock, list[int]]:
    clock, freed = Clock(), []
    on_free: Callable[[Lease, list[int]], None] = lambda lease, ids: freed.extend(ids)  # noqa: E731
    return kind(TTL_S, clock, on_free, tombstone_s=TOMB_S), clock, freed


def test_a_tick_looks_only_at_the_leases_with_something_due() -> None:
    t, clock, freed = make(LeaseTable)
    for i in range(500):  # a minute's tombstones: granted, read, ended
        t.grant(f"done{i}", [i])
        t.complete(f"done{i}", token=b"t")
    for i in range(100):
        t.grant(f"held{i}", [1000 + i])
    for _ in range(200):  # ticks within the TTL: nothing is due
        clock.now += TTL_S / 400
        assert t.expire() == []
    assert t.looked_at == 0  # (a scan looked at all 600 leases at each of the 200 ticks: 120,000)
    clock.now += TTL_S  # each lease is looked at once at its TTL (a read one finds nothing to do) ...
    assert len(t.expire()) == 100 and t.looked_at == 600
    clock.now += TOMB_S  # ... and once when its tombstone goes: twice in all, however many ticks ran
    t.expire()
    assert t.looked_at == 1200 and t.state("done0") is LeaseState.UNKNOWN and t.state("held0") is LeaseState.UNKNOWN
    assert sorted(freed) == [*range(500), *range(1000, 1100)]


def test_a_grant_over_the_cache_share_looks_only_at_the_held_leases(monkeypatch: pytest.MonkeyPatch) -> None:
    """Making room (the prefill package's lease rules, "Bounded") expires the oldest held leases nobody pinned,
    looking at the held ones only: never at every lease the table remembers, a minute's tombstones included, at
    each grant over the bound."""
    seen: list[int] = []
    room_for = Holds.room_for

    def counting(self, ids, leases, max_blocks, *rest):  # type: ignore[no-untyped-def]
        leases = list(leases)
        seen.append(len(leases))
        return room_for(self, ids, leases, max_blocks, *rest)

    monkeypatch.setattr(Holds, "room_for", counting)
    t = LeaseTable(TTL_S, Clock(), lambda lease, ids: None, tombstone_s=TOMB_S, max_blocks=4)
    for i in range(500):
        t.grant(f"done{i}", [i % 4])
        t.complete(f"done{i}", token=b"t")
    t.grant("a", [10, 11])
    t.grant("b", [12, 13])
    t.grant("c", [14])  # over the bound: the oldest held lease nobody pinned makes room
    assert seen[-1] == 2  # (the scan: 502)
    assert t.state("a") is LeaseState.EXPIRED and t.num_held == 2 and [x.lease_id for x in t.held()] == ["b", "c"]


def test_early_releases_are_forgotten_oldest_first_without_walking_the_rest() -> None:
    early = EarlyReleases()
    for i in range(5):
        early.remember(f"l{i}", [1, 2], until_s=10.0 + i)
    early.forget_before(12.0)  # l0 .. l2 are past their grace
    assert not early.take("l2", [1, 2], now_s=0.0) and early.take("l3", [1, 2], now_s=0.0)
    assert early.take("l4", [1, 2], now_s=0.0)


def test_let_go_hands_back_only_the_blocks_no_other_lease_holds() -> None:
    holds = Holds()
    holds.take([1, 2])
    holds.take([1])
    assert holds.let_go([1, 2]) == [2] and len(holds) == 1 and holds.let_go([1]) == [1] and len(holds) == 0


IDS = ["lease0", "lease1"]
op = st.one_of(
    st.tuples(st.just("grant"), st.sampled_from(IDS), st.lists(st.integers(0, 5), min_size=1, max_size=3, unique=True)),
    st.tuples(st.just("pin"), st.sampled_from(IDS), st.integers(0, 1), st.sampled_from([0.5, 5.0, 20.0])),
    st.tuples(st.just("unpin"), st.sampled_from(IDS), st.integers(0, 1)),
    st.tuples(st.just("complete"), st.sampled_from(IDS), st.integers(0, 1), st.integers(1, 2)),
    st.tuples(st.just("release"), st.sampled_from(IDS)),
    st.tuples(st.just("force"), st.sampled_from(IDS)),
    st.tuples(st.just("tick"), st.sampled_from([0.0, 3.0, 9.0, 25.0])),
)


def apply(t: LeaseTable, clock: Clock, step: tuple) -> object:
    kind, *args = step
    if kind == "tick":
        clock.now += args[0]
        return sorted(lease.lease_id for lease in t.expire())
    lease_id = args[0]
    token = f"token{args[1]}".encode() if len(args) > 1 else b""
    try:
        if kind == "grant":
            return t.grant(lease_id, args[1]).lease_id
        if kind == "pin":
            return t.pin(lease_id, args[1], args[2], token)
        if kind == "unpin":
            return t.unpin(lease_id, args[1], token)
        if kind == "complete":
            return t.complete(lease_id, args[1], args[2], token)
        if kind == "release":
            return t.release(lease_id)
        return t.force_expire(lease_id)
    except Exception as e:  # (a refused grant: the same refusal from both)
        return f"{type(e).__name__}: {e}"


PINNED_PAST_TTL = [("grant", "lease0", [1]), ("pin", "lease0", 0, 20.0), ("tick", 9.0), ("tick", 3.0)]


@settings(max_examples=1000, deadline=None)
@given(st.lists(op, min_size=1, max_size=40))
@example(PINNED_PAST_TTL + [("tick", 9.0)])  # the pin's deadline ends a lease whose TTL ran out under it
@example(PINNED_PAST_TTL + [("unpin", "lease0", 0), ("tick", 0.0)])  # ... and so does its unpin, at the next tick
def test_expiry_by_due_times_ends_frees_and_forgets_what_a_scan_of_every_lease_would(steps) -> None:
    heap, heap_clock, heap_freed = make(LeaseTable)
    scan, scan_clock, scan_freed = make(ScanningTable)
    for step in steps:
        assert apply(heap, heap_clock, step) == apply(scan, scan_clock, step), step
        assert sorted(heap_freed) == sorted(scan_freed), step
        assert [heap.state(x) for x in IDS] == [scan.state(x) for x in IDS], step
        assert heap.num_blocks_held == scan.num_blocks_held
        assert heap.num_held == sum(heap.state(x) is LeaseState.HELD for x in IDS) == len(heap.held())

"""Lease table with an injected clock."""

from __future__ import annotations

import pytest

from kvconnect.errors import LeaseError
from kvconnect.lease import LeaseTable
from kvconnect.protocol import LeaseState


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def table(ttl: float = 10.0):
    clock, freed = Clock(), []
    return LeaseTable(ttl, clock, freed.extend, tombstone_s=30.0), clock, freed


def test_complete_frees_once_and_is_remembered() -> None:
    t, clock, freed = table()
    t.grant("a", [1, 2, 3])
    assert t.num_blocks_held == 3 and t.num_held == 1
    assert t.complete("a") is LeaseState.COMPLETED
    assert t.complete("a") is LeaseState.COMPLETED  # idempotent: a late confirmation learns the outcome
    assert t.release("a") is LeaseState.COMPLETED
    assert freed == [1, 2, 3] and t.num_blocks_held == 0


def test_unread_lease_expires_after_ttl() -> None:
    t, clock, freed = table(ttl=10)
    t.grant("a", [5])
    clock.now += 9.9
    assert t.expire() == [] and freed == []
    clock.now += 0.2
    assert [lease.request_id for lease in t.expire()] == ["a"]
    assert freed == [5]
    assert t.complete("a") is LeaseState.EXPIRED  # a read that finishes after expiry is refused
    clock.now += 31
    t.expire()
    assert t.state("a") is LeaseState.UNKNOWN  # tombstone forgotten


def test_release_and_double_grant() -> None:
    t, clock, freed = table()
    t.grant("a", [1, 2])
    with pytest.raises(LeaseError, match="already holds"):
        t.grant("a", [7])
    with pytest.raises(LeaseError, match="already leased"):
        t.grant("b", [2, 3])
    with pytest.raises(LeaseError, match="duplicated"):
        t.grant("c", [4, 4])
    assert t.release("a") is LeaseState.RELEASED
    t.grant("b", [2, 3])  # blocks reusable after release
    assert t.release("nope") is LeaseState.UNKNOWN
    assert t.counts[LeaseState.RELEASED] == 1 and t.counts[LeaseState.HELD] == 1
    assert freed == [1, 2]


def test_ttl_must_be_positive() -> None:
    with pytest.raises(LeaseError):
        LeaseTable(0, Clock(), lambda ids: None)

"""A long-lived pair of connectors keeps no state per finished pull (kvconnect/harness/growth.py walks what
each keeps). A dict of ended pulls or a list of handles would grow with a server's age, and whatever walks it
(a tick, a sweep) would slow down with it: one GPU run saw a decode's TTFT rise from run to run on servers that
had served the runs before (`benchmarks/pull_drift.py` is the measurement; this is the rule).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvconnect.core.cache import KVCache
from kvconnect.core.connector import KVConnector
from kvconnect.core.errors import KVConnectError
from kvconnect.core.plan.layout import LayoutKind
from kvconnect.core.prefill.due import DueTimes
from kvconnect.core.prefill.lease import Lease
from kvconnect.harness.growth import grown, sizes
from kvconnect.harness.net import poll_until
from tests.helpers import config_for_tests, spec

PULLS = 240


def test_the_walk_finds_a_container_deep_inside_kvconnects_objects_and_reports_its_growth() -> None:
    due = DueTimes()
    before = sizes(due, "due")
    for i in range(10):
        due.push(Lease(lease_id=f"l{i}", block_ids=(i,), granted_s=0.0, expires_s=5.0), 60.0, 0.0)
    after = sizes(due, "due")
    assert before == {"due._heap": 0} and after == {"due._heap": 10}
    assert grown(before, after, 10) == {"due._heap": (0, 10)} and grown(before, after, 11) == {}


def test_after_hundreds_of_pulls_neither_side_keeps_more_than_it_did_after_the_first() -> None:
    """Pulls of every kind a server sees: completed ones, and every fifth a refused one (the params of a lease
    already read: LeaseLostError). Once the prefill's clock has passed every lease's TTL and tombstone (an hour
    later, by its own clock), each container either side keeps is back to within a few entries of its size
    after the warm-up pulls."""
    config = config_for_tests()
    with (
        KVConnector(KVCache.allocate(spec(LayoutKind.BLOCKS_FIRST, 64)), config) as prefill,
        KVConnector(KVCache.allocate(spec(LayoutKind.BLOCKS_FIRST, 64)), config) as decode,
    ):

        def pulls(first: int, n: int) -> int:
            refused = 0
            for i in range(first, first + n):
                ids = [(3 * i + k) % 64 for k in range(3)]
                params = prefill.lease(f"g{i}", ids, 40)
                decode.pull(params, [(5 * i + k) % 64 for k in range(3)], f"g{i}").wait(30)
                if i % 5 == 0:
                    try:
                        decode.pull(params, [(7 * i + k) % 64 for k in range(3)], f"g{i}-again").wait(30)
                    except KVConnectError:
                        refused += 1
            return refused

        pulls(0, 10)
        table = prefill._leases
        clock = table._clock
        settle(prefill, table, clock)
        before = sizes(decode, "decode") | sizes(prefill, "prefill")
        table._clock = clock
        assert pulls(10, PULLS) == PULLS // 5  # (every reuse refused)
        settle(prefill, table, clock)
        after = sizes(decode, "decode") | sizes(prefill, "prefill")
    assert grown(before, after, 8) == {}, grown(before, after, 8)


def settle(prefill: KVConnector, table: Any, clock: Callable[[], float]) -> None:
    """Once every lease has ended, move the prefill's lease clock an hour past `clock` (every TTL and tombstone
    over at once) and tick until its table has looked at every due time (deadlines, not sleeps)."""

    def after_a_tick(done: Callable[[], bool]) -> bool:
        prefill.drive()
        return done()

    # (a lease ends once its READ's confirmation is in, after the pull's own end)
    poll_until(lambda: after_a_tick(lambda: not table.num_held), what="every lease ended")
    table._clock = lambda: clock() + 3600.0  # (the minute of tombstones and every TTL over, at once)
    # (every lease's due times looked at: what is still remembered then is kept for good)
    poll_until(lambda: after_a_tick(lambda: not table._due._heap), what="every due time looked at")

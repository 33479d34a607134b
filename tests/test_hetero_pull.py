"""Heterogeneous TP over real NIXL: P prefill ranks and D decode ranks, each its own process.

Every prefill rank holds its head slice of one reference KV (scattered blocks); every decode rank pulls and
must hold exactly the reference tokens of its own heads; every prefill rank's lease ends (read, or released
when it holds a copy nobody reads) and its blocks go back.
"""

from __future__ import annotations

from contextlib import ExitStack

import msgspec
import pytest

from kvconnect.core.plan.layout import LayoutKind
from kvconnect.harness.prefill import PrefillProcess
from tests.faultkit import poll_until
from tests.helpers import config_for_tests
from tests.hetero_groups import CASES, run_group, spec


@pytest.mark.parametrize("case", list(CASES))
def test_tp_groups_pull_byte_exact_and_free_every_lease(case: str) -> None:
    run_group(case, lambda side, rank: "cpu")


def test_tp_size_that_cannot_split_the_heads_is_refused_naming_it() -> None:
    with ExitStack() as stack:
        proc = PrefillProcess.start(spec(LayoutKind.CROSS_LAYER, 1, 0, 4, 16, "NHD", 8), engine_id="dec")
        stack.callback(proc.stop)
        params = {
            "do_remote_prefill": True,
            "remote_engine_id": "p",
            "remote_block_ids": [1],
            "remote_host": "127.0.0.1",
            "remote_port": 5999,
            "remote_request_id": "x",
            "remote_lease_id": "lease-x",
            "tp_size": 3,
        }
        answer = proc.ask("pull", msgspec.json.encode(params), [0], timeout_s=30)
        assert answer[:2] == ("failed", "InvalidRequestError")
        assert (
            "kv_transfer_params.tp_size" in answer[2]
            and "tp_size 3 does not divide the model's 4 KV heads" in answer[2]
        )


def test_pull_paths_reach_the_metrics() -> None:
    from kvconnect.core.decode.handle import PullStats
    from kvconnect.serving.metrics import WorkerMetrics

    metrics = WorkerMetrics()
    metrics.on_pull_done(PullStats("r", "p", path="staging", num_sources=2, scatter_s=0.002), None)
    text = metrics.render().decode()
    assert 'kvconnect_pulls_by_path_total{path="staging",sources="2"} 1.0' in text
    assert "kvconnect_staging_scatter_seconds_count 1.0" in text


def test_pair_needing_staging_is_refused_at_handshake_when_staging_is_off() -> None:
    from kvconnect.core.cache import KVCache
    from kvconnect.core.connector import KVConnector
    from kvconnect.core.errors import LayoutMismatchError

    with ExitStack() as stack:
        pre = PrefillProcess.start(spec(LayoutKind.CROSS_LAYER, 1, 0, 4, 16, "NHD", 8))
        stack.callback(pre.stop)
        dec = KVConnector(
            KVCache.allocate(spec(LayoutKind.CROSS_LAYER, 1, 0, 4, 16, "HND", 8)),
            config_for_tests(staging_mb=0),
        )
        stack.callback(dec.close)
        params = pre.lease("r", [1, 2])
        with pytest.raises(LayoutMismatchError, match=r"NHD->HND needs the staging path .* staging is disabled"):
            dec.pull(params, [0, 1]).wait(30)
        assert pre.ask("state", "r") == "held"
        dec.release_remote(params)  # what the serving layer does after a failed pull: the blocks go back now
        poll_until(lambda: pre.ask("state", "r") == "released", what="lease released")
        assert pre.ask("freed") == [1, 2]

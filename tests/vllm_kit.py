"""The legs of a P/D request by hand against a real vLLM cluster (`VllmCluster`), shared by the vLLM test
modules: a prefill leg's params, a decode leg with them, the aggregated server's reference, a tokenizer."""

from __future__ import annotations

from typing import Any

import httpx

from kvconnect.harness.vllm_cluster import VllmCluster, generate

MAX_TOKENS = 8


def prefill_leg(cluster: VllmCluster, prompt: str | list[int]) -> dict[str, Any]:
    """The proxy's first leg by hand: the kv_transfer_params the prefill leased."""
    r = generate(cluster.urls["prefill"], prompt, 1, extra={"kv_transfer_params": {"do_remote_decode": True}})
    assert r["status"] == 200 and r["kv_transfer_params"], r
    return r["kv_transfer_params"]  # type: ignore[no-any-return]


def decode_leg(
    cluster: VllmCluster, name: str, prompt: str | list[int], params: dict[str, Any], **kw: Any
) -> dict[str, Any]:
    return generate(cluster.urls[name], prompt, MAX_TOKENS, extra={"kv_transfer_params": params}, **kw)


def reference(cluster: VllmCluster, prompt: str | list[int], chat: bool = False) -> list[int]:
    r = generate(cluster.urls["aggregated"], prompt, MAX_TOKENS, chat=chat)
    assert r["status"] == 200, r
    return r["token_ids"]  # type: ignore[no-any-return]


def tokenize(cluster: VllmCluster, text: str) -> list[int]:
    r = httpx.post(
        cluster.urls["aggregated"] + "/tokenize",
        json={"model": "tiny", "prompt": text, "add_special_tokens": False},
        timeout=30,
    )
    r.raise_for_status()
    return r.json()["tokens"]  # type: ignore[no-any-return]

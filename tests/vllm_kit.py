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


def killed_prefill_fails_or_recomputes(c: VllmCluster, prompt: str, deadline_s: float) -> None:
    """Kill the prefill with two leases outstanding: the fail-policy decode ("decode") ends the request in
    error by the pull's deadline, never hangs; the recompute-policy one ("decode-r") answers the reference
    tokens; the restarted prefill serves again through the proxy."""
    import concurrent.futures as cf

    from tests.faultkit import metric_sum

    want = reference(c, prompt)
    for name in ("decode", "decode-r"):  # both decodes hold a ready peer for this prefill
        assert decode_leg(c, name, prompt, prefill_leg(c, prompt))["token_ids"] == want
    a, b = prefill_leg(c, prompt), prefill_leg(c, prompt)
    c.kill("prefill")
    try:
        with cf.ThreadPoolExecutor(2) as pool:
            fa = pool.submit(decode_leg, c, "decode", prompt, a)
            fb = pool.submit(decode_leg, c, "decode-r", prompt, b)
            ra, rb = fa.result(), fb.result()
        assert ra["status"] == 500 and ra["token_ids"] is None, ra  # vLLM's "fail": the request ends in error
        assert ra["total_s"] < deadline_s  # (it ended by the pull's deadline or sooner, never hung)
        assert rb["status"] == 200 and rb["token_ids"] == want, rb  # vLLM's "recompute": same tokens
        failed = sum(metric_sum(c.urls[n], "vllm:kvconnect_num_failed_pulls_total") for n in ("decode", "decode-r"))
        assert failed >= 2
    finally:
        c.restart("prefill")
    assert generate(c.urls["proxy"], prompt, MAX_TOKENS)["token_ids"] == want  # the new prefill serves again

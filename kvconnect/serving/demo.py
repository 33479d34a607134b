"""`kvconnect demo`: a local prefill worker, decode worker and proxy, checked against an aggregated worker.

Starts four processes on loopback (prefill, decode, a `both` worker as the reference, the proxy), sends
prompts of varied lengths through the proxy (some streamed, all concurrently), sends the same prompts to
the reference worker, and prints each completion with its transfer stats. It exits non-zero unless every
disaggregated completion equals the aggregated one token for token, and it always shuts everything down.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import logging
import time
from typing import Any

from kvconnect.core.plan.layout import LayoutKind
from kvconnect.harness.cluster import Cluster, complete

PROMPTS = [
    "Hi",
    "The quick brown fox jumps over the lazy dog.",
    "Disaggregated serving splits prefill and decode across two workers; the KV cache moves between them.",
    "abcdefghijklmno",  # exactly 15 bytes + BOS = one 16-token block
    "Once upon a time, " * 12,
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "NIXL pulls blocks with one READ per request.",
    "Z",
]


def run_checks(cluster: Cluster, prompts: list[str], max_tokens: int, concurrency: int = 8) -> list[dict[str, Any]]:
    """Send every prompt through the proxy and to the reference; return one result row per prompt."""

    def one(i: int, prompt: str) -> dict[str, Any]:
        stream, chat = i % 3 == 1, i % 4 == 3
        disagg = complete(cluster.urls["proxy"], prompt, max_tokens, stream=stream, chat=chat)
        agg = complete(cluster.urls["aggregated"], prompt, max_tokens, chat=chat)
        return {
            "prompt": prompt,
            "stream": stream,
            "chat": chat,
            "disagg": disagg,
            "agg": agg,
            "equal": disagg["token_ids"] is not None and disagg["token_ids"] == agg["token_ids"],
        }

    with cf.ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda a: one(*a), enumerate(prompts)))


def _fmt(row: dict[str, Any]) -> str:
    t = row["disagg"].get("transfer")
    stats = "(streamed; stats in /metrics)" if row["stream"] else "(nothing to transfer)"
    if t:
        gbps = t["bytes"] / max(t["post_s"] + t["transfer_s"], 1e-9) / 1e9
        stats = (
            f"{t['bytes'] / 1024:.0f} KiB, {t['num_blocks']} blocks, {t['num_descs_merged']}/{t['num_descs']} "
            f"descs, {t['total_s'] * 1e3:.1f} ms, {gbps:.2f} GB/s"
        )
    mark = "OK " if row["equal"] else "MISMATCH"
    text = (row["disagg"].get("text") or row["disagg"].get("error") or "").replace("\n", "\\n")[:48]
    return f"[{mark}] {row['prompt'][:32]!r:36} -> {text!r:52} {stats}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--layout", choices=[k.value for k in LayoutKind], default="cross_layer", help="prefill worker layout"
    )
    p.add_argument(
        "--decode-layout",
        choices=[k.value for k in LayoutKind],
        default=None,
        help="decode and reference worker layout (default: same as --layout)",
    )
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--json", action="store_true", help="print a machine-readable summary instead")
    p.add_argument(
        "--engine",
        choices=["builtin", "vllm"],
        default="builtin",
        help="builtin: kvconnect's demo engine; vllm: vLLM servers loading kvconnect's connector",
    )
    p.add_argument(
        "--model",
        default="",
        help="--engine vllm: a local Hugging Face checkpoint directory (default: SmolLM2-135M-Instruct where "
        "`bash scripts/dev.sh model` built it, answering a question set; else a tiny random Llama generated on "
        "the spot)",
    )


def run(args: argparse.Namespace) -> int:
    if args.engine == "vllm":
        from kvconnect.serving import demo_vllm

        return demo_vllm.run(args)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    decode_layout = args.decode_layout or args.layout
    logging.getLogger("httpx").setLevel(logging.WARNING)
    t0 = time.monotonic()
    with Cluster(args.layout, decode_layout, device) as cluster:
        startup_s = time.monotonic() - t0
        rows = run_checks(cluster, PROMPTS, args.max_tokens)
        prefill, decode = cluster.health("prefill"), cluster.health("decode")
    ok = all(r["equal"] for r in rows)
    summary = {
        "disagg_equals_agg": ok,
        "num_prompts": len(rows),
        "num_equal": sum(r["equal"] for r in rows),
        "layouts": {"prefill": args.layout, "decode": decode_layout},
        "device": device,
        "startup_s": round(startup_s, 2),
        "prefill_leased_blocks_after": prefill["leased_blocks"],
        "decode_free_blocks_after": decode["free_blocks"],
        "results": rows,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(
            f"kvconnect demo: prefill({args.layout}) -> decode({decode_layout}) on {device}, "
            f"proxy {cluster.urls['proxy']}, started in {startup_s:.1f}s"
        )
        print(
            "(the demo model has seeded random weights and a 256-word output vocabulary: its words are random; "
            "what matters is that every disaggregated completion equals the aggregated one token for token)"
        )
        for row in rows:
            print(_fmt(row))
        print(
            f"disaggregated == aggregated: {ok} ({summary['num_equal']}/{len(rows)}); "
            f"prefill leased blocks after: {prefill['leased_blocks']}"
        )
    return 0 if ok else 1

"""`kvconnect demo --engine vllm`: vLLM prefill + decode servers loading kvconnect's connector, kvconnect's
proxy in front, checked token for token against an aggregated vLLM server on the same checkpoint.

The checkpoint is `--model DIR` (any local Hugging Face model directory vLLM can load), or a tiny random
Llama generated on the spot (nothing is downloaded). Servers run vLLM's CPU build on loopback, one core
each; the demo exits non-zero unless every disaggregated completion equals the aggregated one.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from kvconnect.harness.tiny_llama import TinyLlama, build, prompt_of
from kvconnect.harness.vllm_cluster import Server, VllmCluster, generate, kvconnect_config

LENGTHS = [3, 40, 150, 333, 700, 1200]


def run(args: argparse.Namespace) -> int:
    scratch = Path(tempfile.gettempdir()) / "kvconnect-demo-vllm"
    model = args.model or str(build(scratch / "ckpt-tiny", TinyLlama.named("tiny")))
    servers = [
        Server("prefill", kvconnect_config("kv_producer"), core=0),
        Server("decode", kvconnect_config("kv_consumer"), core=1),
        Server("aggregated", None, core=0),
    ]
    t0 = time.monotonic()
    with VllmCluster(model, servers, str(scratch / "logs"), proxy_for=("prefill", ["decode"])) as cluster:
        startup_s = time.monotonic() - t0

        def one(i: int) -> dict[str, Any]:
            prompt, stream, chat = prompt_of(LENGTHS[i], seed=i), i % 3 == 1, i % 4 == 3
            disagg = generate(cluster.urls["proxy"], prompt, args.max_tokens, chat=chat, stream=stream)
            agg = generate(cluster.urls["aggregated"], prompt, args.max_tokens, chat=chat)
            return {
                "prompt_chars": len(prompt),
                "stream": stream,
                "chat": chat,
                "status": disagg["status"],
                "text": disagg["text"][:48],
                "equal": disagg["token_ids"] is not None and disagg["token_ids"] == agg["token_ids"],
                "total_s": round(disagg.get("total_s") or 0, 3),
            }

        with cf.ThreadPoolExecutor(3) as pool:
            rows = list(pool.map(one, range(len(LENGTHS))))
    ok = all(r["equal"] for r in rows)
    summary = {
        "engine": "vllm",
        "model": model,
        "disagg_equals_agg": ok,
        "num_prompts": len(rows),
        "num_equal": sum(r["equal"] for r in rows),
        "startup_s": round(startup_s, 1),
        "results": rows,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(
            f"kvconnect demo (vLLM): prefill -> decode through kvconnect's proxy, model {model}, started in "
            f"{startup_s:.0f}s"
        )
        for r in rows:
            mark = "OK " if r["equal"] else "MISMATCH"
            print(
                f"[{mark}] {r['prompt_chars']:5} chars {'stream' if r['stream'] else '      '} "
                f"{'chat' if r['chat'] else '    '} -> {r['text']!r:52} {r['total_s']:.2f}s"
            )
        print(f"disaggregated == aggregated: {ok} ({summary['num_equal']}/{len(rows)})")
    return 0 if ok else 1

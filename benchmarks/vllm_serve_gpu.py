"""P/D under load, measured by vLLM's own benchmark client (`vllm bench serve`), on one GPU: kvconnect's plug-in
against vLLM's NixlConnector and NixlPushConnector, each pair behind kvconnect's proxy, and a plain vLLM server.

    python benchmarks/vllm_serve_gpu.py OUT_DIR [--rates 2,4,8,16] [--concurrency 16] [--concurrency-rate 0]
                                        [--prompts-per-rate 12]
                                        [--pairs kvconnect,nixl,push] [--input-len 2560] [--range-ratio 0.6]
                                        [--output-len 64] [--enforce-eager]

The model and pairs are `vllm_h2h_gpu.py`'s (`llama8b-kv`: Llama-3-8B's KV cache, 128 KiB per token; each NIXL
server with `UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on`). The client: vLLM's random dataset, inputs of
`input_len * (1 +- range_ratio)` tokens (1,024-4,096 by default), `--output-len` tokens out with EOS ignored,
Poisson arrivals at each rate (`prompts_per_rate * rate` requests, at least 32), after one run of a fixed number of
requests in flight (`--concurrency`, as many requests as for the highest rate; `--concurrency-rate` gives it
Poisson arrivals too, so that every target serves one request rate). Targets run one at a time (the
others idle), in a shuffled order per rate. Per target and run: p50/p99 TTFT and ITL, request throughput, failed
requests; `serve.json` and `serve.txt`, a plot per metric (`<metric>.png`), vLLM's own result files under
`runs/`. Each target's proxy is kvconnect's (`kvconnect proxy`): the prefill leg, then the decode leg with the
params, one `x-request-id` for both.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

from kvconnect.bench.gpu_pd import pair_servers
from kvconnect.harness.tiny_llama import TinyLlama, build
from kvconnect.harness.vllm_cluster import Server, VllmCluster

GPU_ARGS = ["--gpu-memory-utilization", "0.1", "--kv-cache-memory-bytes", "8G"]
# `vllm bench serve` without vLLM's CLI front (which reads vLLM's package metadata: a vLLM unpacked onto the path has
# none): the same parser and main function
BENCH_SERVE = (
    "import sys; from vllm.benchmarks.serve import add_cli_args, main; "
    "from vllm.utils.argparse_utils import FlexibleArgumentParser as P; p = P(); add_cli_args(p); "
    "main(p.parse_args(sys.argv[1:]))"
)
METRICS = ("p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "p99_itl_ms", "request_throughput")


def bench(url: str, model: Path, args: argparse.Namespace, out: Path, rate: float | None, concurrency: int) -> dict:
    """One `vllm bench serve` run against `url`; returns vLLM's result (its JSON file)."""
    n = max(32, int(args.prompts_per_rate * (max(args.rates) if concurrency or not rate else rate)))
    cmd = [sys.executable, "-c", BENCH_SERVE, "--backend", "vllm"]
    cmd += ["--base-url", url, "--endpoint", "/v1/completions", "--model", "tiny", "--tokenizer", str(model)]
    cmd += ["--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len"]
    cmd += [str(args.output_len), "--random-range-ratio", json.dumps({"input": args.range_ratio, "output": 0.0})]
    cmd += ["--num-prompts", str(n), "--ignore-eos", "--seed", str(args.seed), "--disable-tqdm"]
    cmd += ["--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--num-warmups", "2"]
    cmd += ["--request-rate", str(rate) if rate else "inf"]
    if concurrency:
        cmd += ["--max-concurrency", str(concurrency)]
    cmd += ["--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, timeout=600)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[2.0, 4.0, 8.0, 16.0])
    ap.add_argument("--concurrency", type=int, default=16, help="the fixed-concurrency run (0: none)")
    ap.add_argument(
        "--concurrency-rate",
        type=float,
        default=0.0,
        help="Poisson arrivals for the fixed-concurrency run too (0: all at once): every target then serves the "
        "same request rate, so their decodes share the one GPU with as much prefill work",
    )
    ap.add_argument("--prompts-per-rate", type=float, default=12.0)
    ap.add_argument("--pairs", default="kvconnect,nixl,push")
    ap.add_argument("--input-len", type=int, default=2560)
    ap.add_argument("--range-ratio", type=float, default=0.6)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--enforce-eager", action="store_true", help="vLLM's eager mode (default: compiled, CUDA graphs)")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--replot", action="store_true", help="only redraw the plots from OUT_DIR/serve.json")
    ap.add_argument("--gpu-args", default=" ".join(GPU_ARGS), help="the servers' memory arguments")
    args = ap.parse_args()
    if args.replot:
        plot(json.loads((args.out / "serve.json").read_text()), args.out)
        return
    gpu_args = args.gpu_args.split()
    names = args.pairs.split(",")
    runs = args.out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    model = build(args.out / "model", TinyLlama.named("llama8b-kv"))
    servers = [Server("plain", None, args=gpu_args)]
    for i, name in enumerate(names):
        servers += pair_servers(name, gpu_args, port=25600 + 10 * i)
    t0 = time.monotonic()
    results: list[dict] = []
    with VllmCluster(
        str(model),
        servers,
        str(args.out / "logs"),
        block_size=args.block_size,
        eager=args.enforce_eager,
        max_model_len=args.max_model_len,
        max_num_seqs=128,
    ) as c:
        targets = {"plain": c.urls["plain"]}
        for name in names:
            targets[name] = c.add_proxy(f"{name}-proxy", f"{name}-prefill", [f"{name}-decode"])
        c.wait_healthy([f"{name}-proxy" for name in names])
        print(
            f"{len(servers)} servers and {len(names)} proxies healthy after {time.monotonic() - t0:.0f} s", flush=True
        )
        rng = random.Random(args.seed)
        capped = args.concurrency_rate or None
        plan: list[tuple[float | None, int]] = [(capped, args.concurrency)] if args.concurrency else []
        plan += [(r, 0) for r in args.rates]
        for rate, concurrency in plan:
            order = list(targets)
            rng.shuffle(order)
            for target in order:
                label = f"concurrency{concurrency}" if concurrency else f"rate{rate:g}"
                label += f"-rate{rate:g}" if concurrency and rate else ""
                t1 = time.monotonic()
                r = bench(targets[target], model, args, runs / f"{target}-{label}.json", rate, concurrency)
                row = {
                    "target": target,
                    "run": label,
                    "rate": None if concurrency else rate,
                    "concurrency": concurrency,
                }
                row["arrival_rate"] = rate
                row.update({k: r.get(k) for k in ("completed", "failed", *METRICS)})
                results.append(row)
                print(json.dumps(row), f"({time.monotonic() - t1:.0f} s)", flush=True)
                (args.out / "serve.json").write_text(json.dumps(results, indent=1))  # (as it goes: a cut run keeps it)
    (args.out / "serve.txt").write_text("\n".join(json.dumps(r) for r in results) + "\n")
    plot(results, args.out)


def plot(results: list[dict], out: Path) -> None:
    """One figure per metric: the value against the request rate, a line per target."""
    try:
        import matplotlib
    except ImportError:
        print("no matplotlib here: draw the plots with --replot where it is", flush=True)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for metric in METRICS:
        fig, ax = plt.subplots(figsize=(6, 4))
        for target in dict.fromkeys(r["target"] for r in results):
            pts = sorted((r["rate"], r[metric]) for r in results if r["target"] == target and r["rate"])
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=target)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(metric)
        ax.set_title(f"{metric}, vllm bench serve, one H200")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / f"{metric}.png", dpi=100)
        plt.close(fig)


if __name__ == "__main__":
    main()

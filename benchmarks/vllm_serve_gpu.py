"""P/D under load, measured by vLLM's own benchmark client (`vllm bench serve`), on one GPU: kvconnect's plug-in
against vLLM's NixlConnector and NixlPushConnector, each pair behind kvconnect's proxy, and a plain vLLM server.

    python benchmarks/vllm_serve_gpu.py OUT_DIR [--runs 3] [--run-index 0] [--order-seed S]
                                        [--rates 2,4,8,16] [--concurrency 16] [--concurrency-rate 0]
                                        [--prompts-per-rate 12] [--pairs kvconnect,nixl,push] [--input-len 2560]
                                        [--range-ratio 0.6] [--output-len 64] [--client subprocess|resident]
                                        [--enforce-eager]

The model and pairs are `vllm_h2h_gpu.py`'s (`llama8b-kv`: Llama-3-8B's KV cache, 128 KiB per token; the pairs in
`kvconnect/bench/gpu_pd.py`, among them `kvconnect-nixl`: `transport: nixl`, `lease_board: false`, as pods on two
nodes run it). Every server that moves bytes with NIXL runs with `UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on` and
`UCX_PROTO_INFO=y`. The client: vLLM's random dataset, inputs of `input_len * (1 +- range_ratio)` tokens
(1,024-4,096 by default), `--output-len` tokens out with EOS ignored, Poisson arrivals at each rate
(`prompts_per_rate * rate` requests, at least 32), after one run of a fixed number of requests in flight
(`--concurrency`, as many requests as for the highest rate; `--concurrency-rate` gives it Poisson arrivals too,
so that every target serves one request rate). Targets run one at a time (the others idle).

Runs: the servers start once per invocation; `--runs N` measures the whole grid N times on them, runs numbered
from `--run-index`. Each run draws an order seed (printed; `--order-seed` sets the first run's, the next runs'
follow from it) and shuffles the target order per cell with it. A grid too long for one sitting is measured in
steps (`--runs 1 --run-index k` into the same OUT_DIR, or into several that are then copied together): every
invocation rebuilds the summary from all `run*/` folders there, and `--replot` does so alone.

Per run `OUT_DIR/run<k>/`: `rows.json` (per target and cell: p50/p99 TTFT and ITL, request throughput, failed
requests), `meta.json` (order seed, orders, each server's UCX settings), `ucx-proto.txt` (the protocol lines UCX
printed for remote memory in each server's log: the byte path a READ or WRITE took), vLLM's result files under
`runs/`, and the servers' logs under `logs/` (in the first run of an invocation; the later runs' `ucx-proto.txt`
repeat it, since UCX prints a table once per endpoint configuration). Over all runs: `serve.json` (every row),
`serve.txt` (the runs and their seeds, the UCX settings, the median and min-max across runs per target and cell,
then every row) and a plot per metric with min-max bars (`<metric>.png`). Each target's proxy is kvconnect's
(`kvconnect proxy`): the prefill leg, then the decode leg with the params, one `x-request-id` for both.

`--client resident` keeps one client process for every run (`kvconnect/bench/serve_client.py`: ~20 s less per
client run); if it fails, the rest of the invocation falls back to a process per run (the default).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvconnect.bench.gpu_pd import cell_series, moves_by_nixl, pair_servers
from kvconnect.bench.serve_client import ServeClient
from kvconnect.bench.serve_table import aligned, points, spread
from kvconnect.bench.vllm_pd import scrape_sums
from kvconnect.harness.tiny_llama import TinyLlama, build
from kvconnect.harness.vllm_cluster import Server, VllmCluster
from kvconnect.verdict.ucx_tables import format_byte_paths, remote_memory_lines

GPU_ARGS = ["--gpu-memory-utilization", "0.1", "--kv-cache-memory-bytes", "8G"]
# `vllm bench serve` without vLLM's CLI front (which reads vLLM's package metadata: a vLLM unpacked onto the path has
# none): the same parser and main function
BENCH_SERVE = (
    "import sys; from vllm.benchmarks.serve import add_cli_args, main; "
    "from vllm.utils.argparse_utils import FlexibleArgumentParser as P; p = P(); add_cli_args(p); "
    "main(p.parse_args(sys.argv[1:]))"
)
METRICS = ("p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "p99_itl_ms", "request_throughput")


def client_argv(url: str, model: Path, args: argparse.Namespace, out: Path, rate: float | None, cap: int) -> list[str]:
    """`vllm bench serve`'s arguments for one run against `url`, its result saved as `out`."""
    n = max(32, int(args.prompts_per_rate * (max(args.rates) if cap or not rate else rate)))
    cmd = ["--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions", "--model", "tiny"]
    cmd += ["--tokenizer", str(model), "--dataset-name", "random", "--random-input-len", str(args.input_len)]
    cmd += ["--random-output-len", str(args.output_len)]
    cmd += ["--random-range-ratio", json.dumps({"input": args.range_ratio, "output": 0.0})]
    cmd += ["--num-prompts", str(n), "--ignore-eos", "--seed", str(args.seed), "--disable-tqdm"]
    cmd += ["--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--num-warmups", "2"]
    cmd += ["--request-rate", str(rate) if rate else "inf"]
    if cap:
        cmd += ["--max-concurrency", str(cap)]
    return cmd + ["--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]


class Client:
    """Runs the client: in one resident process when asked, else (or once that failed) a process per run."""

    def __init__(self, resident: bool, log: Path) -> None:
        self.resident = ServeClient(log) if resident else None

    def bench(self, argv: list[str], out: Path) -> dict:
        """One client run; returns vLLM's result (its JSON file)."""
        if self.resident is not None:
            try:
                self.resident.run(argv, out.with_suffix(".log"))
                return json.loads(out.read_text())
            except (RuntimeError, OSError, ValueError) as e:
                print(f"resident client failed ({e}); a client process per run from here on", flush=True)
                self.close()
        with open(out.with_suffix(".log"), "w") as log:
            cmd = [sys.executable, "-c", BENCH_SERVE, *argv]
            subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, timeout=600)
        return json.loads(out.read_text())

    def close(self) -> None:
        if self.resident is not None:
            resident, self.resident = self.resident, None
            resident.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--runs", type=int, default=3, help="how many times to measure the whole grid")
    ap.add_argument("--run-index", type=int, default=0, help="the first run's number (a grid measured in steps)")
    ap.add_argument("--order-seed", type=int, help="the first run's order seed (default: drawn and printed)")
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
    ap.add_argument("--seed", type=int, default=0, help="the client's prompts (the same in every run)")
    ap.add_argument("--client", choices=("subprocess", "resident"), default="subprocess")
    ap.add_argument("--enforce-eager", action="store_true", help="vLLM's eager mode (default: compiled, CUDA graphs)")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--replot", action="store_true", help="only rebuild serve.json, serve.txt and the plots")
    ap.add_argument("--gpu-args", default=" ".join(GPU_ARGS), help="the servers' memory arguments")
    args = ap.parse_args()
    if not args.replot:
        measure(args)
    summarize(args.out)


def measure(args: argparse.Namespace) -> None:
    """Start the servers, measure runs run_index .. run_index + runs - 1 on them, write each run's folder."""
    gpu_args = args.gpu_args.split()
    names = args.pairs.split(",")
    first = args.run_index
    model = build(args.out / "model", TinyLlama.named("llama8b-kv"))
    servers = [Server("plain", None, args=gpu_args)]
    for i, name in enumerate(names):
        servers += pair_servers(name, gpu_args, port=25600 + 10 * i)
    t0 = time.monotonic()
    logs = args.out / f"run{first}" / "logs"
    seeds = random.Random(args.order_seed) if args.order_seed is not None else random.SystemRandom()
    with VllmCluster(
        str(model),
        servers,
        str(logs),
        block_size=args.block_size,
        eager=args.enforce_eager,
        max_model_len=args.max_model_len,
        max_num_seqs=128,
    ) as c:
        ucx = {s.name: {k: v for k, v in sorted(c.base_env(s).items()) if k.startswith("UCX_")} for s in servers}
        targets = {"plain": c.urls["plain"]}
        decodes = {  # target -> (its decode's URL, the series read there); push reports on its prefill: not read
            name: (c.urls[f"{name}-decode"], series) for name in names if (series := cell_series(name)) is not None
        }
        for name in names:
            targets[name] = c.add_proxy(f"{name}-proxy", f"{name}-prefill", [f"{name}-decode"])
        c.wait_healthy([f"{name}-proxy" for name in names])
        print(
            f"{len(servers)} servers and {len(names)} proxies healthy after {time.monotonic() - t0:.0f} s", flush=True
        )
        client = Client(args.client == "resident", args.out / f"run{first}" / "client.log")
        try:
            for k in range(first, first + args.runs):
                seed = args.order_seed if k == first and args.order_seed is not None else seeds.randrange(2**31)
                meta = {"run": k, "order_seed": seed, "servers_started_in": f"run{first}", "ucx": ucx}
                measure_run(args, client, targets, decodes, model, k, seed, meta)
                write_proto(logs, args.out / f"run{k}" / "ucx-proto.txt", first, names)
        finally:
            client.close()


def measure_run(
    args: argparse.Namespace,
    client: Client,
    targets: dict[str, str],
    decodes: dict[str, tuple[str, dict[str, str]]],
    model: Path,
    k: int,
    seed: int,
    meta: dict[str, Any],
) -> None:
    """Run k: every cell, the targets in an order shuffled per cell with `seed`; writes run<k>/. For kvconnect's
    pairs and NixlConnector's (`decodes`: target -> its decode server and the series read there) each row adds
    the mean per pull over the cell of those series (`stages_ms`: kvconnect's stages, post and descriptors,
    NixlConnector's transfer time and descriptors, from the histograms before and after the cell; `pulls`: how
    many the first series counted)."""
    run_dir = args.out / f"run{k}"
    (run_dir / "runs").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    print(f"run {k}: order seed {seed}", flush=True)
    capped = args.concurrency_rate or None
    plan: list[tuple[float | None, int]] = [(capped, args.concurrency)] if args.concurrency else []
    plan += [(r, 0) for r in args.rates]
    rows: list[dict] = []
    meta["orders"] = {}
    for rate, cap in plan:
        label = f"concurrency{cap}" if cap else f"rate{rate:g}"
        label += f"-rate{rate:g}" if cap and rate else ""
        order = list(targets)
        rng.shuffle(order)
        meta["orders"][label] = order
        print(f"run {k} {label}: {', '.join(order)}", flush=True)
        for target in order:
            t1 = time.monotonic()
            out = run_dir / "runs" / f"{target}-{label}.json"
            url, series = decodes.get(target, ("", {}))
            before = scrape_sums(url, series) if url else None
            r = client.bench(client_argv(targets[target], model, args, out, rate, cap), out)
            row: dict[str, Any] = {"run_index": k, "target": target, "run": label, "rate": None if cap else rate}
            row.update(concurrency=cap, arrival_rate=rate, order_seed=seed)
            row.update({m: r.get(m) for m in ("completed", "failed", *METRICS)})
            if before is not None:
                row.update(stage_means(before, scrape_sums(url, series)))
            rows.append(row)
            print(json.dumps(row), f"({time.monotonic() - t1:.0f} s)", flush=True)
            (run_dir / "rows.json").write_text(json.dumps(rows, indent=1))  # (as it goes: a cut run keeps it)
    (run_dir / "meta.json").write_text(json.dumps(meta, indent=1))


def stage_means(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """Each series' mean per pull over the cell, from two scrapes: times (`*_s`) in ms, counts as they are; and how
    many pulls the first series counted."""
    means = {}
    for key, (total, count) in after.items():
        n = count - before[key][1]
        scale = 1e3 if key.endswith("_s") else 1.0
        means[key.removesuffix("_s")] = round((total - before[key][0]) / n * scale, 3) if n else None
    first = next(iter(after))
    return {"stages_ms": means, "pulls": after[first][1] - before[first][1]}


def write_proto(logs: Path, path: Path, first: int, names: list[str]) -> None:
    """UCX's protocol lines for remote memory in the logs of the servers that move bytes with NIXL."""
    paths = {
        f"{n}-{side}": remote_memory_lines((logs / f"{n}-{side}.log").read_text(errors="replace"))
        for n in names
        if moves_by_nixl(n)
        for side in ("prefill", "decode")
        if (logs / f"{n}-{side}.log").exists()
    }
    head = f"# UCX_PROTO_INFO=y: protocol lines for remote memory in the logs of run{first}'s servers ({logs.name}/)\n"
    path.write_text(head + format_byte_paths(paths) + "\n")


def load_rows(out: Path) -> tuple[list[dict], list[dict]]:
    """Every run's rows and meta under `out` (run*/rows.json and meta.json); a folder of the old layout: the rows
    of its serve.json, no meta."""
    rows: list[dict] = []
    metas: list[dict] = []
    for run_dir in sorted(out.glob("run*/"), key=lambda p: int(p.name[3:]) if p.name[3:].isdigit() else -1):
        if (run_dir / "rows.json").exists():
            rows += json.loads((run_dir / "rows.json").read_text())
            if (run_dir / "meta.json").exists():
                metas.append(json.loads((run_dir / "meta.json").read_text()))
    if not rows and (out / "serve.json").exists():
        rows = json.loads((out / "serve.json").read_text())
    return rows, metas


def summarize(out: Path) -> None:
    """serve.json, serve.txt and the plots over every run under `out`."""
    rows, metas = load_rows(out)
    if not rows:
        print(f"no rows under {out}", flush=True)
        return
    if not metas:  # a folder of the old layout (one run, serve.json at the top): its files stay as they are
        plot(rows, out)
        return
    (out / "serve.json").write_text(json.dumps(rows, indent=1))
    text = (
        header(metas) + table(rows) + stage_table(rows) + "\n\nrows:\n" + "\n".join(json.dumps(r) for r in rows) + "\n"
    )
    (out / "serve.txt").write_text(text)
    print(table(rows), flush=True)
    plot(rows, out)


def header(metas: list[dict]) -> str:
    """The runs, their order seeds and the servers' UCX settings (those of the first run that has them)."""
    lines = [f"run{m['run']}: order seed {m['order_seed']} (servers of {m['servers_started_in']})" for m in metas]
    ucx = next((m["ucx"] for m in metas if m.get("ucx")), {})
    lines += ["UCX settings per server (UCX_* in its environment):"]
    lines += [f"  {name}: {' '.join(f'{k}={v}' for k, v in env.items()) or '(none)'}" for name, env in ucx.items()]
    return "\n".join(lines) + "\n\n"


def table(rows: list[dict]) -> str:
    """Per cell and target: the median over runs and [min-max] of each metric, and how many runs."""
    cols = ("completed", "failed", *METRICS)
    out = [["cell", "target", "runs", *cols]]
    for cell in dict.fromkeys(r["run"] for r in rows):
        for target in dict.fromkeys(r["target"] for r in rows if r["run"] == cell):
            rs = [r for r in rows if r["run"] == cell and r["target"] == target]
            cells = [cell, target, str(len(rs))]
            cells += [spread([float(r[c]) for r in rs if r.get(c) is not None]) for c in cols]
            out.append(cells)
    return aligned(out)


def stage_table(rows: list[dict]) -> str:
    """Per cell and target read on its decode: each series' mean per pull (ms; descriptors as counts), median over
    runs and [min-max]; "" if none."""
    staged = [r for r in rows if r.get("stages_ms")]
    if not staged:
        return ""
    stages = list(dict.fromkeys(k for r in staged for k in r["stages_ms"]))
    out = [["cell", "target", "runs", "pulls", *stages]]
    for cell in dict.fromkeys(r["run"] for r in staged):
        for target in dict.fromkeys(r["target"] for r in staged if r["run"] == cell):
            rs = [r for r in staged if r["run"] == cell and r["target"] == target]
            cells = [cell, target, str(len(rs)), spread([float(r["pulls"]) for r in rs])]
            cells += [spread([r["stages_ms"][s] for r in rs if r["stages_ms"].get(s) is not None]) for s in stages]
            out.append(cells)
    head = (
        "pull stages and series on the decode, mean per pull over the cell (ms; descs: descriptors per pull;"
        " loop_share: the share of pulls the connector's loop thread posted, the rest vLLM's engine thread):"
    )
    return f"\n\n{head}\n" + aligned(out)


def plot(rows: list[dict], out: Path) -> None:
    """One figure per metric: the median over runs against the request rate, min-max bars, a line per target."""
    try:
        import matplotlib
    except ImportError:
        print("no matplotlib here: draw the plots with --replot where it is", flush=True)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = len({r.get("run_index", 0) for r in rows})
    for metric in METRICS:
        fig, ax = plt.subplots(figsize=(6, 4))
        for target in dict.fromkeys(r["target"] for r in rows):
            pts = points(rows, target, metric)
            if pts:
                med = [p[1] for p in pts]
                bars = [
                    [m - p[2] for m, p in zip(med, pts, strict=True)],
                    [p[3] - m for m, p in zip(med, pts, strict=True)],
                ]
                ax.errorbar([p[0] for p in pts], med, yerr=bars, marker="o", capsize=3, label=target)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(metric)
        ax.set_title(f"{metric}, vllm bench serve, one GPU ({runs} run{'s' if runs > 1 else ''}: median, min-max)")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / f"{metric}.png", dpi=100)
        plt.close(fig)


if __name__ == "__main__":
    main()

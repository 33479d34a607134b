"""P/D under load between two hosts, on CPU: kvconnect's plug-in (every pull a NIXL READ) against vLLM's
NixlConnector, each pair's prefill and decode in two network namespaces joined by a veth, UCX over TCP on it,
measured by vLLM's own benchmark client (`vllm bench serve`) through kvconnect's proxy.

    python benchmarks/vllm_serve_netns.py OUT_DIR [--runs 3] [--rates 1,2,4] [--concurrency 8]
                                          [--prompts-per-rate 24] [--input-len 1024] [--range-ratio 0.5]
                                          [--output-len 16] [--targets kvconnect,nixl] [--seed 0] [--rounds 1]

The full grid (run as root, from the repository root; estimated at 25-30 minutes on 2 quiet cores from the smoke
run below: 6 pair starts of ~1 minute, 18 client runs of ~30-60 s; on a loaded machine a start alone took ~4.5 min):

    PYTHONPATH=$PWD python benchmarks/vllm_serve_netns.py /tmp/nixl-load --runs 3 --rates 1,2,4 \\
        --concurrency 8 --prompts-per-rate 24 --input-len 1024 --range-ratio 0.5 --output-len 16

The smoke run (one rate, 8 short prompts; ~10 minutes on a loaded 2-core machine, most of it the two starts):

    PYTHONPATH=$PWD python benchmarks/vllm_serve_netns.py /tmp/nixl-load-smoke --runs 1 --rates 2 \\
        --prompts-per-rate 8 --input-len 256 --range-ratio 0.5 --output-len 8 --concurrency 4 --kv-cache-gib 1

Hosts: `kvconnect.harness.netns` (prefill on 10.78.0.1, core 0; decode on 10.78.0.2, core 1). Every server runs
with the same UCX settings, `UCX_TLS=tcp`, `UCX_NET_DEVICES=<its veth end>` (the one path two nodes without RDMA
have), and `UCX_PROTO_INFO=y`: the protocol lines UCX printed for remote memory are listed at the end. HTTP: the
prefill's on its veth address, the decode's, the proxy's and the client's on the decode host's loopback.

Targets (each a prefill and a decode behind `kvconnect proxy`: the prefill leg, then the decode leg):
- `kvconnect`: `KVConnectConnector` with `transport: nixl` and `lease_board: false` (its same-host lease board
  lives in the host's shared memory, which two nodes do not share), side channels on the veth, params signed
  (a secret file both sides read). The decode's log ("peer ... over nixl") and its
  `vllm:kvconnect_pulls_usable_by{by="lease_answer"}` counter show every pull went over NIXL READ;
- `nixl`: vLLM's NixlConnector, its thread pinning undone (`kvconnect.bench.nixl_fair`, as the failure table
  runs it): the prefill keeps NIXL's progress thread (over TCP a READ needs the prefill to progress), the decode
  runs without it.

One target's pair is up at a time (started, measured at every rate, stopped): NixlConnector's prefill progress
thread polls without sleeping (NIXL's `pthrDelay` 0) and would take a core from the other pair on 2 cores. Each
run shuffles the target order with a printed seed; `--runs` repeats the whole grid. The client: vLLM's random
dataset, inputs of `input_len * (1 +- range_ratio)` tokens (512-1,536 by default), `--output-len` tokens out with
EOS ignored, Poisson arrivals at each rate, at most `--concurrency` requests in flight, `--prompts-per-rate`
requests. Each (run, rate) draws its prompts from a seed of its own (`--seed` + 1000 x run + rate index; the same
for every target), so no request finds its prompt's blocks in a prefix cache; after each pair starts, two warm-up
requests of other prompts go first, unmeasured. The model: `kv-heavy` (`kvconnect/harness/tiny_llama.py`: 24
layers x 2 KV heads x 128, hidden 256, float32: 48 KiB of KV per token, 48 MiB for a 1,024-token prompt; random
weights).

Per target, rate and run: p50/p99 TTFT and ITL, request throughput, failed requests (vLLM's result), and from the
decode's /metrics (kvconnect's `vllm:kvconnect_*`, NixlConnector's `vllm:nixl_*` histograms) pulls, bytes and
descriptors per pull and the mean transfer time (kvconnect's `xfer_time`: posting + READ; NixlConnector's: its
READ posted -> done), warm-ups excluded; the ceiling: one thread's numpy copy of the mean pull's bytes
in this process right after (best of 6), and each transfer time as a multiple of it. Writes `serve.json`,
`serve.txt` (the table with min-max over runs), a plot per metric (`<metric>.png`), vLLM's result files under
`runs/` and the servers' logs under `logs/`.

Rounds (`--rounds K`): every rate measured K times over on the same pair, each round with prompts of its own
(seed + 100 x round), to see whether a target slows down as its servers age (one GPU run saw kvconnect's TTFT
rise from run to run on servers kept between runs). `serve.txt` then has the main table for round 0 (servers as
fresh as without rounds) and a table per target, rate and round; the plots are round 0's.

No `kvconnect-nomerge` target: no setting turns kvconnect's descriptor merge off (kvconnect/core/plan/descriptors
merges runs of consecutive blocks always), so descriptors per pull follow only from the caches' block ids.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvconnect.bench.ceiling import CopyCeiling
from kvconnect.bench.gpu_pd import KVCONNECT, NIXL
from kvconnect.bench.serve_table import aligned, points, spread
from kvconnect.bench.vllm_pd import scrape_sums
from kvconnect.harness.netns import Hosts, NetnsCluster, netns_unavailable
from kvconnect.harness.tiny_llama import TinyLlama, build
from kvconnect.harness.vllm_cluster import Server, connector_json
from kvconnect.verdict.ucx_tables import remote_memory_lines

MODEL = "kv-heavy"
DTYPE = "float32"
FAIR = "kvconnect.bench.nixl_fair"
TARGETS = ("kvconnect", "nixl")
# `vllm bench serve` without vLLM's CLI front (vllm_serve_gpu.py): the same parser and main function
BENCH_SERVE = (
    "import sys; from vllm.benchmarks.serve import add_cli_args, main; "
    "from vllm.utils.argparse_utils import FlexibleArgumentParser as P; p = P(); add_cli_args(p); "
    "main(p.parse_args(sys.argv[1:]))"
)
METRICS = ("p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "p99_itl_ms", "request_throughput")
PULL = ("pulls", "MiB_per_pull", "descs_per_pull", "xfer_ms", "copy_ms", "xfer_over_copy")
USABLE_BY = "vllm:kvconnect_pulls_usable_by"


def kv_bytes_per_token(model: TinyLlama, dtype_bytes: int = 4) -> int:
    return 2 * model.layers * model.kv_heads * model.head_dim * dtype_bytes


def pair(target: str, hosts: Hosts, secret_file: Path) -> list[Server]:
    """The target's prefill and decode, each on its host, with the same UCX settings."""
    env = {"UCX_TLS": "tcp", "UCX_PROTO_INFO": "y", "KVCONNECT_KV_DIGEST": "0"}
    sides = (("prefill", "kv_producer", hosts.prefill_dev, hosts.prefill_addr, 0),)
    sides += (("decode", "kv_consumer", hosts.decode_dev, hosts.decode_addr, 1),)
    out = []
    for side, role, dev, addr, core in sides:
        side_env = {**env, "UCX_NET_DEVICES": dev}
        if target == "kvconnect":
            extra = {"transport": "nixl", "lease_board": False, "side_channel_host": addr}
            cfg = connector_json(
                "KVConnectConnector", role, "kvconnect.vllm", {**extra, "secret_file": str(secret_file)}
            )
        elif target == "nixl":
            side_env.update(VLLM_NIXL_SIDE_CHANNEL_HOST=addr, VLLM_NIXL_SIDE_CHANNEL_PORT="5600")
            cfg = connector_json("ProgressNixlConnector" if side == "prefill" else "FairNixlConnector", role, FAIR)
        else:
            raise ValueError(f"unknown target {target!r}; known: {', '.join(TARGETS)}")
        out.append(Server(side, cfg, core=core, env=side_env))
    return out


WARMUP_SEED = 999_999  # (far from every measured request's seed)


def bench(
    c: NetnsCluster,
    url: str,
    model: Path,
    args: argparse.Namespace,
    out: Path,
    rate: float,
    seed: int,
    num_prompts: int | None = None,
) -> dict:
    """One `vllm bench serve` run against `url`, from the decode host; returns vLLM's result (its JSON file).
    `seed` picks the prompts: a seed used once per server lifetime, so no prompt finds its blocks in a prefix
    cache (the same seed for every target of a run and rate: each target serves the same prompts)."""
    cmd = ["ip", "netns", "exec", c.where["decode"], sys.executable, "-c", BENCH_SERVE, "--backend", "vllm"]
    cmd += ["--base-url", url, "--endpoint", "/v1/completions", "--model", "tiny", "--tokenizer", str(model)]
    cmd += ["--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len"]
    cmd += [str(args.output_len), "--random-range-ratio", json.dumps({"input": args.range_ratio, "output": 0.0})]
    count = args.prompts_per_rate if num_prompts is None else num_prompts
    cmd += ["--num-prompts", str(count), "--ignore-eos", "--seed", str(seed), "--disable-tqdm"]
    cmd += ["--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--num-warmups", "0"]
    cmd += ["--request-rate", str(rate), "--max-concurrency", str(args.concurrency)]
    cmd += ["--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, timeout=900, env=env)
    return json.loads(out.read_text())


def decode_counts(c: NetnsCluster, target: str) -> dict[str, tuple[float, float]]:
    """The decode's transfer histograms (sum, count), and for kvconnect its pulls by what made them usable."""
    url = c.urls["decode"]
    sums = c.call("decode", scrape_sums, url, KVCONNECT if target == "kvconnect" else NIXL).result(30)
    if target == "kvconnect":
        sums.update(c.call("decode", usable_by, url).result(30))
    return sums


def usable_by(url: str) -> dict[str, tuple[float, float]]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out = {"by_lease_answer": (0.0, 0.0), "by_lease_board": (0.0, 0.0)}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        if family.name == USABLE_BY:
            for s in family.samples:
                key = f"by_{s.labels.get('by', '')}"
                if s.name.endswith("_total") and key in out:
                    out[key] = (out[key][0] + s.value, 0.0)
    return out


def pull_row(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """Pulls, mean bytes, descriptors and transfer time per pull between two readings, and the copy ceiling."""
    pulls = after["xfer_s"][1] - before["xfer_s"][1]
    row: dict[str, Any] = {"pulls": pulls}
    for key in ("by_lease_answer", "by_lease_board"):
        if key in after:
            row[key] = after[key][0] - before[key][0]
    if pulls <= 0:
        return row
    nbytes = (after["bytes"][0] - before["bytes"][0]) / pulls
    xfer_s = (after["xfer_s"][0] - before["xfer_s"][0]) / pulls
    copy_s = nbytes / (CopyCeiling(int(nbytes), "cpu", "cpu").best_gbps(6) * 1e9)
    row.update(
        MiB_per_pull=round(nbytes / 2**20, 2),
        descs_per_pull=round((after["descs"][0] - before["descs"][0]) / pulls, 1),
        xfer_ms=round(xfer_s * 1e3, 2),
        copy_ms=round(copy_s * 1e3, 3),
        xfer_over_copy=round(xfer_s / copy_s, 1),
    )
    return row


def run_target(target: str, run: int, hosts: Hosts, model: Path, args: argparse.Namespace) -> list[dict]:
    """Start the target's pair and proxy, measure every rate, stop them; checks its pulls were NIXL READs."""
    secret = args.out / "secret"
    logs = args.out / "logs" / f"run{run}-{target}"
    where = {"prefill": hosts.prefill_ns, "decode": hosts.decode_ns, "proxy": hosts.decode_ns}
    rows: list[dict] = []
    t0 = time.monotonic()
    with NetnsCluster(
        str(model),
        pair(target, hosts, secret),
        str(logs),
        hosts=hosts,
        where=where,
        listen={"prefill": hosts.prefill_addr},
        dtype=DTYPE,
        max_model_len=2048,
        kv_cache_gib=args.kv_cache_gib,
        max_num_seqs=args.concurrency,
    ) as c:
        c.add_proxy("proxy", "prefill", ["decode"])
        c.wait_healthy(["proxy"])
        print(f"run {run} {target}: healthy after {time.monotonic() - t0:.0f} s", flush=True)
        runs_dir = args.out / "runs"
        # (two requests of prompts no measured request has, one at a time: the handshake and the first pull's
        # set-up happen here, not in the first measured request)
        bench(c, c.urls["proxy"], model, args, runs_dir / f"run{run}-{target}-warmup.json", 1.0, WARMUP_SEED, 2)
        for rnd, (i, rate) in ((k, ir) for k in range(args.rounds) for ir in enumerate(args.rates)):
            t1 = time.monotonic()
            before = decode_counts(c, target)
            seed = args.seed + 1000 * run + 100 * rnd + i
            name = f"run{run}-{target}-rate{rate:g}" + (f"-round{rnd}" if rnd else "")
            r = bench(c, c.urls["proxy"], model, args, runs_dir / f"{name}.json", rate, seed)
            time.sleep(1.0)  # (the decode's stats reach /metrics a step after the pull)
            row: dict[str, Any] = {"run": run, "target": target, "rate": rate, "round": rnd}
            row.update({k: r.get(k) for k in ("completed", "failed", *METRICS)})
            row.update(pull_row(before, decode_counts(c, target)))
            rows.append(row)
            print(json.dumps(row), f"({time.monotonic() - t1:.0f} s)", flush=True)
    if target == "kvconnect":
        text = (logs / "decode.log").read_text(errors="replace")
        ready = [ln.split("peer ", 1)[1] for ln in text.splitlines() if " ready: " in ln and "peer " in ln]
        print(f"run {run} kvconnect decode: {ready[-1] if ready else 'NO peer-ready line'}", flush=True)
        for row in rows:
            row["over_nixl"] = bool(ready) and all(" over nixl," in ln for ln in ready)
    return rows


def byte_paths(log_root: Path) -> dict[str, list[str]]:
    """Per server log that has any, UCX's protocol lines for remote memory (READ and WRITE)."""
    logs = {
        f"{p.parent.name}/{p.stem}": remote_memory_lines(p.read_text(errors="replace"))
        for p in log_root.glob("*/*.log")
    }
    return {name: lines for name, lines in sorted(logs.items()) if lines}


def table(rows: list[dict]) -> str:
    """Per target and rate: the median over runs and [min-max] of each metric; `nixl_read`: whether every run's
    pulls were verified as NIXL READs (kvconnect: its decode's peer line and lease answers; NixlConnector's are)."""
    cols = ("completed", "failed", *METRICS, *PULL)
    out = [["target", "rate", *cols, "nixl_read"]]
    for target in dict.fromkeys(r["target"] for r in rows):
        for rate in sorted({r["rate"] for r in rows if r["target"] == target}):
            rs = [r for r in rows if r["target"] == target and r["rate"] == rate]
            cells = [target, f"{rate:g}"]
            cells += [spread([float(r[c]) for r in rs if r.get(c) is not None]) for c in cols]
            cells.append("yes" if all(r.get("over_nixl", target == "nixl") for r in rs) else "NO")
            out.append(cells)
    return aligned(out)


def rounds_table(rows: list[dict]) -> str:
    """Per target, rate and round on the same servers: the median over runs and [min-max] of TTFT, ITL and the
    pulls' transfer time and descriptors; "" without rounds."""
    if len({r.get("round", 0) for r in rows}) < 2:
        return ""
    cols = ("p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "xfer_ms", "descs_per_pull", "failed")
    out = [["target", "rate", "round", *cols]]
    for target in dict.fromkeys(r["target"] for r in rows):
        for rate in sorted({r["rate"] for r in rows if r["target"] == target}):
            for rnd in sorted({r.get("round", 0) for r in rows}):
                rs = [r for r in rows if r["target"] == target and r["rate"] == rate and r.get("round", 0) == rnd]
                cells = [target, f"{rate:g}", str(rnd)]
                out.append(cells + [spread([float(r[c]) for r in rs if r.get(c) is not None]) for c in cols])
    return aligned(out)


def round0(rows: list[dict]) -> list[dict]:
    """The rows of each pair's first round (servers as fresh as without `--rounds`)."""
    return [r for r in rows if r.get("round", 0) == 0]


def tables(rows: list[dict]) -> str:
    """The main table (round 0) and, with rounds, the table per round."""
    by_round = rounds_table(rows)
    main = table(round0(rows))
    return main + (f"\n\nthe same servers, round by round:\n{by_round}" if by_round else "")


def plot(rows: list[dict], out: Path) -> None:
    """One figure per metric: the median over runs against the request rate, min-max shaded, a line per target."""
    try:
        import matplotlib
    except ImportError:
        print("no matplotlib here: draw the plots with --replot where it is", flush=True)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for metric in (*METRICS, "xfer_ms", "descs_per_pull"):
        fig, ax = plt.subplots(figsize=(6, 4))
        for target in dict.fromkeys(r["target"] for r in rows):
            pts = points(rows, target, metric)
            if pts:
                x = [p[0] for p in pts]
                ax.plot(x, [p[1] for p in pts], marker="o", label=target)
                ax.fill_between(x, [p[2] for p in pts], [p[3] for p in pts], alpha=0.2)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(metric)
        ax.set_title(f"{metric}, vllm bench serve, NIXL over TCP on a veth (CPU)")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / f"{metric}.png", dpi=100)
        plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 2.0, 4.0])
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight at most (also --max-num-seqs)")
    ap.add_argument("--prompts-per-rate", type=int, default=24)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--range-ratio", type=float, default=0.5)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--seed", type=int, default=0, help="the client's prompts and the run orders")
    ap.add_argument("--rounds", type=int, default=1, help="measure every rate this many times on the same servers")
    ap.add_argument("--kv-cache-gib", type=int, default=2, help="each server's KV cache (VLLM_CPU_KVCACHE_SPACE)")
    ap.add_argument("--replot", action="store_true", help="only redraw the plots and the table from OUT/serve.json")
    args = ap.parse_args()
    if args.replot:
        rows = json.loads((args.out / "serve.json").read_text())["rows"]
        print(tables(rows))
        (args.out / "serve.txt").write_text(tables(rows) + "\n")
        plot(round0(rows), args.out)
        return
    why = netns_unavailable()
    if why:
        sys.exit(f"cannot run: {why}")
    (args.out / "runs").mkdir(parents=True, exist_ok=True)
    (args.out / "secret").write_text(secrets.token_hex(32) + "\n")
    shape = TinyLlama.named(MODEL)
    model = build(args.out / "model", shape)
    per_token = kv_bytes_per_token(shape)
    print(
        f"model {MODEL}: {shape.layers} layers x {shape.kv_heads} KV heads x {shape.head_dim}, hidden {shape.hidden},"
        f" {DTYPE}: {per_token} B ({per_token / 1024:g} KiB) of KV per token",
        flush=True,
    )
    rows: list[dict] = []
    seeds = random.Random(args.seed)
    t0 = time.monotonic()
    hosts = Hosts.make()
    try:
        for run in range(args.runs):
            seed = seeds.randrange(2**31)
            order = args.targets.split(",")
            random.Random(seed).shuffle(order)
            print(f"run {run}: seed {seed}, order {order}", flush=True)
            for target in order:
                rows += run_target(target, run, hosts, model, args)
                result = {"kv_bytes_per_token": per_token, "model": MODEL, "args": vars(args), "rows": rows}
                (args.out / "serve.json").write_text(json.dumps(result, indent=1, default=str))  # (a cut run keeps it)
    finally:
        hosts.remove()
    paths = byte_paths(args.out / "logs")
    text = tables(rows)
    print(text)
    print("UCX protocol lines (UCX_PROTO_INFO=y):")
    for server, lines in paths.items():
        for line in lines:
            print(f"  {server}: {line}")
    result = {"kv_bytes_per_token": per_token, "model": MODEL, "args": vars(args), "rows": rows, "ucx": paths}
    (args.out / "serve.json").write_text(json.dumps(result, indent=1, default=str))
    (args.out / "serve.txt").write_text(text + "\n")
    plot(round0(rows), args.out)
    print(f"done in {time.monotonic() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()

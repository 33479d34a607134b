"""GPU head-to-head: kvconnect's vLLM plug-in against vLLM's NixlConnector, P/D on one GPU, real request sizes.

    python benchmarks/vllm_h2h_gpu.py OUT_DIR [--reps 4] [--lengths 512,1024,2048,4096]

A Llama-3-8B-shaped model (32 layers, 8 KV heads x 128, bf16: 128 KiB of KV per token, 512 MiB at 4,096
tokens) with vLLM's `--load-format dummy` (random weights from its config; a generated tokenizer), so
every request moves its real size. Per connector a prefill and a decode server on the one GPU, the same
flags. Two warm-up requests per connector, then per length `reps` requests one after another, each a fresh
random prompt of exactly that many tokens: the prefill leg (`max_tokens` 1, `do_remote_decode`), then the
decode leg streamed with the returned params. Per request, from the decode's /metrics before and after:
bytes, descriptors, transfer time (NixlConnector: NIXL's telemetry, post to completion; kvconnect: post to
completion), kvconnect's requested -> usable, and the decode leg's time to first token. The ceiling: a
torch copy of the same bytes on the same GPU in this process (best of 6, kvconnect.bench.ceiling), measured
per length.
Writes h2h.json and h2h.txt under OUT_DIR.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from kvconnect.bench.ceiling import CopyCeiling
from kvconnect.bench.vllm_pd import SERIES, scrape_sums
from kvconnect.harness.tiny_llama import TinyLlama, build
from kvconnect.harness.vllm_cluster import Server, VllmCluster, connector_json, generate, kvconnect_config

GPU_ARGS = ["--gpu-memory-utilization", "0.2", "--kv-cache-memory-bytes", "8G", "--load-format", "dummy"]
LLAMA3_8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 8192,
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument(
        "--enforce-eager",
        action="store_true",
        help="vLLM's eager mode (default: vLLM's default mode, compiled with CUDA graphs, which users run)",
    )
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--lengths", default="512,1024,2048,4096")
    ap.add_argument("--connectors", default="nixl,kvconnect", help="which pairs to start and measure, in order")
    ap.add_argument(
        "--kvconnect-extra",
        default="{}",
        help="kvconnect's kv_connector_extra_config (JSON), e.g. "
        "'{\"cross_layer_blocks\": true}' (vLLM 0.26: one KV tensor for every layer)",
    )
    args = ap.parse_args()
    names = args.connectors.split(",")
    extra = json.loads(args.kvconnect_extra)
    lengths = [int(x) for x in args.lengths.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    model = build(args.out / "model", TinyLlama.named("tiny"))  # its tokenizer; the geometry below
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, **LLAMA3_8B}))
    vocab = int(cfg["vocab_size"])
    t0 = time.monotonic()
    servers = [
        Server("kvconnect-prefill", kvconnect_config("kv_producer", extra), args=GPU_ARGS),
        Server("kvconnect-decode", kvconnect_config("kv_consumer", extra), args=GPU_ARGS),
        Server(
            "nixl-prefill",
            connector_json("NixlConnector", "kv_producer"),
            args=GPU_ARGS,
            env={"VLLM_NIXL_SIDE_CHANNEL_PORT": "25600"},
        ),
        Server(
            "nixl-decode",
            connector_json("NixlConnector", "kv_consumer"),
            args=GPU_ARGS,
            env={"VLLM_NIXL_SIDE_CHANNEL_PORT": "25700"},
        ),
    ]
    servers = [s for s in servers if s.name.split("-")[0] in names]
    rng = random.Random(7)
    rows = []
    with VllmCluster(
        str(model), servers, str(args.out / "logs"), block_size=16, eager=args.enforce_eager, max_model_len=8192
    ) as c:
        print(f"{len(servers)} servers healthy after {time.monotonic() - t0:.0f} s", flush=True)

        def one(name: str, n: int) -> dict[str, float]:
            prompt = [rng.randrange(10, vocab) for _ in range(n)]
            prefill, decode = c.urls[f"{name}-prefill"], c.urls[f"{name}-decode"]
            remote = {"kv_transfer_params": {"do_remote_decode": True}}
            leg = generate(prefill, prompt, 1, extra=remote)  # type: ignore[arg-type]  # (token ids)
            assert leg["status"] == 200, leg
            before = scrape_sums(decode, SERIES[name])
            params = {"kv_transfer_params": leg["kv_transfer_params"]}
            got = generate(decode, prompt, 4, stream=True, extra=params)  # type: ignore[arg-type]
            assert got["status"] == 200, got
            deadline = time.monotonic() + 10
            while True:  # (stats reach /metrics with the engine's next report)
                after = scrape_sums(decode, SERIES[name])
                if after["bytes"][1] > before["bytes"][1] or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            out = {k: after[k][0] - before[k][0] for k in after}
            out["ttft_s"] = got["ttft_s"]
            return out

        for name in names:
            for _ in range(2):
                one(name, 256)
        for n in lengths:
            for name in names:
                for rep in range(args.reps):
                    r = one(name, n)
                    r.update(connector=name, tokens=n, rep=rep)
                    rows.append(r)
                    print(json.dumps(r), flush=True)
    table = []
    for n in lengths:
        for name in names:
            rs = [r for r in rows if r["tokens"] == n and r["connector"] == name and r["bytes"] > 0]
            if not rs:
                table.append({"tokens": n, "connector": name, "error": "no transfer seen in /metrics"})
                continue
            nbytes = statistics.median(r["bytes"] for r in rs)
            xfer = [r["xfer_s"] for r in rs]
            ceiling = nbytes / (CopyCeiling(int(nbytes), "cuda", "cuda").best_gbps(6) * 1e9)  # (best of 6)
            row = {
                "tokens": n,
                "connector": name,
                "MiB": round(nbytes / 2**20, 1),
                "descs": statistics.median(r["descs"] for r in rs),
                "xfer_ms_min/med/max": [
                    round(min(xfer) * 1e3, 2),
                    round(statistics.median(xfer) * 1e3, 2),
                    round(max(xfer) * 1e3, 2),
                ],
                "GB/s_med": round(nbytes / statistics.median(xfer) / 1e9, 1),
                "copy_GB/s": round(nbytes / ceiling / 1e9, 1),
                "pct_copy": round(100 * ceiling / statistics.median(xfer), 1),
                "ttft_ms_med": round(statistics.median(r["ttft_s"] for r in rs) * 1e3, 1),
            }
            if name == "kvconnect":
                row["usable_ms_med"] = round(statistics.median(r["pull_s"] for r in rs) * 1e3, 2)
            table.append(row)
            print("ROW", json.dumps(row), flush=True)
    (args.out / "h2h.json").write_text(json.dumps({"rows": rows, "table": table}, indent=1))
    (args.out / "h2h.txt").write_text("\n".join(json.dumps(r) for r in table) + "\n")


if __name__ == "__main__":
    main()

"""GPU vLLM P/D on one GPU: kvconnect's plug-in against vLLM's NixlConnector on the same prompts.

    python benchmarks/vllm_pd_gpu.py OUT_DIR [--prompts 16] [--model tiny|tiny-swa|oss-attn|v3-mla|tiny-mamba|...]
                                     [--block-size 32] [--lengths 8,40,...] [--vllm-arg=--kv-cache-dtype --vllm-arg=fp8]
                                     [--env VLLM_SSM_CONV_STATE_LAYOUT=DS]

Starts, on the one GPU, an aggregated vLLM server, a prefill + decode pair with kvconnect's plug-in and a
prefill + decode pair with vLLM's NixlConnector, each pair behind kvconnect's proxy (the same wire drives
both), in vLLM's default mode unless --enforce-eager. A generated model (random weights, byte-level BPE
tokenizer), bf16, the FLASH_ATTN backend: a tiny Llama, or a hybrid one (`tiny-swa`: a Gemma 3 of 4 layers
alternating a 64-token window and full attention; `oss-attn`: gpt-oss-120b's attention shape, 36 layers
alternating a 128-token window and full attention, 8 KV heads x 64), or an MLA one (`v3-mla`: a DeepSeek-V2 of
61 layers with DeepSeek-V3's 576-value latent, dense MLP), or a Mamba2 hybrid (`tiny-mamba`: a Nemotron-H of 3
Mamba2 layers and 1 attention layer; `nemotron-h-state`: Nemotron-H 8B's cache, 24 Mamba2 layers with a
4 MiB SSM state each and 4 attention layers of 8 KV heads x 128). kvconnect's KV digest is on. Per
request it prints each decode's pulled bytes, descriptors and transfer time (and kvconnect's requested ->
usable time), from their /metrics before and after it.
Greedy prompts of 1 to ~1,500 tokens, completions and chat, streamed and not, go through both proxies;
per prompt it prints whether kvconnect's tokens equal NixlConnector's and the aggregated server's. Then
it prints what kvconnect's workers logged at registration (the tensor shape and strides vLLM handed
`register_kv_caches`), the transport each decode picked, and both decodes' transfer metrics. Writes
`pd.json` and the server logs under OUT_DIR.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import httpx

from kvconnect.harness.net import free_port
from kvconnect.harness.tiny_llama import TinyLlama, build, prompt_of
from kvconnect.harness.vllm_cluster import Server, VllmCluster, connector_json, generate, kvconnect_config

MAX_TOKENS = 8
GPU_ARGS = ["--gpu-memory-utilization", "0.12", "--kv-cache-memory-bytes", "4G"]
LENGTHS = [1, 5, 16, 17, 33, 64, 100, 250, 256, 400, 511, 700, 900, 1100, 1300, 1500]


def metrics_text(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = re.match(r"^(vllm:(?:kvconnect|nixl)_[a-z_]+(?:_sum|_count|_total))(?:\{[^}]*\})? ([0-9.e+-]+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


KVC_ENV = {"KVCONNECT_KV_DIGEST": "1"}  # every kvconnect pull checks its bytes against the prefill's


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """A decode's metric sums moved by one request, by short name ("bytes_transferred_sum", ...)."""
    out = {}
    for name, value in after.items():
        short = name.split(":", 1)[1].removeprefix("kvconnect_").removeprefix("nixl_")
        out[short] = value - before.get(name, 0.0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument(
        "--enforce-eager",
        action="store_true",
        help="vLLM's eager mode (default: vLLM's default mode, compiled with CUDA graphs, which users run)",
    )
    ap.add_argument("--prompts", type=int, default=len(LENGTHS))
    ap.add_argument("--model", default="tiny", help="a name of kvconnect.harness.tiny_llama's GEOMETRIES")
    ap.add_argument("--vllm-arg", action="append", default=[], help="one more argument for every server")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument(
        "--env",
        action="append",
        default=[],
        help="NAME=VALUE for every server (e.g. a Mamba model's "
        "VLLM_SSM_CONV_STATE_LAYOUT=DS, which NixlConnector requires)",
    )
    ap.add_argument("--lengths", default="", help="prompt lengths in tokens, comma-separated (default: 1-1500)")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else LENGTHS
    args.out.mkdir(parents=True, exist_ok=True)
    gpu_args = GPU_ARGS + args.vllm_arg
    extra_env = dict(e.split("=", 1) for e in args.env)
    t0 = time.monotonic()
    ckpt = build(args.out / args.model, TinyLlama.named(args.model))
    # NixlConnector on its best path on one GPU: UCX 1.23 turns cuda_ipc reads off without NVLink
    nixl_env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on", "UCX_TLS": "all"}
    servers = [
        Server("aggregated", None, args=gpu_args, env=extra_env),
        Server("kvc-prefill", kvconnect_config("kv_producer"), args=gpu_args, env={**KVC_ENV, **extra_env}),
        Server("kvc-decode", kvconnect_config("kv_consumer"), args=gpu_args, env={**KVC_ENV, **extra_env}),
        Server(
            "nixl-prefill",
            connector_json("NixlConnector", "kv_producer"),
            args=gpu_args,
            env={**nixl_env, **extra_env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
        ),
        Server(
            "nixl-decode",
            connector_json("NixlConnector", "kv_consumer"),
            args=gpu_args,
            env={**nixl_env, **extra_env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
        ),
    ]
    cluster = VllmCluster(
        str(ckpt),
        servers,
        str(args.out / "logs"),
        eager=args.enforce_eager,
        block_size=args.block_size,
        max_model_len=8192 if max(lengths) > 1500 else 2048,
    )
    with cluster as c:
        print(f"5 servers healthy after {time.monotonic() - t0:.0f} s", flush=True)
        proxies = {}
        for pair in ("kvc", "nixl"):
            env = c.base_env(Server("proxy"))
            proxies[pair] = c.add_proxy(f"{pair}-proxy", f"{pair}-prefill", [f"{pair}-decode"], env)
        c.wait_healthy(["kvc-proxy", "nixl-proxy"])
        for pair in ("kvc", "nixl"):  # first contact (handshakes) outside the table
            generate(proxies[pair], prompt_of(40, seed=999), 2)
        rows = []
        for i, n in enumerate(lengths[: args.prompts]):
            chat, stream = i % 4 == 3, i % 3 == 1
            prompt = prompt_of(n, seed=n + 1)
            agg = generate(c.urls["aggregated"], prompt, MAX_TOKENS, chat=chat)
            before = {pair: metrics_text(c.urls[f"{pair}-decode"]) for pair in ("kvc", "nixl")}
            kvc = generate(proxies["kvc"], prompt, MAX_TOKENS, chat=chat, stream=stream)
            nixl = generate(proxies["nixl"], prompt, MAX_TOKENS, chat=chat, stream=stream)
            moved = {pair: delta(before[pair], metrics_text(c.urls[f"{pair}-decode"])) for pair in ("kvc", "nixl")}
            row = {
                "tokens~": n,
                "chat": chat,
                "stream": stream,
                "status": [kvc["status"], nixl["status"]],
                "kvc_eq_nixl": kvc["token_ids"] == nixl["token_ids"],
                "kvc_eq_agg": kvc["token_ids"] == agg["token_ids"],
                "nixl_eq_agg": nixl["token_ids"] == agg["token_ids"],
                "kvc": kvc["token_ids"],
                "nixl": nixl["token_ids"],
                "agg": agg["token_ids"],
                "errors": [kvc["error"], nixl["error"]],
                "kvc_bytes": moved["kvc"].get("bytes_transferred_sum", 0),
                "kvc_descs": moved["kvc"].get("num_descriptors_sum", 0),
                "kvc_xfer_ms": 1e3 * moved["kvc"].get("xfer_time_seconds_sum", 0),
                "kvc_usable_ms": 1e3 * moved["kvc"].get("pull_time_seconds_sum", 0),
                "kvc_digests": moved["kvc"].get("digest_time_seconds_count", 0),
                # the pull's timeline at the decode (ms): arrival -> pull -> posted -> read -> usable -> reported
                "kvc_stages_ms": {
                    stage: round(1e3 * moved["kvc"].get(f"{stage}_seconds_sum", 0), 3)
                    for stage in (
                        "arrival_to_pull",
                        "pull_to_pickup",
                        "pickup_to_post",
                        "read",
                        "read_to_usable",
                        "usable_to_reported",
                    )
                },
                "kvc_ttft_ms": round(1e3 * (kvc["ttft_s"] or 0), 1),
                "nixl_ttft_ms": round(1e3 * (nixl["ttft_s"] or 0), 1),
                "nixl_bytes": moved["nixl"].get("bytes_transferred_sum", 0),
                "nixl_descs": moved["nixl"].get("num_descriptors_sum", 0),
                "nixl_xfer_ms": 1e3 * moved["nixl"].get("xfer_time_seconds_sum", 0),
            }
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("kvc", "nixl", "agg")}), flush=True)
        m = {name: metrics_text(c.urls[name]) for name in ("kvc-decode", "nixl-decode", "kvc-prefill")}
        logs = {
            name: (args.out / "logs" / f"{name}.log").read_text(errors="replace")
            for name in ("kvc-prefill", "kvc-decode")
        }
    registered = [
        line for text in logs.values() for line in text.splitlines() if "registered" in line and "kvconnect" in line
    ]
    ready = [line for line in logs["kvc-decode"].splitlines() if "ready:" in line]
    summary = {
        "prompts": len(rows),
        "all_200": all(r["status"] == [200, 200] for r in rows),
        "kvc_eq_nixl": sum(r["kvc_eq_nixl"] for r in rows),
        "kvc_eq_agg": sum(r["kvc_eq_agg"] for r in rows),
        "nixl_eq_agg": sum(r["nixl_eq_agg"] for r in rows),
        "kvc_eq_agg_where_nixl_eq_agg": all(r["kvc_eq_agg"] for r in rows if r["nixl_eq_agg"]),
    }
    print("SUMMARY", json.dumps(summary), flush=True)
    print("REGISTERED", *registered, sep="\n", flush=True)
    print("READY", *ready, sep="\n", flush=True)
    print("METRICS", json.dumps(m, indent=1), flush=True)
    (args.out / "pd.json").write_text(
        json.dumps({"summary": summary, "rows": rows, "metrics": m, "registered": registered, "ready": ready}, indent=1)
    )


if __name__ == "__main__":
    main()

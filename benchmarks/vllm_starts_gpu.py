"""Starts of GPU vLLM with kvconnect's plug-in in vLLM's default mode (compiled, CUDA graphs), many at once.

    python benchmarks/vllm_starts_gpu.py OUT_DIR [--rounds 3] [--servers 7]

Each round starts `--servers` OpenAI servers together on the one GPU, alternately kv_producer and
kv_consumer, with the plug-in's default settings (transport auto: the IPC gather warms up at start-up),
without --enforce-eager: vLLM captures its CUDA graphs right after the plug-in registers the KV cache, which
is where an earlier plug-in's loop thread broke the capture one start in six. It waits for each server to
answer /health or die, reads each log for the failure's signature, stops them and starts the next round.
Prints one line per start and a summary; writes starts.json and the logs under OUT_DIR.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import httpx

from kvconnect.harness.tiny_llama import TinyLlama, build
from kvconnect.harness.vllm_cluster import Server, VllmCluster, kvconnect_config

GPU_ARGS = ["--gpu-memory-utilization", "0.08", "--kv-cache-memory-bytes", "2G"]
SIGNS = {  # what a log says, by what it means
    "capture_broken": ("stream is capturing", "cudaErrorStreamCaptureInvalidated", "StreamCaptureInvalidated"),
    "engine_failed": ("EngineCore failed to start", "Engine core initialization failed"),
    "graphs_captured": ("Graph capturing finished",),
    "gather_unavailable": ("IPC gather unavailable", "ipc transport unavailable"),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--servers", type=int, default=7)
    ap.add_argument("--timeout", type=float, default=400.0)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(args.out / "logs", ignore_errors=True)  # (a server's log is appended to: start from none)
    ckpt = build(args.out / "tiny-llama", TinyLlama.named("tiny"))
    starts = []
    for r in range(args.rounds):
        servers = [
            Server(f"r{r}-s{i}", kvconnect_config("kv_producer" if i % 2 == 0 else "kv_consumer"), args=GPU_ARGS)
            for i in range(args.servers)
        ]
        t0 = time.monotonic()
        cluster = VllmCluster(str(ckpt), servers, str(args.out / "logs"), eager=False, max_model_len=2048)
        try:
            cluster.start(wait=False)
            pending = {s.name for s in servers}
            up: dict[str, float] = {}
            deadline = t0 + args.timeout
            while pending and time.monotonic() < deadline:
                for name in sorted(pending):
                    if cluster.procs[name].poll() is not None:
                        pending.discard(name)
                        continue
                    try:
                        if httpx.get(cluster.urls[name] + "/health", timeout=2.0).status_code == 200:
                            up[name] = time.monotonic() - t0
                            pending.discard(name)
                    except httpx.HTTPError:
                        pass
                time.sleep(0.5)
        finally:
            cluster.stop()
        for s in servers:
            text = (args.out / "logs" / f"{s.name}.log").read_text(errors="replace")
            row = {
                "round": r,
                "server": s.name,
                "healthy": s.name in up,
                "up_s": round(up.get(s.name, -1.0), 1),
                **{sign: any(x in text for x in needles) for sign, needles in SIGNS.items()},
            }
            starts.append(row)
            print(json.dumps(row), flush=True)
    ok = sum(s["healthy"] and s["graphs_captured"] and not s["capture_broken"] for s in starts)
    summary = {
        "starts": len(starts),
        "clean": ok,
        "capture_broken": sum(s["capture_broken"] for s in starts),
        "engine_failed": sum(s["engine_failed"] for s in starts),
        "gather_unavailable": sum(s["gather_unavailable"] for s in starts),
        "servers_per_round": args.servers,
    }
    print("SUMMARY", json.dumps(summary), flush=True)
    (args.out / "starts.json").write_text(json.dumps({"summary": summary, "starts": starts}, indent=1))


if __name__ == "__main__":
    main()

"""GPU head-to-head on one GPU, requests one at a time: kvconnect's vLLM plug-in (its CUDA IPC gather, and with
`transport: nixl`) against vLLM's NixlConnector and NixlPushConnector, each on the best byte path it can take.

    python benchmarks/vllm_h2h_gpu.py OUT_DIR [--reps 8] [--lengths 512,1024,2048,4096]
                                      [--pairs kvconnect,kvconnect-nixl-board,nixl,push] [--ucx-default]
                                      [--enforce-eager]

vLLM's default mode (compiled, CUDA graphs) unless --enforce-eager. A model with Llama-3-8B's KV cache (32
layers x 8 KV heads x 128, bf16: 128 KiB per token, 512 MiB at 4,096 tokens), random weights, small otherwise
(`llama8b-kv`), block 16. The pairs and their byte paths: `kvconnect/bench/gpu_pd.py`; each NIXL server runs with
`UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on` (--ucx-default: UCX's default) and prints UCX's protocol table, from which the
byte path is printed at the end. A plain vLLM server (no connector) serves the same prompts, for its inter-token
latency.

Per length and repetition, every pair (and the plain server) serves one fresh random prompt of exactly that many
tokens, in a shuffled order per round, so that drift hits all alike: the prefill leg (`max_tokens` 1,
`do_remote_decode`), then the decode leg streamed (`--output` tokens) with the returned params, both under one
`x-request-id` (NixlPushConnector matches the legs by it). Per request, from /metrics before and after: bytes,
descriptors and transfer time as each connector reports them (NixlConnector and kvconnect on the decode,
NixlPushConnector on the prefill); kvconnect's requested -> usable and its timeline stages; the decode's queue
time (arrival -> scheduled: the KV wait) and first forward (scheduled -> first token), its mean inter-token
latency, and the time to first token as the client saw it. The ceiling: a torch copy of the same bytes on the
same GPU in this process, best of 6, per length. Writes h2h.json and h2h.txt under OUT_DIR.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import uuid
from pathlib import Path

from kvconnect.bench.ceiling import CopyCeiling
from kvconnect.bench.gpu_pd import VLLM, deltas, pair_servers, summary, transfer_side
from kvconnect.bench.vllm_pd import scrape_sums
from kvconnect.harness.tiny_llama import TinyLlama, build
from kvconnect.harness.vllm_cluster import Server, VllmCluster, generate
from kvconnect.verdict.ucx_tables import parse_proto_tables

GPU_ARGS = ["--gpu-memory-utilization", "0.09", "--kv-cache-memory-bytes", "4G"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--enforce-eager", action="store_true", help="vLLM's eager mode (default: compiled, CUDA graphs)")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--lengths", default="512,1024,2048,4096")
    ap.add_argument(
        "--pairs",
        default="kvconnect,kvconnect-nixl-board,nixl,push",
        help="which pairs to start and measure (gpu_pd.py's PAIRS; kvconnect-nixl: the lease board off)",
    )
    ap.add_argument("--output", type=int, default=32, help="tokens each decode leg generates")
    ap.add_argument("--ucx-default", action="store_true", help="leave UCX's cuda_ipc GET as UCX sets it")
    args = ap.parse_args()
    names = args.pairs.split(",")
    lengths = [int(x) for x in args.lengths.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    model = build(args.out / "model", TinyLlama.named("llama8b-kv"))
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    servers = [Server("plain", None, args=GPU_ARGS)]
    for i, name in enumerate(names):
        servers += pair_servers(name, GPU_ARGS, args.ucx_default, port=25600 + 10 * i)
    rng = random.Random(7)
    rows: list[dict] = []
    t0 = time.monotonic()
    with VllmCluster(
        str(model), servers, str(args.out / "logs"), block_size=16, eager=args.enforce_eager, max_model_len=8192
    ) as c:
        print(f"{len(servers)} servers healthy after {time.monotonic() - t0:.0f} s", flush=True)

        def one(name: str, n: int) -> dict:
            prompt = [rng.randrange(10, vocab) for _ in range(n)]
            rid = {"x-request-id": f"h2h-{uuid.uuid4().hex}"}
            if name == "plain":
                before = scrape_sums(c.urls["plain"], VLLM)
                got = generate(c.urls["plain"], prompt, args.output, stream=True, headers=rid)
                assert got["status"] == 200, got
                return {**_settled(c.urls["plain"], VLLM, before, "ttft_server_s"), "ttft_s": got["ttft_s"]}
            side, series = transfer_side(name)
            prefill, decode, reporter = c.urls[f"{name}-prefill"], c.urls[f"{name}-decode"], c.urls[f"{name}-{side}"]
            remote = {"kv_transfer_params": {"do_remote_decode": True}}
            leg = generate(prefill, prompt, 1, extra=remote, headers=rid)  # type: ignore[arg-type]  # (token ids)
            assert leg["status"] == 200, leg
            before_x, before_v = scrape_sums(reporter, series), scrape_sums(decode, VLLM)
            params = {"kv_transfer_params": leg["kv_transfer_params"]}
            got = generate(decode, prompt, args.output, stream=True, extra=params, headers=rid)  # type: ignore[arg-type]
            assert got["status"] == 200, got
            out = {**_settled(reporter, series, before_x, "bytes"), **_settled(decode, VLLM, before_v, "ttft_server_s")}
            return {**out, "ttft_s": got["ttft_s"]}

        for name in ["plain", *names]:  # first contact, compile warm-up
            for _ in range(2):
                one(name, 256)
        for n in lengths:
            for rep in range(args.reps):
                order = ["plain", *names]
                rng.shuffle(order)
                for name in order:
                    r = one(name, n)
                    r.update(pair=name, tokens=n, rep=rep)
                    rows.append(r)
                    print(
                        json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()}), flush=True
                    )
        paths = byte_paths(args.out / "logs", [s.name for s in servers])
        kvc_logs = {n: (args.out / "logs" / f"{n}-decode.log") for n in names if n.startswith("kvconnect")}
    table = [_row(rows, name, n) for n in lengths for name in ["plain", *names]]
    for row in table:
        print("ROW", json.dumps(row), flush=True)
    print("byte paths (UCX protocol tables, GPU memory):")
    for server, lines in paths.items():
        for line in lines:
            print(f"  {server}: {line}")
    for name, path in kvc_logs.items():
        ready = [ln for ln in path.read_text(errors="replace").splitlines() if " ready: " in ln and "peer " in ln]
        print(f"  {name}-decode: {ready[-1].split('peer ', 1)[1] if ready else 'no peer-ready line'}")
    (args.out / "h2h.json").write_text(json.dumps({"rows": rows, "table": table, "byte_paths": paths}, indent=1))
    (args.out / "h2h.txt").write_text("\n".join(json.dumps(r) for r in table) + "\n")


def byte_paths(log_dir: Path, servers: list[str]) -> dict[str, list[str]]:
    """Per server, the UCX protocols its logs say moved GPU memory: "<operation> | <range> | <how> | <lanes>"."""
    out: dict[str, list[str]] = {}
    for name in servers:
        path = log_dir / f"{name}.log"
        rows = parse_proto_tables(path.read_text(errors="replace")) if path.exists() else []
        moved = [r for r in rows if "remote memory" in r.operation and "cuda" in r.operation]
        seen = dict.fromkeys(f"{r.operation} | {r.range} | {r.description} | {r.config}" for r in moved)
        if seen:
            out[name] = list(seen)
    return out


def _settled(url: str, series: dict[str, str], before: dict[str, tuple[float, float]], key: str) -> dict[str, float]:
    """The request's deltas, once its `key` histogram has counted it (stats reach /metrics a step later)."""
    deadline = time.monotonic() + 3
    while True:
        after = scrape_sums(url, series)
        if after[key][1] > before[key][1] or time.monotonic() > deadline:
            return deltas(before, after)
        time.sleep(0.05)


def _row(rows: list[dict], name: str, n: int) -> dict:
    rs = [r for r in rows if r["tokens"] == n and r["pair"] == name]
    out: dict = {"tokens": n, "pair": name, "requests": len(rs)}
    for key in ("ttft_s", "queue_s", "first_forward_s", "itl_s"):
        out[f"{key[:-2]}_ms"] = summary([r[key] for r in rs if r.get(key)])
    moved = [r for r in rs if r.get("bytes_n", 0) > 0]
    if name == "plain":
        return out
    if len(moved) < len(rs):
        out["no_transfer_seen"] = len(rs) - len(moved)
    if not moved:
        return out
    nbytes = statistics.median(r["bytes"] for r in moved)
    xfer = [r["xfer_s"] for r in moved]
    ceiling_s = nbytes / (CopyCeiling(int(nbytes), "cuda", "cuda").best_gbps(6) * 1e9)
    out.update(
        MiB=round(nbytes / 2**20, 1),
        descs=statistics.median(r["descs"] for r in moved),
        transfer_ms=summary(xfer),
        copy_ms=round(ceiling_s * 1e3, 3),
        copy_over_transfer_pct=round(100 * ceiling_s / statistics.median(xfer), 1),
    )
    for key in ("usable_s", "pull_to_pickup_s", "pickup_to_post_s", "read_s", "read_to_usable_s"):
        if any(key in r for r in moved):
            out[f"{key[:-2]}_ms"] = summary([r[key] for r in moved if key in r], digits=3)
    return out


if __name__ == "__main__":
    main()

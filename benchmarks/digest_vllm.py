"""What the KV digest (`kv_digest`) costs inside vLLM on CPU, at otherwise default settings: per pull, and in the
time to first token of a P/D request, at a few prompt lengths.

    python benchmarks/digest_vllm.py [--lengths 512,1024,2048,4000] [--reps 7] [--out DIR]

Two kvconnect P/D pairs run at once on the same generated checkpoint (`kv8x128`: 4 layers of 8 KV heads x 128,
float32 as every CPU vLLM test here; 32 KiB of KV per token): `off` with kv_digest off on both sides (the
default), `on` with it on on both. Prefills on core 0, decodes on core 1; everything else as shipped. Per length
and rep, one request on each pair, one after the other (the pair that goes first alternates), each a fresh random
prompt of exactly that many tokens: the prefill leg (1 token), then the decode leg streamed with the returned
params. Per request: the prefill leg's time, the decode leg's time to its first token (the client's clock), the
pull's requested -> usable time and the decode's digest time (`vllm:kvconnect_pull_time_seconds`,
`vllm:kvconnect_digest_time_seconds`, read from the decode's /metrics before and after), and the bytes pulled.
The prefill sums the same blocks when it grants the lease (no metric of its own: the same function over the same
bytes); that sum runs in the prefill's step after the request finished, off the decode's path unless the decode
asks for the lease before the grant. Writes DIR/digest-vllm.txt (the command first) and DIR/digest-vllm.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from kvconnect.bench.vllm_pd import machine_line
from kvconnect.harness.tiny_llama import TinyLlama, build
from kvconnect.harness.vllm_cluster import Server, VllmCluster, kvconnect_config

SERIES = {
    "pull_s": "vllm:kvconnect_pull_time_seconds",
    "digest_s": "vllm:kvconnect_digest_time_seconds",
    "bytes": "vllm:kvconnect_bytes_transferred",
}


def sums(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each histogram in SERIES."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {k: (0.0, 0.0) for k in SERIES}
    wanted = {v: k for k, v in SERIES.items()}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        key = wanted.get(family.name)
        if key is not None:
            out[key] = (
                sum(s.value for s in family.samples if s.name.endswith("_sum")),
                sum(s.value for s in family.samples if s.name.endswith("_count")),
            )
    return out


def one(cluster: VllmCluster, pair: str, ids: list[int]) -> dict[str, Any]:
    prefill, decode = cluster.urls[f"prefill-{pair}"], cluster.urls[f"decode-{pair}"]
    leg = {"model": "tiny", "prompt": ids, "max_tokens": 1, "temperature": 0}
    t0 = time.monotonic()
    r = httpx.post(
        prefill + "/v1/completions", json={**leg, "kv_transfer_params": {"do_remote_decode": True}}, timeout=300
    )
    r.raise_for_status()
    prefill_s = time.monotonic() - t0
    params = r.json()["kv_transfer_params"]
    before = sums(decode)
    body = {**leg, "max_tokens": 2, "stream": True, "ignore_eos": True, "kv_transfer_params": params}
    t0 = time.monotonic()
    ttft = None
    with httpx.stream("POST", decode + "/v1/completions", json=body, timeout=300) as s:
        s.raise_for_status()
        for line in s.iter_lines():
            if ttft is None and line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:]).get("choices", [{}])[0].get("text") is not None:
                    ttft = time.monotonic() - t0
    deadline = time.monotonic() + 30  # (the stats reach /metrics with the engine's next stats update)
    while True:
        after = sums(decode)
        if after["pull_s"][1] > before["pull_s"][1] or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if after["pull_s"][1] <= before["pull_s"][1]:
        raise RuntimeError(f"{pair}: no pull reported for a request of {len(ids)} tokens")
    delta = {k: after[k][0] - before[k][0] for k in SERIES}
    return {
        "pair": pair,
        "tokens": len(ids),
        "prefill_s": prefill_s,
        "ttft_s": ttft,
        "pull_s": delta["pull_s"],
        "digest_s": delta["digest_s"],
        "digests": after["digest_s"][1] - before["digest_s"][1],
        "bytes": delta["bytes"],
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{'tokens':>6} {'MiB':>6} {'pair':4} {'n':>2} {'digest ms':>18} {'pull ms':>18} {'TTFT ms':>20} "
        f"{'prefill leg ms':>20}"
    ]

    def cell(values: list[float]) -> str:
        if not values:
            return "-"
        return f"{statistics.median(values) * 1e3:.1f} ({min(values) * 1e3:.1f}-{max(values) * 1e3:.1f})"

    for tokens in sorted({r["tokens"] for r in rows}):
        for pair in ("off", "on"):
            mine = [r for r in rows if r["tokens"] == tokens and r["pair"] == pair]
            digest = [r["digest_s"] for r in mine if r["digests"]]
            lines.append(
                f"{tokens:6} {statistics.median(r['bytes'] for r in mine) / 2**20:6.1f} {pair:4} {len(mine):2} "
                f"{cell(digest):>18} {cell([r['pull_s'] for r in mine]):>18} "
                f"{cell([r['ttft_s'] for r in mine]):>20} {cell([r['prefill_s'] for r in mine]):>20}"
            )
    lines.append("(median (min-max) per cell; digest: the decode's sum of the pulled blocks, per pull)")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="512,1024,2048,4000")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out", default="results/failure-table/digest")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    lengths = [int(x) for x in args.lengths.split(",") if x]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.gettempdir()) / "kvconnect-digest-vllm"
    model = str(build(scratch / "ckpt-kv8x128", TinyLlama.named("kv8x128")))
    servers = []
    for pair, on in (("off", False), ("on", True)):
        extra = {"kv_digest": on}
        env = {"KVCONNECT_KV_DIGEST": "1" if on else "0"}
        servers.append(Server(f"prefill-{pair}", kvconnect_config("kv_producer", extra), core=0, env=env))
        servers.append(Server(f"decode-{pair}", kvconnect_config("kv_consumer", extra), core=1, env=env))
    rng = np.random.default_rng(args.seed)
    rows: list[dict[str, Any]] = []
    with VllmCluster(
        model, servers, str(scratch / "logs"), dtype="float32", max_model_len=max(lengths) + 64, kv_cache_gib=2
    ) as cluster:
        for pair in ("off", "on"):  # first contact (handshakes) is not what the rows measure
            for _ in range(2):
                one(cluster, pair, rng.integers(10, 2000, 64).tolist())
        for tokens in lengths:
            for rep in range(args.reps):
                order = ("off", "on") if rep % 2 == 0 else ("on", "off")
                for pair in order:
                    row = one(cluster, pair, rng.integers(10, 2000, tokens).tolist())
                    row["rep"] = rep
                    rows.append(row)
                    print(
                        f"{tokens:5} {pair:3} digest {row['digest_s'] * 1e3:7.2f} ms"
                        f"  pull {row['pull_s'] * 1e3:7.2f} ms  ttft {row['ttft_s'] * 1e3:7.1f} ms"
                        f"  prefill {row['prefill_s'] * 1e3:7.1f} ms",
                        flush=True,
                    )
    command = "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
    header = (
        f"$ {command}\n{machine_line('kv8x128 (4 layers, 8 KV heads x 128, float32, block 32)')}; prefills on "
        "core 0, decodes on core 1; kv_digest off on both sides of one pair, on on both of the other\n"
    )
    text = header + table(rows) + "\n"
    print(text)
    (out / "digest-vllm.txt").write_text(text)
    (out / "digest-vllm.json").write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

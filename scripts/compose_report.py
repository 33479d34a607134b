"""Measure the two-node compose demo (profile `cpu`) under podman: how long `up` and `down` take, and what each
request's KV cost on the container network. Needs root and `bash scripts/podman_host.sh` done; builds
`kvconnect:cpu` from this checkout first (quick when podman's layer cache has it).

    .venv/bin/python scripts/compose_report.py [--out results/compose/cpu-report.json]

Per request (one after another, not streamed, through the published proxy): prompt tokens, the KV bytes the
decode's connector pulled (the answer's `kvconnect_transfer`), descriptors, its transport and whether a lease
board decided it, and the bytes the decode container's eth0 received and the prefill's eth0 sent meanwhile
(their /proc/net/dev, read from the host).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvconnect.harness import images  # noqa: E402
from kvconnect.harness.cluster import complete  # noqa: E402
from kvconnect.harness.containers import ComposeProject  # noqa: E402

PROMPT = "The KV cache of a long prompt crosses the container network. "


def measure(project: ComposeProject, repeats: list[int]) -> list[dict[str, Any]]:
    rows = []
    for n in repeats:
        (rx0, _), (_, tx0) = project.netdev("decode"), project.netdev("prefill")
        got = complete(project.proxy_url, PROMPT * n, 4)
        (rx1, _), (_, tx1) = project.netdev("decode"), project.netdev("prefill")
        if got["status"] != 200:
            raise RuntimeError(f"a request of {len(PROMPT * n)} characters failed: {got}")
        t = got["transfer"] or {}
        rows.append(
            {
                "prompt_chars": len(PROMPT * n),
                "status": got["status"],
                "kv_bytes": t.get("bytes", 0),
                "blocks": t.get("num_blocks", 0),
                "descs": t.get("num_descs_merged", 0),
                "transport": t.get("transport", ""),
                "on_board": t.get("on_board"),
                "read_ms": round(1e3 * t.get("transfer_s", 0.0), 2),
                "decode_eth0_rx_bytes": rx1 - rx0,
                "prefill_eth0_tx_bytes": tx1 - tx0,
            }
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="also write the report as JSON here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    t0 = time.monotonic()
    images.ensure("cpu", rebuild=True)
    build_s = time.monotonic() - t0
    project = ComposeProject("cpu", Path(tempfile.mkdtemp(prefix="kvc-compose-report-")))
    t0 = time.monotonic()
    project.up()
    up_s = time.monotonic() - t0
    try:
        complete(project.proxy_url, "warm-up: the first request pays the handshake", 4)
        rows = measure(project, [1, 4, 16, 32])
    finally:
        t0 = time.monotonic()
        left = project.down()
        down_s = time.monotonic() - t0
    report = {"build_s": round(build_s, 1), "up_s": round(up_s, 1), "down_s": round(down_s, 1), "left": left}
    report["requests"] = rows
    print(
        f"build (cached layers unless the checkout changed) {build_s:.0f} s, up to a healthy proxy {up_s:.1f} s, "
        f"down {down_s:.1f} s, left after down: {left or 'nothing'}"
    )
    print(
        f"{'prompt chars':>12} {'KV bytes':>9} {'blocks':>6} {'descs':>5} {'transport':>9} {'board':>5} "
        f"{'read ms':>7} {'decode eth0 rx':>14} {'prefill eth0 tx':>15}"
    )
    for r in rows:
        print(
            f"{r['prompt_chars']:>12} {r['kv_bytes']:>9} {r['blocks']:>6} {r['descs']:>5} {r['transport']:>9} "
            f"{r['on_board']!s:>5} {r['read_ms']:>7} {r['decode_eth0_rx_bytes']:>14} {r['prefill_eth0_tx_bytes']:>15}"
        )
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(r["status"] == 200 for r in rows) and not left else 1


if __name__ == "__main__":
    sys.exit(main())

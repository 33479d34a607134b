"""The walk of one pull through the package: which files it passes through, in order, and how often it returns.

    python scripts/pull_walk.py [--show]

A prefill process (the harness's, real NIXL over loopback) leases three blocks; this process pulls them with a
decode connector while every thread's Python calls are profiled. Each function of `kvconnect/` is counted at its
first call only (the loop's ticks repeat the same functions), from `KVConnector.pull` until the pull is usable;
consecutive calls in one file make one stop. A *revisit* is a stop in a file the walk has already left once. A
*call back* is a call into a file that is already on the stack below the caller's file (a helper calling back
into its hub): each distinct (caller, callee) pair counts once; and the file pairs that call each other both ways
are listed. Splitting a module into smaller ones adds stops without adding any back-and-forth: read the stops
with the call backs and the two-way pairs. A walk that goes down through the rooms and comes
back up has few of either; a hub whose helpers call back into it has many. `--show` prints the stops.
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvconnect.core.cache import KVCache  # noqa: E402
from kvconnect.core.config import connector_config  # noqa: E402
from kvconnect.core.connector import KVConnector  # noqa: E402
from kvconnect.core.plan.layout import CacheSpec, LayoutKind  # noqa: E402
from kvconnect.harness.prefill import PrefillProcess  # noqa: E402

PACKAGE = str(ROOT / "kvconnect")
# the files that carry a request from step to step (the rest are leaves it calls: plan, wire, agent, cache, ...)
STEPS = ("kvconnect/core/connector.py", "kvconnect/core/decode/", "kvconnect/core/transports/")


def walk(stops_of: list[tuple[str, str]]) -> tuple[list[str], int]:
    """(stops: files in order, consecutive duplicates merged; revisits)."""
    stops: list[str] = []
    for path, _ in stops_of:
        if not stops or stops[-1] != path:
            stops.append(path)
    seen: set[str] = set()
    revisits = 0
    for path in stops:
        revisits += path in seen
        seen.add(path)
    return stops, revisits


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--show", action="store_true", help="print every stop")
    args = ap.parse_args()
    spec = CacheSpec(LayoutKind.BLOCKS_FIRST, "float16", 2, 32, 16, 2, 32)
    prefill = PrefillProcess.start(spec, kv_digest=False)
    try:
        params = prefill.lease("walk", [4, 5, 6], 40)
        calls: list[tuple[str, str]] = []
        first: set[Any] = set()
        backs: set[tuple[str, str]] = set()
        edges: set[tuple[str, str]] = set()  # (caller's file, callee's file)
        stacks: dict[int, list[str | None]] = {}
        lock = threading.Lock()
        started = threading.Event()

        def profile(frame: FrameType, event: str, _arg: object) -> None:
            if event not in ("call", "return"):
                return
            stack = stacks.setdefault(threading.get_ident(), [])
            code = frame.f_code
            ours = code.co_filename.startswith(PACKAGE)
            if event == "return":
                if stack:
                    stack.pop()
                return
            name = str(Path(code.co_filename).relative_to(ROOT)) if ours else None
            if code.co_qualname == "KVConnector.pull":
                started.set()
            if ours and started.is_set():
                below = [f for f in stack if f is not None]
                if below and below[-1] != name:
                    edges.add((below[-1], name or ""))
                if below and below[-1] != name and name in below:
                    caller = next(f for f in reversed(stack) if f is not None)
                    backs.add((f"{caller}", f"{name}:{code.co_qualname}"))
            stack.append(name)
            if not ours or code in first:
                return
            with lock:
                first.add(code)
                calls.append((name or "", code.co_qualname))

        config = connector_config({}, side_channel_host="127.0.0.1", kv_digest=False)
        with KVConnector(KVCache.allocate(spec), config) as conn:
            conn._loop.call(lambda: sys.setprofile(profile))  # (the loop thread runs the pull's ticks)
            conn.wait_idle()
            sys.setprofile(profile)
            try:
                conn.pull(params, [0, 1, 2]).wait(30)
            finally:
                sys.setprofile(None)
                conn._loop.call(lambda: sys.setprofile(None))
                conn.wait_idle()
        start = next(i for i, (_, name) in enumerate(calls) if name == "KVConnector.pull")
        stops, revisits = walk(calls[start:])
        files = len(set(stops))
        steps, step_revisits = walk([c for c in calls[start:] if c[0].startswith(STEPS)])
        if args.show:
            for path, name in calls[start:]:
                print(f"  {path}: {name}")
        print(
            f"walk of a pull: {len(stops)} stops in {files} files, {revisits} of them returns to a file visited "
            f"before; {len(backs)} calls back into a file below on the stack"
        )
        print(
            f"the same through the request's steps alone (connector, transports, decode): {len(steps)} stops in "
            f"{len(set(steps))} files, {step_revisits} returns"
        )
        print("  " + " -> ".join(Path(s).with_suffix("").as_posix().removeprefix("kvconnect/core/") for s in steps))
        for caller, callee in sorted(backs):
            print(f"  call back: {caller} -> {callee}")
        both = sorted({tuple(sorted(e)) for e in edges if (e[1], e[0]) in edges})
        print(f"file pairs that call each other both ways: {len(both)}")
        for a, b in both:
            print(f"  {a} <-> {b}")
        print(" -> ".join(Path(s).with_suffix("").as_posix().removeprefix("kvconnect/") for s in stops))
    finally:
        prefill.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Join a pin trace (`sitecustomize.py`): per PIN, where its round trip went, and how the engines stepped.

    python benchmarks/pin_trace/report.py DIR

Per PIN (decode's send -> decode's handling of the answer), in ms: build+send (the decode builds, signs and
queues it), to prefill (ZMQ, the prefill thread's wake-up, the GIL and the tick lock), prefill handling (decode,
check, answer), back to decode (ZMQ, until a decode tick reads it: vLLM's step runs between the decode's ticks)
and decode handling; which prefill thread answered; and each vLLM worker's `transfer_results` (time inside, the
step between) and slow ticks.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

Event = tuple[int, str, str, str, list[str]]  # (monotonic ns, process, thread, event, its arguments)
PARTS = ("build+send", "to prefill", "prefill handling", "back to decode", "decode handling")
STEP = ("start_in", "pull_in", "pull_out", "start_out", "pickup", "pin_sent", "bind_out", "tr_in", "usable", "reported")


def load(d: Path) -> list[Event]:
    events: list[Event] = []
    for f in d.glob("p*.log"):
        pid = f.stem[1:]
        for line in f.read_text().splitlines():
            x = line.split()
            events.append((int(x[0]), pid, x[1], x[2], x[3:]))
    return sorted(events)


def after(events: list[Event], i: int, kind: str, *args: str) -> Event:
    """The first event of `kind` from index `i` on whose arguments start with `args` (StopIteration: none)."""
    return next(e for e in events[i:] if e[3] == kind and e[4][: len(args)] == list(args))


def main() -> None:
    events = load(Path(sys.argv[1]))
    parts: dict[str, list[float]] = {k: [] for k in PARTS}
    coarse: list[tuple[float, float]] = []  # (sent -> prefill's answer built, -> decode's handling): every trace
    served_by: dict[str, int] = {}
    for i, (t, pid, _th, kind, args) in enumerate(events):
        if kind != "pin_sent":
            continue
        lease = args[0]
        try:
            ans = after(events, i, "answer", "pin", lease)
            got = after(events, i, "pin_answer", lease)
        except StopIteration:
            continue
        coarse.append(((ans[0] - t) / 1e6, (got[0] - ans[0]) / 1e6))
        served_by[ans[2]] = served_by.get(ans[2], 0) + 1
        try:
            sent = after(events, i, "sent_done", lease)
            same = [e for e in events if e[1] == ans[1] and e[2] == ans[2]]
            a_in = [e for e in same if e[3] == "ans_in" and e[0] <= ans[0]][-1]
            a_out = next(e for e in same if e[3] == "ans_out" and e[0] >= ans[0])
            read = next(e for e in events if a_out[0] <= e[0] <= got[0] and e[1] == pid and e[3] == "recv")
        except (StopIteration, IndexError):
            continue  # (a trace without the finer events, or a PIN cut off at the end)
        spans = [sent[0] - t, a_in[0] - sent[0], a_out[0] - a_in[0], read[0] - a_out[0], got[0] - read[0]]
        for k, v in zip(PARTS, spans, strict=True):
            parts[k].append(v / 1e6)
    print(f"{len(coarse)} PINs traced; answered by {served_by}")
    if coarse:
        to, back = (statistics.median(c[j] for c in coarse) for j in (0, 1))
        print(f"  sent -> prefill's answer built median {to:.3f} ms; -> decode's handling median {back:.3f} ms")
    n = len(parts[PARTS[0]])
    for k, v in parts.items():
        if v:
            print(f"  {k:18s} median {statistics.median(v):.3f} ms  p90 {sorted(v)[int(0.9 * len(v))]:.3f}")
    if n:
        total = [sum(p[j] for p in parts.values()) for j in range(n)]
        print(f"  {'round trip':18s} median {statistics.median(total):.3f} ms")
    for pid in sorted({e[1] for e in events}):
        mine = [e for e in events if e[1] == pid]
        ins = [e for e in mine if e[3] == "tr_in"]
        outs = [e for e in mine if e[3] == "tr_out"]
        if len(ins) >= 10 and len(outs) >= 10:
            inside = [(o[0] - i[0]) / 1e6 for i, o in zip(ins, outs, strict=False)]
            between = [(ins[j + 1][0] - outs[j][0]) / 1e6 for j in range(min(len(ins) - 1, len(outs)))]
            print(
                f"process {pid}: transfer_results {len(ins)} calls, median {statistics.median(inside):.3f} ms inside, "
                f"{statistics.median(between):.3f} ms between (vLLM's step)"
            )
        slow = [int(e[4][0]) for e in mine if e[3] == "slow_tick"]
        if slow:
            print(f"process {pid}: {len(slow)} ticks over 0.1 ms, median {statistics.median(slow)} us, max {max(slow)}")
    step_of_pull(events)


def step_of_pull(events: list[Event]) -> None:
    """The decode's step that starts a pull, from its `bind_connector_metadata` on: when each later event came
    (median over the pulls, ms), and the share of that time the engine thread spent on a CPU (`thread_cpu_ns`, the
    events' last field, where recorded): the rest it waited (for the GIL, or off a CPU)."""
    starts = [i for i, e in enumerate(events) if e[3] == "bind_in" and e[4][:1] == ["1"]]
    at: dict[str, list[float]] = {k: [] for k in STEP}
    cpu: dict[str, list[float]] = {k: [] for k in STEP}
    for i in starts:
        t0, pid, thread = events[i][0], events[i][1], events[i][2]
        c0 = int(events[i][4][-1]) if len(events[i][4]) > 3 else None
        seen = set()
        for t, p, th, kind, args in events[i + 1 : i + 500]:
            if p != pid or kind not in at or kind in seen:
                continue
            seen.add(kind)
            at[kind].append((t - t0) / 1e6)
            if c0 is not None and th == thread and args and args[-1].isdigit():
                cpu[kind].append((int(args[-1]) - c0) / 1e6)
            if kind == "reported":
                break
    if not any(at.values()):
        return
    print(f"the decode's pull step, {len(starts)} pulls: ms from bind_connector_metadata's start (on a CPU)")
    for k in STEP:
        if at[k]:
            on_cpu = f"  ({statistics.median(cpu[k]):.3f})" if cpu[k] else ""
            print(f"  {k:10s} {statistics.median(at[k]):7.3f}{on_cpu}")


if __name__ == "__main__":
    main()

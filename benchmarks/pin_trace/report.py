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


if __name__ == "__main__":
    main()

"""Which threads of this host use the CPU, over 2 s (Linux /proc): a busy host delays the side channel's threads.

python benchmarks/pin_trace/threads.py      # threads over 3 % of a core, with the CPUs each may run on
"""

from __future__ import annotations

import glob
import os
import time


def snapshot() -> dict[str, tuple[str, int]]:
    out = {}
    for task in glob.glob("/proc/[0-9]*/task/[0-9]*"):
        try:
            stat = open(task + "/stat").read()  # noqa: SIM115
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[task] = (name, int(fields[11]) + int(fields[12]))  # utime + stime, in clock ticks
    return out


def main() -> None:
    before = snapshot()
    time.sleep(2)
    after = snapshot()
    hz = os.sysconf("SC_CLK_TCK")
    rows = []
    for task, (name, ticks) in after.items():
        if task in before and (pct := (ticks - before[task][1]) / hz / 2 * 100) >= 3:
            pid = task.split("/")[2]
            try:
                process = open(f"/proc/{pid}/comm").read().strip()  # noqa: SIM115
                allowed = next(x for x in open(task + "/status") if x.startswith("Cpus_allowed_list")).split()[1]  # noqa: SIM115
            except (OSError, StopIteration):
                process, allowed = "?", "?"
            rows.append((pct, pid, process, name, allowed))
    rows.sort(reverse=True)
    print(f"loadavg {open('/proc/loadavg').read().strip()}; {os.cpu_count()} CPUs; {len(rows)} threads over 3 %")  # noqa: SIM115
    for pct, pid, process, name, allowed in rows[:25]:
        print(f"  {pct:5.0f}% pid {pid} {process:16s} thread {name:16s} may run on {allowed}")


if __name__ == "__main__":
    main()

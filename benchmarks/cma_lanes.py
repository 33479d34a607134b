"""One host, two processes, DRAM: a NIXL READ over UCX's cross-process copy (cma) with and without NIXL's
UCX thread pool, against plain copies of the same bytes in the same process.

    python3 benchmarks/cma_lanes.py [--mib 8,64,512] [--threads 0,2,4] [--descs 4,16] [--reps 15]

Both connectors' CPU pulls in vLLM go through one `process_vm_readv` per descriptor on the calling thread.
NIXL's UCX backend can split a descriptor list over dedicated threads (`num_threads`, with lists split
once they hold `split_batch_size` descriptors; NIXL's default of 1,024 never splits a kvconnect list,
whose merged runs are a handful of descriptors). This measures what that split buys per size and thread
count: the target process registers its buffer as four regions (four layers) and idles between polls, as
a prefill does after its prefill; the reader posts `--descs` equal descriptors per READ and polls to
completion. Ceilings, measured in this process right after each configuration: a one-thread copy and a
copy split over the same number of threads, best of `--reps`. Every configuration's last READ is checked
byte for byte.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import statistics
import threading
import time

import numpy as np

os.environ.setdefault("UCX_TLS", "tcp,cma,sm,self")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

REGIONS = 4


def source_bytes(nbytes: int) -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, nbytes, dtype=np.uint8)


def target(nbytes: int, out: mp.Queue, stop: mp.Event, poll_s: float) -> None:
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("lanes-target", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    buf = source_bytes(nbytes)
    per = nbytes // REGIONS
    agent.register_memory(np.array([[buf.ctypes.data + i * per, per, 0] for i in range(REGIONS)]), "DRAM")
    out.put((agent.get_agent_metadata(), buf.ctypes.data))
    while not stop.is_set():  # an idle prefill: it progresses its worker now and then
        agent.get_new_notifs()
        time.sleep(poll_s)


def copy_ceiling(dst: np.ndarray, src: np.ndarray, threads: int, reps: int) -> float:
    """Best of `reps` copies of src into dst, split over `threads` threads (1 = numpy on this thread)."""
    parts = max(threads, 1)
    edges = np.linspace(0, src.size, parts + 1, dtype=np.int64)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        workers = [
            threading.Thread(target=np.copyto, args=(dst[edges[i] : edges[i + 1]], src[edges[i] : edges[i + 1]]))
            for i in range(1, parts)
        ]
        for w in workers:
            w.start()
        np.copyto(dst[edges[0] : edges[1]], src[edges[0] : edges[1]])
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - t0)
    return best


def reads(nbytes: int, meta: bytes, raddr: int, threads: int, descs: int, reps: int, tag: str) -> list[float]:
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(f"lanes-reader-{tag}", nixl_agent_config(enable_prog_thread=False, backends=[]))
    agent.create_backend("UCX", {"num_threads": str(threads), "split_batch_size": "1"} if threads else {})
    dst = np.zeros(nbytes, dtype=np.uint8)
    agent.register_memory(np.array([[dst.ctypes.data, nbytes, 0]]), "DRAM")
    peer = agent.add_remote_agent(meta)
    per = nbytes // descs
    local = agent.prep_xfer_dlist(
        "NIXL_INIT_AGENT", np.array([[dst.ctypes.data + i * per, per, 0] for i in range(descs)]), "DRAM"
    )
    remote = agent.prep_xfer_dlist(peer, np.array([[raddr + i * per, per, 0] for i in range(descs)]), "DRAM")
    idx = np.arange(descs)
    times = []
    for _ in range(reps + 2):  # two warm-ups (endpoint wire-up, first touch)
        handle = agent.make_prepped_xfer("READ", local, idx, remote, idx)
        t0 = time.perf_counter()
        state = agent.transfer(handle)
        while state not in ("DONE", "ERR"):
            state = agent.check_xfer_state(handle)
        times.append(time.perf_counter() - t0)
        agent.release_xfer_handle(handle)
        if state == "ERR":
            raise RuntimeError(f"READ failed ({threads} threads, {descs} descriptors)")
    if not np.array_equal(dst, source_bytes(nbytes)):
        raise RuntimeError(f"READ bytes differ from the source ({threads} threads, {descs} descriptors)")
    agent.remove_remote_agent(peer)
    return times[2:]


def first_message(out: mp.Queue, proc: mp.process.BaseProcess) -> tuple[bytes, int]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            return out.get(timeout=0.5)
        except queue.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"the target process exited with {proc.exitcode} before publishing") from None
    raise RuntimeError("the target process published nothing within 120 s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", default="8,64,512")
    ap.add_argument("--threads", default="0,2,4")
    ap.add_argument("--descs", default="4,16")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--target-poll-ms", type=float, default=2.0)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    print(f"{os.cpu_count()} CPUs; UCX_TLS={os.environ['UCX_TLS']}; reps {args.reps}; ms min / median / max")
    print(
        f"{'MiB':>5} {'threads':>7} {'descs':>5} {'READ ms':>24} {'GB/s':>6}"
        f" {'copy1 ms':>8} {'copyN ms':>8} {'xcopy1':>6} {'xcopyN':>6}"
    )
    for mib in (int(x) for x in args.mib.split(",")):
        nbytes = mib << 20
        out, stop = ctx.Queue(), ctx.Event()
        proc = ctx.Process(target=target, args=(nbytes, out, stop, args.target_poll_ms / 1e3))
        proc.start()
        try:
            meta, raddr = first_message(out, proc)
            src, dst = source_bytes(nbytes), np.empty(nbytes, dtype=np.uint8)
            for threads in (int(x) for x in args.threads.split(",")):
                for descs in (int(x) for x in args.descs.split(",")):
                    t = reads(nbytes, meta, raddr, threads, descs, args.reps, f"{mib}-{threads}-{descs}")
                    med = statistics.median(t)
                    c1 = copy_ceiling(dst, src, 1, args.reps)
                    cn = copy_ceiling(dst, src, threads, args.reps)
                    print(
                        f"{mib:5d} {threads:7d} {descs:5d} {min(t) * 1e3:8.2f} /{med * 1e3:6.2f} /{max(t) * 1e3:6.2f}"
                        f" {nbytes / med / 1e9:6.2f} {c1 * 1e3:8.2f} {cn * 1e3:8.2f} {c1 / med:6.2f} {cn / med:6.2f}",
                        flush=True,
                    )
        finally:
            stop.set()
            proc.join(timeout=30)
    print("xcopy1 / xcopyN = the best plain copy (1 thread / as many threads as the READ's pool) / the READ's median")


if __name__ == "__main__":
    main()

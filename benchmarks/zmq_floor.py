"""The floor of a side-channel round trip: ZMQ DEALER -> ROUTER -> DEALER over TCP loopback between two processes
with nothing else to do (a PIN's message size), once with a blocking receive and once with the decode's habit
of polling with `time.sleep(0)` between tries. Compare a pin trace's round trip (`pin_trace/`) with it.

    python benchmarks/zmq_floor.py [--rounds 3000]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import zmq

PORT = 29555


def server() -> None:
    sock = zmq.Context().socket(zmq.ROUTER)
    sock.bind(f"tcp://127.0.0.1:{PORT}")
    while True:
        frames = sock.recv_multipart()
        if frames[-1] == b"stop":
            return
        sock.send_multipart(frames)


def rounds(sock: zmq.Socket, n: int, spin: bool) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        sock.send_multipart([b"", b"x" * 200])
        while spin:
            try:
                sock.recv_multipart(zmq.NOBLOCK)
                break
            except zmq.Again:
                time.sleep(0)
        if not spin:
            sock.recv_multipart()
        out.append(time.perf_counter() - t0)
    return out[n // 20 :]  # (the first rounds warm up)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3000)
    args = ap.parse_args()
    proc = mp.Process(target=server)
    proc.start()
    sock = zmq.Context().socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{PORT}")
    for spin in (False, True):
        rt = sorted(x * 1e6 for x in rounds(sock, args.rounds, spin))
        how = "client polling with sleep(0)" if spin else "blocking receive"
        print(f"zmq round trip, {how}: median {statistics.median(rt):.1f} us, p90 {rt[int(0.9 * len(rt))]:.1f}")
    sock.send_multipart([b"", b"stop"])
    proc.join()


if __name__ == "__main__":
    main()

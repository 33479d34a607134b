"""The ceiling every benchmark row is compared with: a plain copy of the same bytes, in the same run."""

from __future__ import annotations

import time

import numpy as np
import torch

from kvconnect.bench.report import Ceiling


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


class CopyCeiling:
    """A plain copy of the request's bytes from the prefill side's memory kind to the decode side's:
    one numpy memcpy on one thread for DRAM, a torch copy between the devices otherwise. One copy runs
    right after each timed pull, so pull and ceiling see the same machine state (this box is shared)."""

    def __init__(self, nbytes: int, src_device: str, dst_device: str) -> None:
        self.nbytes = nbytes
        self.src_device, self.dst_device = src_device, dst_device
        self.dram = src_device == "cpu" and dst_device == "cpu"
        self.times_s: list[float] = []
        if self.dram:
            self.src = np.full(nbytes, 0x5A, dtype=np.uint8)
            self.dst = np.empty_like(self.src)
            self.kind = "memcpy (numpy copyto, 1 thread)"
        else:
            self.src_t = torch.full((nbytes,), 0x5A, dtype=torch.uint8, device=src_device)
            self.dst_t = torch.empty(nbytes, dtype=torch.uint8, device=dst_device)
            self.kind = f"torch copy {src_device} -> {dst_device}"
        self._copy()  # pages faulted in, peer access set up, before anything is timed

    def _copy(self) -> float:
        if self.dram:
            t0 = time.perf_counter()
            np.copyto(self.dst, self.src)
            return time.perf_counter() - t0
        _sync(self.src_device)
        _sync(self.dst_device)
        t0 = time.perf_counter()
        self.dst_t.copy_(self.src_t)
        _sync(self.dst_device)
        _sync(self.src_device)
        return time.perf_counter() - t0

    def once(self) -> None:
        self.times_s.append(self._copy())

    def best_gbps(self, tries: int) -> float:
        """GB/s of the fastest of `tries` copies (when other processes share the cores, a single copy
        measures their scheduling as much as the memory)."""
        return self.nbytes / min(self._copy() for _ in range(max(tries, 1))) / 1e9

    def result(self) -> Ceiling:
        return Ceiling(
            kind=self.kind,
            bytes=self.nbytes,
            reps_s=self.times_s,
            gbps_median=self.nbytes / float(np.median(self.times_s)) / 1e9,
        )

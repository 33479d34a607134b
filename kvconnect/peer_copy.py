"""Same-host GPU fast path: map the peer's cache with CUDA IPC and gather blocks with one kernel.

NIXL/UCX pays a roughly constant cost per descriptor, so even one descriptor per block leaves a large
share of NVLink idle (DESIGN.md section 2). When prefill and decode GPUs sit in one host, the decode
worker can instead map the prefill worker's registered regions (CUDA IPC, driver API through ctypes)
and copy every (unit, block) of a request with a single Triton kernel that reads the peer's memory
directly: no per-descriptor software cost at all. The lease protocol is unchanged: the kernel runs only
while the lease is held, and the pull is usable only after the prefill side confirms it.

Nothing here runs at import time; torch and triton are imported on first use.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvconnect.errors import KVConnectError, NixlError

log = logging.getLogger(__name__)

CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
IPC_HANDLE_BYTES = 64
_WORD_BYTES = 8  # the kernel moves int64 words


class PeerCopyError(NixlError):
    """The CUDA IPC fast path is unavailable or failed; callers fall back to NIXL."""


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


@functools.cache
def _libcuda() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise PeerCopyError(f"CUDA driver library not found: {e}") from e


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise PeerCopyError(f"{what} failed with CUDA driver error {rc}")


def export_region(addr: int) -> tuple[bytes, int]:
    """IPC handle of the allocation holding `addr`, and `addr`'s offset inside it."""
    cu = _libcuda()
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    _check(cu.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(addr)),
           "cuMemGetAddressRange")
    handle = _Handle()
    _check(cu.cuIpcGetMemHandle(ctypes.byref(handle), base), "cuIpcGetMemHandle")
    return bytes(handle), addr - base.value  # (.reserved would stop at the first NUL byte)


def host_id() -> str:
    """Identifies the kernel we run on: peers with equal ids may share GPU memory through IPC."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


class IpcGather:
    """A peer's cache mapped into this process, ready to gather requests with one kernel each."""

    def __init__(self, mapped: MappedPeer, src_units: np.ndarray, dst_units: np.ndarray, unit_bytes: int,
                 dst_origin: int, device: Any) -> None:
        import torch

        self.mapped = mapped
        self._src_units, self._dst_units = src_units, dst_units
        self._unit_bytes = unit_bytes
        self._dst_origin = dst_origin
        self._device = device
        self._stream = torch.cuda.Stream(device=device)

    @classmethod
    def open(cls, info: Any, pair: Any, cache: Any) -> IpcGather:
        """Map `info`'s regions (a protocol.PeerInfo) for pulls planned by `pair` into `cache`."""
        if not info.ipc_handles:
            raise PeerCopyError("peer exports no CUDA IPC handles")
        if not info.host_id or info.host_id != host_id():
            raise PeerCopyError("peer is on another host")
        if pair.unit_bytes % _WORD_BYTES:
            raise PeerCopyError(f"units of {pair.unit_bytes} bytes are not whole {_WORD_BYTES}-byte words")
        try:
            _kernel()
        except ImportError as e:
            raise PeerCopyError(f"triton is not available: {e}") from e
        mapped = MappedPeer.open(info.ipc_handles, info.ipc_offsets)
        try:
            return cls(mapped, pair.remote_descs(mapped.region_addrs, 0)[:, 0],
                       pair.local_descs(cache.base_addrs(), 0)[:, 0], pair.unit_bytes, cache.base_addrs()[0],
                       cache.regions[0].device)
        except Exception:
            mapped.close()
            raise

    def post(self, plan: Any) -> Any:
        """Enqueue one request's gather (a descriptors.PullPlan); returns a CUDA event to poll."""
        import torch

        src_origin = self.mapped.region_addrs[0]
        with torch.cuda.stream(self._stream):
            gather = plan_gather(self._src_units[plan.remote_indices], self._dst_units[plan.local_indices],
                                 self._unit_bytes, src_origin, self._dst_origin, self._device)
        launch(gather, src_origin, self._dst_origin, self._stream)
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    def close(self) -> None:
        self._stream.synchronize()
        self.mapped.close()


@dataclass
class MappedPeer:
    """A peer's regions mapped into this process (current CUDA device must be the local one)."""

    bases: list[int]  # mapped allocation bases, for closing
    region_addrs: list[int]  # where each remote region starts in our address space

    @classmethod
    def open(cls, handles: list[bytes], offsets: list[int]) -> MappedPeer:
        """Map each distinct allocation once (several regions often share one allocator segment)."""
        cu = _libcuda()
        opened: dict[bytes, int] = {}
        try:
            for raw in handles:
                if len(raw) != IPC_HANDLE_BYTES:
                    raise PeerCopyError(f"IPC handle of {len(raw)} bytes, expected {IPC_HANDLE_BYTES}")
                if raw in opened:
                    continue
                handle = _Handle.from_buffer_copy(raw)
                ptr = ctypes.c_uint64()
                _check(cu.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
                       "cuIpcOpenMemHandle")
                opened[raw] = ptr.value
        except PeerCopyError:
            for b in opened.values():
                cu.cuIpcCloseMemHandle(ctypes.c_uint64(b))
            raise
        return cls(list(opened.values()), [opened[h] + off for h, off in zip(handles, offsets)])

    def close(self) -> None:
        cu = _libcuda()
        for b in self.bases:
            cu.cuIpcCloseMemHandle(ctypes.c_uint64(b))
        self.bases = []


class _Ptr:
    """A raw device address Triton accepts as an int64 pointer argument."""

    def __init__(self, addr: int) -> None:
        self._addr = addr
        import torch

        self.dtype = torch.int64

    def data_ptr(self) -> int:
        return self._addr


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def gather_units(src, dst, src_words, dst_words, unit_words, CHUNK: tl.constexpr):
        d = tl.program_id(0)
        c = tl.program_id(1)
        s_off = tl.load(src_words + d)
        d_off = tl.load(dst_words + d)
        offs = c * CHUNK + tl.arange(0, CHUNK)
        mask = offs < unit_words
        x = tl.load(src + s_off + offs, mask=mask)
        tl.store(dst + d_off + offs, x, mask=mask)

    return gather_units


@dataclass
class GatherPlan:
    """Word offsets of each unit on both sides, relative to region 0 of each side."""

    src_words: Any  # torch int64 on the local device
    dst_words: Any
    unit_words: int
    num_units: int


def plan_gather(src_addrs: np.ndarray, dst_addrs: np.ndarray, unit_bytes: int, src_origin: int,
                dst_origin: int, device: Any) -> GatherPlan:
    """Byte addresses (one per unit, issue order) -> word offsets on the device."""
    import torch

    if unit_bytes % _WORD_BYTES or ((src_addrs - src_origin) % _WORD_BYTES).any() \
            or ((dst_addrs - dst_origin) % _WORD_BYTES).any():
        raise PeerCopyError(f"units of {unit_bytes} bytes are not whole, aligned {_WORD_BYTES}-byte words")
    src = torch.from_numpy((src_addrs - src_origin) // _WORD_BYTES).to(device, non_blocking=True)
    dst = torch.from_numpy((dst_addrs - dst_origin) // _WORD_BYTES).to(device, non_blocking=True)
    return GatherPlan(src, dst, unit_bytes // _WORD_BYTES, int(src_addrs.shape[0]))


def launch(plan: GatherPlan, src_origin: int, dst_origin: int, stream: Any, chunk_words: int = 4096) -> None:
    """Enqueue the gather on `stream` (a torch.cuda.Stream of the local device)."""
    import torch
    import triton

    try:
        grid = (plan.num_units, triton.cdiv(plan.unit_words, chunk_words))
        with torch.cuda.stream(stream):
            _kernel()[grid](_Ptr(src_origin), _Ptr(dst_origin), plan.src_words, plan.dst_words,
                            plan.unit_words, CHUNK=chunk_words, num_warps=8)
    except KVConnectError:
        raise
    except Exception as e:
        raise PeerCopyError(f"gather kernel launch failed: {type(e).__name__}: {e}") from e

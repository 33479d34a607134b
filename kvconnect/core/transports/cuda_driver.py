"""The CUDA driver calls of the same-host fast path (`ipc_gather.py`), through ctypes: mapping a peer's memory
(IPC handles) and posting a request's gather with a few typed driver calls.

Nothing here runs at import time; the driver library is loaded on first use. Every call checks its result and
raises `PeerCopyError` (the fast path then is unavailable, or the pull fails) naming the call and its error code.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

from kvconnect.core.errors import TransportUnavailableError

CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
CU_EVENT_DISABLE_TIMING = 0x2
CUDA_ERROR_NOT_READY = 600
IPC_HANDLE_BYTES = 64

_P, _U64, _SIZE = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t
# the calls a post makes, typed once: each is then one C call, with no conversion guessed per argument
_TYPED = {
    "cuMemcpyHtoDAsync_v2": [_U64, _P, _SIZE, _P],
    "cuGraphLaunch": [_P, _P],
    "cuEventRecord": [_P, _P],
    "cuEventQuery": [_P],
    "cuEventSynchronize": [_P],
    "cuEventDestroy_v2": [_P],
}


class PeerCopyError(TransportUnavailableError):
    """The CUDA IPC fast path is unavailable or failed; callers fall back to NIXL."""


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


@functools.cache
def libcuda() -> ctypes.CDLL:
    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise PeerCopyError(f"CUDA driver library not found: {e}") from e
    for name, argtypes in _TYPED.items():
        getattr(cu, name).argtypes = argtypes
    return cu


def check(rc: int, what: str) -> None:
    if rc != 0:
        raise PeerCopyError(f"{what} failed with CUDA driver error {rc}")


def export_region(addr: int) -> tuple[bytes, int]:
    """IPC handle of the allocation holding `addr`, and `addr`'s offset inside it."""
    cu = libcuda()
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    check(
        cu.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(addr)),
        "cuMemGetAddressRange",
    )
    handle = _Handle()
    check(cu.cuIpcGetMemHandle(ctypes.byref(handle), base), "cuIpcGetMemHandle")
    return bytes(handle), addr - base.value  # (.reserved would stop at the first NUL byte)


@dataclass
class MappedPeer:
    """A peer's regions mapped into this process (current CUDA device must be the local one)."""

    bases: list[int]  # mapped allocation bases, for closing
    region_addrs: list[int]  # where each remote region starts in our address space

    @classmethod
    def open(cls, handles: list[bytes], offsets: list[int]) -> MappedPeer:
        """Map each distinct allocation once (several regions often share one allocator segment)."""
        cu = libcuda()
        opened: dict[bytes, int] = {}
        try:
            for raw in handles:
                if len(raw) != IPC_HANDLE_BYTES:
                    raise PeerCopyError(f"IPC handle of {len(raw)} bytes, expected {IPC_HANDLE_BYTES}")
                if raw in opened:
                    continue
                handle = _Handle.from_buffer_copy(raw)
                ptr = ctypes.c_uint64()
                flags = CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
                check(cu.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), handle, flags), "cuIpcOpenMemHandle")
                opened[raw] = ptr.value
        except PeerCopyError:
            for b in opened.values():
                cu.cuIpcCloseMemHandle(ctypes.c_uint64(b))
            raise
        return cls(list(opened.values()), [opened[h] + off for h, off in zip(handles, offsets, strict=True)])

    def close(self) -> None:
        cu = libcuda()
        for b in self.bases:
            cu.cuIpcCloseMemHandle(ctypes.c_uint64(b))
        self.bases = []


class GraphSlots:
    """Per ring slot of the gather: the upload of its id words (pinned host -> device), the replay of its
    captured gather graph, and an event after them, all on one stream, posted with three driver calls.

    torch's wrappers for the same (a stream context, a tensor slice's copy, a graph replay, an event record) are a
    few microseconds each in a quiet process but far more on a busy vLLM engine thread, the post's critical path,
    so it goes around them (benchmarks/ipc_post_steps.py measures both)."""

    def __init__(self, stream: int, execs: list[int], uploads: list[tuple[int, int]]) -> None:
        """`stream`: a raw CUstream; per slot, its instantiated graph (CUgraphExec) and (device, host) addresses
        of its id words."""
        self._cu = libcuda()
        self._stream, self._execs, self._uploads = stream, execs, uploads
        self._events: list[int] = []
        try:
            for _ in execs:
                event = ctypes.c_void_p()
                check(self._cu.cuEventCreate(ctypes.byref(event), CU_EVENT_DISABLE_TIMING), "cuEventCreate")
                self._events.append(event.value or 0)
        except PeerCopyError:
            self.close()
            raise

    def post(self, slot: int, nbytes: int) -> None:
        """Upload the slot's first `nbytes` of id words and gather with them; the slot's event follows."""
        cu, stream = self._cu, self._stream
        dst, src = self._uploads[slot]
        check(cu.cuMemcpyHtoDAsync_v2(dst, src, nbytes, stream), "cuMemcpyHtoDAsync")
        check(cu.cuGraphLaunch(self._execs[slot], stream), "cuGraphLaunch")
        check(cu.cuEventRecord(self._events[slot], stream), "cuEventRecord")

    def done(self, slot: int) -> bool:
        """Whether the slot's last post has finished on the device."""
        rc = self._cu.cuEventQuery(self._events[slot])
        if rc == CUDA_ERROR_NOT_READY:
            return False
        check(rc, "cuEventQuery")
        return True

    def wait(self, slot: int) -> None:
        check(self._cu.cuEventSynchronize(self._events[slot]), "cuEventSynchronize")

    def close(self) -> None:
        for event in self._events:
            self._cu.cuEventDestroy_v2(event)
        self._events = []

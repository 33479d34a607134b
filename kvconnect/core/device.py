"""CUDA facts for kvconnect's own threads: which device a thread works on, and how its CUDA calls meet an
engine's graph capture on another thread.

An engine (vLLM) captures CUDA graphs right after it registers its KV cache. In CUDA's default (global)
capture mode, a potentially unsafe call (an allocation, a module load, a synchronisation) from *any* thread
of the process while a capture runs fails, and the capture is invalidated with it: the engine then fails to
start. kvconnect therefore does its start-up CUDA work on the thread that builds the connector (before the
engine can begin a capture; `transports/base.py`), and its own threads set their interaction mode to
relaxed, so that a CUDA call they do make (a pull's work, which an engine never asks for while it captures)
can never invalidate another thread's capture. Nothing here runs at import time.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from typing import Any

log = logging.getLogger(__name__)

CAPTURE_MODE_RELAXED = 2  # CU_STREAM_CAPTURE_MODE_RELAXED (0: global, 1: thread-local)


@functools.cache
def _libcuda() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def relax_stream_capture() -> int | None:
    """Make the calling thread's CUDA calls unable to break a capture running on another thread; returns the
    mode the thread had (None where there is no CUDA driver or the call failed)."""
    cu = _libcuda()
    if cu is None:
        return None
    mode = ctypes.c_int(CAPTURE_MODE_RELAXED)
    rc = cu.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode))
    if rc != 0:
        log.warning("cannot relax this thread's CUDA stream-capture mode (driver error %d)", rc)
        return None
    return mode.value


def capture_mode() -> int | None:
    """The calling thread's stream-capture interaction mode (tests; None without a CUDA driver)."""
    cu = _libcuda()
    if cu is None:
        return None
    mode = ctypes.c_int(CAPTURE_MODE_RELAXED)
    if cu.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode)) != 0:
        return None
    restore = ctypes.c_int(mode.value)
    cu.cuThreadExchangeStreamCaptureMode(ctypes.byref(restore))
    return mode.value


def enter_device_thread(device: Any) -> None:
    """Prepare a kvconnect thread to work on `device` (a torch CUDA device): its current device, and a
    relaxed capture mode (module docstring)."""
    import torch

    torch.cuda.set_device(device)
    relax_stream_capture()

"""Test-wide settings: keep UCX on loopback and NIXL quiet, before anything loads NIXL.

On a GPU machine (where `pytest -m gpu tests/gpu` runs) UCX keeps its defaults, so cuda_ipc is used.
"""

import os
import shutil

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("UCX_TLS", "tcp,cma,sm,self")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")

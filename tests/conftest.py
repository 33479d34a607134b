"""Test-wide settings: keep UCX on loopback and NIXL quiet, before anything loads NIXL."""

import os

os.environ.setdefault("UCX_TLS", "tcp,cma,sm,self")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

"""Test-wide settings: keep UCX on loopback and NIXL quiet, before anything loads NIXL; the KV digest on.

On a GPU machine (where `pytest -m gpu tests/gpu` runs) UCX keeps its defaults, so cuda_ipc is used.
"""

import os
import shutil

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
# every pull the tests make checks its bytes end to end (kv_digest; tests/helpers.py for in-process connectors):
# the workers, prefill processes and vLLM servers the tests start inherit this
os.environ.setdefault("KVCONNECT_KV_DIGEST", "1")
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("UCX_TLS", "tcp,cma,sm,self")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")


def pytest_collection_finish(session) -> None:  # type: ignore[no-untyped-def]
    """Start the container-image replays now, in the background, when a selected test needs them: their
    minute or two of unpacking wheels then overlaps the tests that run before them (tests/image_build.py)."""
    from tests.image_build import REPLAY_FIXTURE, start_replays

    if not session.config.option.collectonly and any(
        REPLAY_FIXTURE in getattr(item, "fixturenames", ()) for item in session.items
    ):
        start_replays()


def pytest_sessionfinish(session, exitstatus) -> None:  # type: ignore[no-untyped-def]
    from tests.image_build import stop_replays

    stop_replays()

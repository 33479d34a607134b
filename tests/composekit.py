"""Whether the compose tier can run here, shared by tests/test_compose*.py: root, podman, podman-compose and
the base image (`bash scripts/dev.sh compose` provides them). Skipped without them, unless
KVCONNECT_REQUIRE_COMPOSE=1 (CI), which makes a missing piece a failure."""

from __future__ import annotations

import os
import shutil

import pytest

from kvconnect.harness import images
from kvconnect.harness.containers import compose_binary


def compose_missing() -> str | None:
    if os.geteuid() != 0:
        return "the compose tier needs root (rootful podman)"
    if shutil.which("podman") is None:
        return "podman is not installed (bash scripts/dev.sh compose installs it)"
    try:
        compose_binary()
    except RuntimeError as e:
        return str(e)
    if not images.image_exists(images.BASE_IMAGE):
        return f"no base image {images.BASE_IMAGE} (bash scripts/podman_host.sh base)"
    return None


def require_compose() -> None:
    reason = compose_missing()
    if reason is not None:
        if os.environ.get("KVCONNECT_REQUIRE_COMPOSE") == "1":
            pytest.fail(f"KVCONNECT_REQUIRE_COMPOSE=1 but {reason}")
        pytest.skip(reason)

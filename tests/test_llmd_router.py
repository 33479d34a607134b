"""llm-d's router in front of kvconnect's pool: deploy/overlays/llm-d/router-values.yaml against the llm-d-router
chart and endpoint picker it is written for (v0.10.0: the values its templates read, the plug-ins its endpoint
picker registers, their parameters), the pool's label against llm-d's own, and components/llm-d-ssrf (the P/D
sidecar's SSRF protection with its RBAC and a namespaced pool).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.crds import validate_all
from tests.kube import DEPLOY, by_kind, kustomize, kustomize_with, option
from tests.llmd import FORMS, RELEASE, fact, image_tag, rendered, roles, sidecar_of, unknown_flags, vllm_of
from tests.netpol import selects

VALUES = DEPLOY / "overlays" / "llm-d" / "router-values.yaml"
MAPS = ("router.modelServers.matchLabels", "router.epp.pluginsCustomConfig", "router.epp.flags", "router.epp.env")


def leaf_paths(tree: Any, prefix: str = "") -> list[str]:
    """Dotted paths of a values tree, stopping at the maps whose keys are the user's (MAPS)."""
    if not isinstance(tree, dict) or prefix in MAPS:
        return [prefix]
    return [p for k, v in tree.items() for p in leaf_paths(v, f"{prefix}.{k}" if prefix else k)]


def values() -> dict[str, Any]:
    return yaml.safe_load(VALUES.read_text())  # type: ignore[no-any-return]


def epp_config() -> dict[str, Any]:
    epp = values()["router"]["epp"]
    return yaml.safe_load(epp["pluginsCustomConfig"][epp["pluginsConfigFile"]])  # type: ignore[no-any-return]


def test_the_router_values_are_keys_the_chart_reads() -> None:
    """Every value set is one the chart's templates read (a misplaced key, such as the top-level
    `inferencePool.*` of another chart, would be ignored silently and leave the pool unselected)."""
    known = set(fact("router.values-keys"))
    for path in leaf_paths(values()):
        assert path in known, f"{VALUES.name}: {path} is not read by llm-d-router v0.10.0's charts"
    assert set(values()) == {"router"}


def test_the_endpoint_picker_config_uses_plug_ins_v0_10_registers_and_splits_every_request() -> None:
    config = epp_config()
    assert config["apiVersion"] in fact("router.epp-config-api") and config["kind"] == "EndpointPickerConfig"
    registered = fact("router.plugins")
    defined = {p.get("name", p["type"]): p for p in config["plugins"]}
    for name, plugin in defined.items():
        assert registered.get(plugin["type"]) not in (None, "deprecated"), f"{name}: {plugin['type']}"
    (handler,) = [p for p in config["plugins"] if p["type"] == "disagg-profile-handler"]
    spec = fact("router.disagg-profile-handler")
    params = handler["parameters"]
    assert set(params) <= set(spec["parameters"]), params
    assert set(params["profiles"]) <= set(spec["parameters"]["profiles"])
    decider = params["deciders"]["prefill"]  # without it the handler never disaggregates
    assert decider in defined and defined[decider]["type"] in spec["deciders"]
    profiles = {p["name"]: [ref["pluginRef"] for ref in p["plugins"]] for p in config["schedulingProfiles"]}
    assert set(profiles) == set(params["profiles"].values()) == {"prefill", "decode"}
    for profile, refs in profiles.items():
        assert set(refs) <= set(defined), (profile, set(refs) - set(defined))
    role_filter = {"prefill": "prefill-filter", "decode": "decode-filter"}
    for role, profile in params["profiles"].items():
        (filt,) = [r for r in profiles[profile] if defined[r]["type"].endswith("-filter")]
        assert defined[filt]["type"] == role_filter[role], (role, filt)


@pytest.mark.parametrize("form", FORMS)
def test_the_pool_selects_kvconnects_pods_and_no_nixlconnector_pod(form: str) -> None:
    """router-values.yaml's pool selects both roles by a label only kvconnect's pods carry; llm-d's own pool
    (`llm-d.ai/guide: pd-disaggregation`) selects none of them, and ours none of llm-d's pods, so a NixlConnector
    pool and this one can run side by side without pairing across connectors. The role filters admit each role."""
    pool = values()["router"]["modelServers"]
    filters = fact("router.role-filters")
    theirs = fact("guide.pool-selector")
    for role, template in roles(rendered(form)).items():
        labels = template["metadata"]["labels"]
        assert selects({"matchLabels": pool["matchLabels"]}, labels), role
        assert not selects({"matchLabels": theirs}, labels), f"llm-d's pool would adopt the {role} pod"
        assert not {k for k in labels if k.startswith("llm-d.ai/")} - {filters["label"]}, labels
        assert labels[filters["label"]] in filters[f"{role}-filter"]
        nixl_pod = {**fact("guide.pod-labels"), filters["label"]: role}
        assert not selects({"matchLabels": pool["matchLabels"]}, nixl_pod), "ours would adopt llm-d's pods"
    assert not [k for k in pool["matchLabels"] if k.startswith("llm-d.ai/")]


def test_the_pool_targets_the_port_requests_enter_each_pod_by() -> None:
    pods = roles(rendered("overlays/llm-d"))
    sidecar_port = int(option(sidecar_of(pods["decode"])["args"], "--port"))
    prefill_port = {p["name"]: p["containerPort"] for p in vllm_of(pods["prefill"])["ports"]}["http"]
    targets = [p["number"] for p in values()["router"]["modelServers"]["targetPorts"]]
    assert targets == [sidecar_port] == [prefill_port] == fact("router.inferencepool")["targetPorts"]
    assert values()["router"]["modelServers"]["type"] == "vllm"


def test_the_endpoint_picker_is_pinned_to_the_sidecars_release() -> None:
    """The chart's default endpoint picker image is `main`; the plug-in names above are v0.10.0's."""
    sidecar = sidecar_of(roles(rendered("overlays/llm-d"))["decode"])
    assert values()["router"]["epp"]["image"]["tag"] == image_tag(sidecar["image"]) == "v0.10.0"


def test_the_release_name_is_the_one_the_policies_and_the_docs_use() -> None:
    text = VALUES.read_text()
    assert f"helm install {RELEASE} " in text
    policy = (DEPLOY / "overlays" / "llm-d" / "networkpolicy.yaml").read_text()
    for labels in fact("router.pod-labels").values():
        for key, value in labels.items():
            if "<release>" in value:
                assert f"{key}: {value.replace('<release>', RELEASE)}" in policy, key


def _ssrf_docs(tmp_path: Path) -> list[dict[str, Any]]:
    return kustomize_with(tmp_path, DEPLOY / "overlays" / "llm-d", [DEPLOY / "components" / "llm-d-ssrf"])


def test_ssrf_protection_comes_with_its_rbac_a_namespaced_pool_and_the_token_in_the_sidecar_only(
    tmp_path: Path,
) -> None:
    docs = _ssrf_docs(tmp_path)
    validate_all(docs)
    decode = roles(docs)["decode"]
    pod, sidecar, vllm = decode["spec"], sidecar_of(decode), vllm_of(decode)
    tag = image_tag(sidecar["image"])
    assert not unknown_flags(sidecar["args"], tag), unknown_flags(sidecar["args"], tag)
    assert option(sidecar["args"], "--enable-ssrf-protection") == "true"
    env = {e["name"]: e for e in sidecar["env"]}
    namespace, _, pool = option(sidecar["args"], "--inference-pool").partition("/")
    assert namespace == "$(POD_NAMESPACE)" and pool == RELEASE == fact("router.inferencepool")["name"].replace(
        "<release>", RELEASE
    )
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    # RBAC: exactly what the sidecar's watches read, in its own namespace
    (account,) = by_kind(docs, "ServiceAccount").values()
    (role,) = by_kind(docs, "Role").values()
    (binding,) = by_kind(docs, "RoleBinding").values()
    assert not by_kind(docs, "ClusterRole") and not by_kind(docs, "ClusterRoleBinding")
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"]}]
    granted = {
        (g, r): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
    }
    needed = {(w["group"], w["resource"]): set(w["verbs"]) for w in fact("sidecar.ssrf")["watches"]}
    assert set(granted) == set(needed) and all(needed[k] <= granted[k] <= needed[k] | {"get"} for k in needed)
    # the token: in the sidecar, nowhere else
    assert pod["automountServiceAccountToken"] is False and account["automountServiceAccountToken"] is False
    token_dir = "/var/run/secrets/kubernetes.io/serviceaccount"
    (mount,) = [m for m in sidecar["volumeMounts"] if m["mountPath"] == token_dir]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    sources = volume["projected"]["sources"]
    assert {next(iter(s)) for s in sources} == {"serviceAccountToken", "configMap", "downwardAPI"}
    assert not [m for m in vllm["volumeMounts"] if m["name"] == mount["name"] or m["mountPath"] == token_dir]


def test_a_component_added_to_the_deployment_form_reaches_the_disaggregated_set(tmp_path: Path) -> None:
    """The DisaggregatedSet form copies the Deployment form's pods: SSRF protection added to overlays/llm-d (as
    its documentation says) is in the DisaggregatedSet's decode pods, with its RBAC."""
    deploy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, deploy)
    kustomization = deploy / "overlays" / "llm-d" / "kustomization.yaml"
    text = kustomization.read_text()
    sidecar = "  - ../../components/llm-d-pd-sidecar"
    assert sidecar in text, "the sidecar is a component of the overlay, so that others can follow it"
    kustomization.write_text(text.replace(sidecar, sidecar + "\n  - ../../components/llm-d-ssrf", 1))
    docs = kustomize(deploy / "overlays" / "llm-d-ds")
    validate_all(docs)
    assert "DisaggregatedSet" in {d["kind"] for d in docs} and not by_kind(docs, "Deployment")
    decode = roles(docs)["decode"]
    assert option(sidecar_of(decode)["args"], "--enable-ssrf-protection") == "true"
    assert decode["spec"]["serviceAccountName"] in by_kind(docs, "ServiceAccount")

"""deploy/overlays/llm-d (Deployment form) and deploy/overlays/llm-d-ds (DisaggregatedSet form): kvconnect's vLLM
plug-in where llm-d's P/D guide runs NixlConnector, checked without a cluster against what llm-d runs (the facts of
tests/data/llm-d/facts.json, each recorded with its upstream commit).

- Every rendered object is valid: the Kubernetes schemas (built-in kinds, strict, oldest and newest Kubernetes),
  ours for the DisaggregatedSet (LWS v0.10.0's fields; its pod templates as core/v1 PodTemplates); and the
  validators refuse what the apiserver would (llm-d's own `groupIdentity` among it).
- The P/D sidecar: llm-d-router's published image at a release whose flags are recorded, given only flags that
  release parses (the sidecar exits on any other), in front of the decode's vLLM as llm-d runs it, TLS off.
- vLLM: the plug-in, llm-d's parallelism, block size, probes, graceful shutdown, /dev/shm, keep-alive, USER for
  vLLM from 0.20 on (torch 2.11), `kv_load_failure_policy: fail` on the decode, NixlConnector's side-channel port.
- The DisaggregatedSet runs exactly the Deployment form's pods, rolled out as llm-d rolls them.
"""

from __future__ import annotations

import copy
import json

import pytest

from kvconnect.core.allowlist import parse_allowlist
from tests.crds import crd_validate, validate_all
from tests.kube import DEPLOY, by_kind, container_env, expand, option
from tests.llmd import (
    FORMS,
    configmaps,
    fact,
    flag_names,
    image_tag,
    recorded_sidecar_tags,
    rendered,
    roles,
    sidecar_flags,
    sidecar_of,
    unknown_flags,
    vllm_of,
)


@pytest.mark.parametrize("form", FORMS)
def test_every_rendered_object_is_valid_kubernetes_or_a_known_custom_resource(form: str) -> None:
    docs = rendered(form)
    validate_all(docs)
    kinds = sorted({d["kind"] for d in docs})
    workload = "Deployment" if form == "overlays/llm-d" else "DisaggregatedSet"
    assert kinds == sorted({"ConfigMap", "NetworkPolicy", workload}), kinds  # (no proxy, no Services)
    if workload == "DisaggregatedSet":
        assert fact("guide.ds.api") == docs[[d["kind"] for d in docs].index(workload)]["apiVersion"]


def test_the_custom_resource_validators_refuse_what_the_apiserver_would() -> None:
    """Our DisaggregatedSet schema is LWS v0.10.0's: llm-d's newest manifest adds `groupIdentity`, which that
    release's CRD does not have (strict field validation refuses it); a misspelt pod field, replicas zero for one
    role only, an unknown PodMonitor field and a rule that is both alert and record are refused too."""
    (ds,) = by_kind(rendered("overlays/llm-d-ds"), "DisaggregatedSet").values()
    crd_validate(ds)
    broken = []
    for change in (
        lambda d: d["spec"]["roles"][0]["spec"].__setitem__("groupIdentity", "Hash"),
        lambda d: d["spec"]["roles"][1]["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"].__setitem__(
            "terminationGracePeriodSecond", 75
        ),
        lambda d: d["spec"]["roles"][0]["spec"].__setitem__("replicas", 0),
        lambda d: d["spec"].__setitem__("slices", 0),
    ):
        bad = copy.deepcopy(ds)
        change(bad)
        broken.append(bad)
    monitor = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor", "metadata": {"name": "m"}}
    broken.append({**monitor, "spec": {"selector": {}, "podMetricsEndpoint": [{"port": "http"}]}})
    rule = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule", "metadata": {"name": "r"}}
    broken.append({**rule, "spec": {"groups": [{"name": "g", "rules": [{"alert": "A", "record": "r", "expr": "1"}]}]}})
    for bad in broken:
        with pytest.raises(AssertionError):
            crd_validate(bad)


def test_a_flag_the_pinned_sidecar_lacks_is_caught() -> None:
    """The check the overlay passes: the issue's two mismatches are each caught for the release they concern
    (--model-server-port arrived in v0.10.0; no sidecar release has --secure-serving, llm-d's newest manifest's
    flag), and a deprecated flag counts as missing."""
    assert "v0.10.0" in recorded_sidecar_tags() and "v0.8.0" in recorded_sidecar_tags()
    assert unknown_flags(["--model-server-port=8200"], "v0.8.0") == ["model-server-port"]
    assert unknown_flags(["--model-server-port=8200"], "v0.10.0") == []
    assert unknown_flags(fact("guide.sidecar-args"), "v0.10.0") == ["secure-serving"]
    assert unknown_flags(fact("guide.sidecar-args-earlier"), "v0.8.0") == []
    assert unknown_flags(fact("guide.sidecar-args-v0.9.0"), "v0.9.0") == []
    assert unknown_flags(["--vllm-port=8200"], "v0.10.0") == ["vllm-port"]  # (deprecated there)


@pytest.mark.parametrize("form", FORMS)
def test_the_sidecar_is_a_published_release_given_only_flags_it_has(form: str) -> None:
    sidecar = sidecar_of(roles(rendered(form))["decode"])
    name, tag = sidecar["image"].rsplit(":", 1)
    assert name == fact("guide.sidecar-image")["name"], sidecar["image"]  # llm-d-router's published image
    assert tag in recorded_sidecar_tags(), f"{tag}: record its flags before pinning it"
    assert flag_names(sidecar["args"]), "the sidecar is given its flags"
    assert not unknown_flags(sidecar["args"], tag), (
        f"flags sidecar {tag} does not parse: {unknown_flags(sidecar['args'], tag)}"
    )
    assert all(sidecar_flags(tag)[n] != "zap" for n in flag_names(sidecar["args"]))  # (none needed)


@pytest.mark.parametrize("form", FORMS)
def test_the_sidecar_fronts_the_decodes_vllm_as_llm_d_runs_it(form: str) -> None:
    """A native sidecar on llm-d's serving port forwarding to the decode's vLLM port, vLLM's kv_transfer_params
    wire, TLS off as llm-d runs it (its default is on, with a self-signed certificate), SSRF protection off as
    llm-d leaves it; ready when it answers /health; the scrape and probes go to vLLM's own port."""
    docs = rendered(form)
    pods = roles(docs)
    decode, prefill = pods["decode"], pods["prefill"]
    sidecar, vllm = sidecar_of(decode), vllm_of(decode)
    ports = fact("guide.ports")
    env = container_env(vllm, configmaps(docs))
    argv = [expand(a, env, "decode") for a in [*vllm["command"], *vllm["args"]]]
    assert sidecar["restartPolicy"] == "Always", "a native sidecar: started before vLLM, stopped after it"
    assert int(option(sidecar["args"], "--port")) == ports["sidecar"]
    assert int(option(sidecar["args"], "--model-server-port")) == int(option(argv, "--port")) == ports["decode"]
    assert option(sidecar["args"], "--kv-connector") == "nixlv2"
    defaults = fact("sidecar.v0.10.0.defaults")
    assert defaults["secure-proxy"] is True and option(sidecar["args"], "--secure-proxy") == "false"
    assert defaults["enable-ssrf-protection"] is False and "enable-ssrf-protection" not in flag_names(sidecar["args"])
    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/health", "port": "sidecar"}
    assert {p["name"]: p["containerPort"] for p in sidecar["ports"]} == {"sidecar": ports["sidecar"]}
    assert {p["name"]: p["containerPort"] for p in vllm["ports"]}["http"] == ports["decode"]
    assert int(decode["metadata"]["annotations"]["prometheus.io/port"]) == ports["decode"]
    assert sidecar["securityContext"]["readOnlyRootFilesystem"] is True
    assert "initContainers" not in prefill["spec"]
    pargv = [expand(a, container_env(vllm_of(prefill), configmaps(docs)), "prefill") for a in vllm_of(prefill)["args"]]
    assert int(option(pargv, "--port")) == ports["prefill"]


def _probe(c: dict, name: str) -> dict:
    p = c[name]
    return {"path": p["httpGet"]["path"], **{k: v for k, v in p.items() if k != "httpGet"}}


@pytest.mark.parametrize("form", FORMS)
def test_vllm_runs_the_plugin_with_llm_ds_engine_settings(form: str) -> None:
    docs = rendered(form)
    cms = configmaps(docs)
    graceful, tp = fact("guide.graceful-shutdown"), fact("guide.tensor-parallel")
    block_sizes = set()
    for role, template in roles(docs).items():
        pod, vllm = template["spec"], vllm_of(template)
        env = container_env(vllm, cms)
        argv = [expand(a, env, role) for a in [*vllm["command"], *vllm["args"]]]
        assert argv[:2] == ["vllm", "serve"] and not vllm["image"].startswith("kvconnect"), role
        kvt = json.loads(option(argv, "--kv-transfer-config"))
        assert (kvt["kv_connector"], kvt["kv_connector_module_path"]) == ("KVConnectConnector", "kvconnect.vllm")
        assert kvt["kv_role"] == {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
        assert kvt["engine_id"] == "<KVCONNECT_ENGINE_ID>" and kvt["kv_connector_extra_config"] == {}
        if role == "decode":  # llm-d's recommendation; the trade-off is stated beside it (vllm-args.yaml)
            assert kvt["kv_load_failure_policy"] == fact("guide.kv-load-failure-policy")
            assert kvt["kv_load_failure_policy"] in fact("vllm.kv-load-failure-policy")
        gpus = int(vllm["resources"]["limits"]["nvidia.com/gpu"])
        assert int(vllm["resources"]["requests"]["nvidia.com/gpu"]) == gpus, "an extended resource: request = limit"
        assert int(option(argv, "--tensor-parallel-size")) == tp[role] == gpus, role
        block_sizes.add(int(option(argv, "--block-size")))
        assert fact("guide.hybrid-kv-cache-manager") in argv
        # graceful shutdown: preStop, then vLLM drains for --shutdown-timeout, inside the grace period
        assert vllm["lifecycle"]["preStop"]["exec"]["command"] == graceful["preStop"]
        assert int(option(argv, "--shutdown-timeout")) == graceful["shutdown-timeout"]
        assert pod["terminationGracePeriodSeconds"] == graceful["terminationGracePeriodSeconds"]
        assert pod["terminationGracePeriodSeconds"] >= int(graceful["preStop"][1]) + graceful["shutdown-timeout"] + 15
        for probe, expected in fact("guide.probes").items():
            assert _probe(vllm, probe) == expected, (role, probe)
            assert vllm[probe]["httpGet"]["port"] == "http"
        (shm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
        assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": fact("guide.shm")}
        assert env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] == fact("guide.keep-alive")["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"]
        # vLLM on torch 2.11 stops under a uid with no passwd entry unless USER (or LOGNAME) names a user
        uid = pod["securityContext"]["runAsUser"]
        assert uid != 0 and set(fact("guide.user-env")) <= set(env) and env["USER"] and env["LOGNAME"], role
        assert env["UCX_TLS"] == "all", "UCX picks RDMA where the pod has it, as llm-d leaves it"
        # the side channel: NixlConnector's port, kvconnect's TP ranks on the ports after it
        assert int(env["KVCONNECT_SIDE_CHANNEL_PORT"]) == fact("guide.nixl-port")
        assert {p["name"]: p["containerPort"] for p in vllm["ports"]}["side-channel"] == fact("guide.nixl-port")
    assert block_sizes == {fact("guide.block-size")}, "prefill and decode must use one block size"


@pytest.mark.parametrize("form", FORMS)
def test_the_decodes_dial_only_pod_networks_the_operator_lists(form: str) -> None:
    """peer-allowlist.env is the setting; its default covers private IPv4, the shared address space EKS custom
    networking and others draw pod ranges from, and IPv6 unique-local pod ranges; never the internet."""
    docs = rendered(form)
    env = container_env(vllm_of(roles(docs)["decode"]), configmaps(docs))
    setting = (DEPLOY / "overlays" / "llm-d" / "peer-allowlist.env").read_text()
    (line,) = [x for x in setting.splitlines() if x.startswith("KVCONNECT_PEER_ALLOWLIST=")]
    assert env["KVCONNECT_PEER_ALLOWLIST"] == line.split("=", 1)[1]
    allow = parse_allowlist(env["KVCONNECT_PEER_ALLOWLIST"])
    for host in ("10.244.1.7", "172.20.3.4", "192.168.9.9", "100.64.12.34", "100.127.255.1", "fd00:10:244::7"):
        assert allow.allows(host), host
    for host in ("8.8.8.8", "100.128.0.1", "2001:4860:4860::8888", "169.254.169.254"):
        assert not allow.allows(host), host
    assert "global unicast" in setting and "100.64.0.0/10" in setting  # (what is and is not covered, said)


def test_the_disaggregated_set_runs_the_deployment_forms_pods_rolled_as_llm_d_rolls_them() -> None:
    """One source of truth: each role's pod template is the Deployment form's, byte for byte (ConfigMap name
    included); the rollout keeps a decode serving in every slice (surge) and replaces prefills one at a time."""
    deployments = roles(rendered("overlays/llm-d"))
    docs = rendered("overlays/llm-d-ds")
    (ds,) = by_kind(docs, "DisaggregatedSet").values()
    assert roles(docs) == deployments
    rollout = {r["name"]: r["spec"]["rolloutStrategy"] for r in ds["spec"]["roles"]}
    for role, expected in fact("guide.ds.rollout").items():
        assert rollout[role] == {"type": "RollingUpdate", "rollingUpdateConfiguration": expected}, role
    assert ds["spec"]["slices"] >= 1
    for role in ds["spec"]["roles"]:
        assert role["spec"]["leaderWorkerTemplate"]["size"] == 1 and role["spec"]["replicas"] >= 1
    assert ds["metadata"]["labels"]["kvconnect.io/pool"] == "kvconnect-pd"


@pytest.mark.parametrize("form", FORMS)
def test_the_vllm_image_and_the_sidecar_image_are_pinned(form: str) -> None:
    pods = roles(rendered(form))
    images = {vllm_of(t)["image"] for t in pods.values()} | {sidecar_of(pods["decode"])["image"]}
    assert len(images) == 2 and all(image_tag(i) not in ("", "latest", "main") for i in images), images

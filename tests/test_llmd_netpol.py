"""The llm-d overlays' NetworkPolicies as a table: who reaches what, on which port (tests/netpol.py evaluates them).

The evaluator is checked first on the cases the NetworkPolicy API documents; then the rendered policies of both
llm-d forms, alone and with components/llm-d-gateway, against the whole expected table: llm-d's router (by its
chart's pod labels, in its release namespace) reaches both roles' serving port and KV events; Prometheus (in
llm-d's monitoring namespace) the prefill's and the decode's vLLM metrics; prefill and decode pods each other's
side channels, UCX ports and serving port; nobody the decode's vLLM port but Prometheus; nobody else anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.kube import DEPLOY, by_kind, kustomize_with
from tests.llmd import FORMS, RELEASE, fact, rendered, roles
from tests.netpol import Address, Pod, allowed, format_table, namespace_labels, reachability

NS = "serving"  # the namespace the pool and its router are installed in (any: the policies name none)
MONITORING = fact("guide.monitoring")["namespace"]
KV_EVENTS = fact("router.kv-events")["llm-d-port"]
SIDE = fact("guide.nixl-port")
SERVE, MODEL_SERVER = fact("guide.ports")["sidecar"], fact("guide.ports")["decode"]
PORTS = [SERVE, MODEL_SERVER, KV_EVENTS, SIDE, SIDE + 3, 9002, 41234]  # 5603: TP rank 3; 41234: a UCX port
ROUTER = {k: v.replace("<release>", RELEASE) for k, v in fact("router.pod-labels")["pool-created"].items()}


def _policy(rules: list[dict[str, Any]], selector: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"metadata": {"namespace": "a"}, "spec": {"podSelector": selector or {}, "ingress": rules}}


def test_the_evaluator_follows_the_documented_semantics() -> None:
    web = Pod("web", "a", {"app": "web"}, {"http": 8080})
    friend, stranger = Pod("friend", "a", {"role": "client"}), Pod("stranger", "a", {"role": "other"})
    elsewhere = Pod("elsewhere", "b", {"role": "client"})
    ns_b = {"b": namespace_labels("b", {"team": "x"})}
    assert allowed([], web, 80, stranger), "no policy: not isolated"
    assert not allowed([_policy([])], web, 80, friend), "selected with no rules: deny all"
    assert allowed([_policy([{}])], web, 80, stranger), "an empty rule: everything"
    only_friends = _policy([{"from": [{"podSelector": {"matchLabels": {"role": "client"}}}]}])
    assert allowed([only_friends], web, 80, friend) and not allowed([only_friends], web, 80, stranger)
    assert not allowed([only_friends], web, 80, elsewhere), "a podSelector alone: the policy's namespace"
    any_ns = _policy([{"from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"role": "client"}}}]}])
    assert allowed([any_ns], web, 80, elsewhere), "an empty namespaceSelector: every namespace"
    team = _policy([{"from": [{"namespaceSelector": {"matchLabels": {"team": "x"}}}]}])
    assert allowed([team], web, 80, elsewhere, ns_labels=ns_b) and not allowed([team], web, 80, friend)
    two_peers = _policy([{"from": [{"namespaceSelector": {"matchLabels": {"team": "x"}}}, {"podSelector": {}}]}])
    assert allowed([two_peers], web, 80, friend), "from entries are alternatives"
    ports = _policy([{"ports": [{"port": "http"}, {"port": 9000, "endPort": 9010}, {"port": 53, "protocol": "UDP"}]}])
    assert allowed([ports], web, 8080, stranger) and allowed([ports], web, 9010, stranger)
    assert not allowed([ports], web, 9011, stranger) and not allowed([ports], web, 53, stranger)
    assert allowed([ports], web, 53, stranger, protocol="UDP")
    cidr = _policy([{"from": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}}]}])
    assert allowed([cidr], web, 80, Address("lb", "10.2.3.4")) and not allowed(
        [cidr], web, 80, Address("x", "10.1.2.3")
    )
    assert not allowed([cidr], web, 80, friend), "an ipBlock matches addresses, not pods here"
    exprs = {"matchExpressions": [{"key": "role", "operator": "NotIn", "values": ["other"]}]}
    assert allowed([_policy([{"from": [{"podSelector": exprs}]}])], web, 80, friend)
    assert not allowed([_policy([{"from": [{"podSelector": exprs}]}])], web, 80, stranger)
    egress_only = {"metadata": {"namespace": "a"}, "spec": {"podSelector": {}, "policyTypes": ["Egress"]}}
    assert allowed([egress_only], web, 80, stranger), "an Egress-only policy does not isolate ingress"
    other_ns = {**_policy([]), "metadata": {"namespace": "b"}}
    assert allowed([other_ns], web, 80, stranger), "a policy of another namespace does not select this pod"


def _actors(docs: list[dict[str, Any]]) -> tuple[list[Pod], list[Any]]:
    pods = roles(docs)
    ports = {
        r: {p["name"]: p["containerPort"] for c in t["spec"]["containers"] for p in c.get("ports", [])}
        for r, t in pods.items()
    }
    prefill = Pod("prefill", NS, pods["prefill"]["metadata"]["labels"], ports["prefill"])
    decode = Pod("decode", NS, pods["decode"]["metadata"]["labels"], ports["decode"])
    nixl_labels = {**fact("guide.pod-labels"), "llm-d.ai/role": "decode"}
    standalone = {k: v.replace("<release>", RELEASE) for k, v in fact("router.pod-labels")["pool-not-created"].items()}
    proxy = {k: v.replace("<release>", RELEASE) for k, v in fact("router.pod-labels")["service-mode-proxy"].items()}
    sources = [
        prefill,
        decode,
        Pod("router", NS, ROUTER),  # the endpoint picker (and its Envoy sidecar), the chart's default
        Pod("router-no-pool", NS, standalone),  # router.inferencePool.create=false
        Pod("router-proxy", NS, proxy),  # the service-mode Envoy Deployment
        Pod("router-elsewhere", "other", ROUTER),  # the same labels in another namespace
        Pod("other-release-router", NS, {"llm-d-router-gateway": "pd-disaggregation-epp"}),  # llm-d's own router
        Pod("prometheus", MONITORING, {"app.kubernetes.io/name": "prometheus"}),
        Pod("prometheus-elsewhere", "other", {"app.kubernetes.io/name": "prometheus"}),
        Pod("nixl-decode", NS, nixl_labels),  # a NixlConnector pool's decode beside ours
        Pod("old-client-label", "other", {"kvconnect.io/client": "true"}),  # what the old policies admitted
        Pod("gateway", NS, {"gateway.networking.k8s.io/gateway-name": "llm-d-inference-gateway"}),
        Address("gke-health-check", "35.191.10.20"),
        Address("internet", "203.0.113.7"),
    ]
    return [prefill, decode], sources


# the expected table: (source, destination) -> ports reached, of PORTS; anything not listed reaches nothing
PEERS = {SERVE, KV_EVENTS, SIDE, SIDE + 3, 9002, 41234}  # every port but 8200 (the decode's vLLM)
BASE = {
    **{(s, d): PEERS for s in ("prefill", "decode") for d in ("prefill", "decode")},
    **{(r, d): {SERVE, KV_EVENTS} for r in ("router", "router-no-pool", "router-proxy") for d in ("prefill", "decode")},
    ("prometheus", "prefill"): {SERVE},
    ("prometheus", "decode"): {MODEL_SERVER},
}
GATEWAY = {
    ("gateway", "decode"): {SERVE},
    ("gke-health-check", "prefill"): {SERVE},
    ("gke-health-check", "decode"): {SERVE},
}


def _check(docs: list[dict[str, Any]], expected: dict[tuple[str, str], set[int]]) -> None:
    policies = list(by_kind(docs, "NetworkPolicy").values())
    dests, sources = _actors(docs)
    ns_labels = {n: namespace_labels(n) for n in (NS, MONITORING, "other")}
    table = reachability(policies, dests, sources, PORTS, ns_labels)
    want = {key: expected.get(key, set()) for key in table}
    text = format_table(table, [s.name for s in sources], [d.name for d in dests])
    wrong = {k: (table[k], want[k]) for k in table if table[k] != want[k]}
    assert not wrong, f"(reached, expected) where they differ: {wrong}\n{text}"


@pytest.mark.parametrize("form", FORMS)
def test_who_reaches_what_in_the_llm_d_overlays(form: str) -> None:
    _check(rendered(form), BASE)


def test_who_reaches_what_with_a_gateway_in_front(tmp_path: Path) -> None:
    docs = kustomize_with(tmp_path, DEPLOY / "overlays" / "llm-d", [DEPLOY / "components" / "llm-d-gateway"])
    _check(docs, {**BASE, **GATEWAY})


@pytest.mark.parametrize("form", FORMS)
def test_every_namespace_selector_names_its_namespace(form: str) -> None:
    """No policy admits a label from every namespace: each namespaceSelector pins `kubernetes.io/metadata.name`
    (a label Kubernetes sets and nobody can give another namespace); peers without one are this namespace's."""
    pinned = 0
    for name, policy in by_kind(rendered(form), "NetworkPolicy").items():
        assert policy["spec"]["policyTypes"] == ["Ingress"], name
        for rule in policy["spec"]["ingress"]:
            assert rule.get("from") and rule.get("ports"), f"{name}: a rule open to every source or port"
            for peer in rule["from"]:
                if "namespaceSelector" in peer:
                    labels = peer["namespaceSelector"].get("matchLabels", {})
                    assert set(peer["namespaceSelector"]) == {"matchLabels"}, name
                    assert list(labels) == ["kubernetes.io/metadata.name"], f"{name}: {peer}"
                    assert "podSelector" in peer, f"{name}: every pod of a namespace"
                    pinned += 1
    assert pinned == 2  # (Prometheus, to each role)

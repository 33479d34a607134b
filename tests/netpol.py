"""A small evaluator of Kubernetes NetworkPolicy ingress semantics, for tests that ask "who reaches what".

It follows the API's documented meaning (networking.k8s.io/v1):
- a pod is isolated for ingress when some policy of its namespace selects it (`podSelector`) and has `Ingress` in
  its `policyTypes` (or omits them and has `ingress` rules); an isolated pod accepts a connection only when some
  such policy has a rule whose `from` and `ports` both match; a pod no policy isolates accepts everything;
- a rule with no `from` matches every source, with no `ports` every port; `from` entries are alternatives;
- a peer with `podSelector` alone means pods of the policy's namespace; with `namespaceSelector` alone every pod of
  the namespaces it selects; with both, the pods it selects in those namespaces; `ipBlock` an address range
  (minus `except`), for sources that are not pods here (pod IPs are not modelled: pods match by labels only);
- label selectors: `matchLabels` and `matchExpressions` (In, NotIn, Exists, DoesNotExist), all ANDed; an empty
  selector selects everything; every namespace carries `kubernetes.io/metadata.name: <its name>`;
- ports: `protocol` defaults to TCP; `port` is a number or a container port's name (resolved on the destination
  pod), `endPort` extends a numeric port to a range.

Egress is out of scope (the policies under test govern ingress only).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Selector = Mapping[str, Any]


class PolicyError(ValueError):
    """A policy uses something this evaluator does not model (it refuses rather than guess)."""


@dataclass(frozen=True)
class Pod:
    """A destination or source pod: its namespace, labels and named container ports."""

    name: str
    namespace: str
    labels: Mapping[str, str]
    named_ports: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Address:
    """A source that is not a pod of the cluster: a node, a load balancer's health checker, the internet."""

    name: str
    ip: str


Source = Pod | Address


def namespace_labels(namespace: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The labels a namespace has: the one Kubernetes always sets, and any given."""
    return {"kubernetes.io/metadata.name": namespace, **(extra or {})}


def selects(selector: Selector | None, labels: Mapping[str, str]) -> bool:
    """Whether a LabelSelector selects an object with `labels` (an empty or missing selector selects all)."""
    if not selector:
        return True
    unknown = set(selector) - {"matchLabels", "matchExpressions"}
    if unknown:
        raise PolicyError(f"label selector fields {sorted(unknown)}")
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], list(expr.get("values") or [])
        if op == "In":
            ok = key in labels and labels[key] in values
        elif op == "NotIn":
            ok = key not in labels or labels[key] not in values
        elif op == "Exists":
            ok = key in labels
        elif op == "DoesNotExist":
            ok = key not in labels
        else:
            raise PolicyError(f"selector operator {op!r}")
        if not ok:
            return False
    return True


def _peer_matches(
    peer: Mapping[str, Any], source: Source, policy_ns: str, ns_labels: Mapping[str, Mapping[str, str]]
) -> bool:
    unknown = set(peer) - {"podSelector", "namespaceSelector", "ipBlock"}
    if unknown:
        raise PolicyError(f"peer fields {sorted(unknown)}")
    if "ipBlock" in peer:
        if set(peer) != {"ipBlock"}:
            raise PolicyError("ipBlock combined with a selector")
        if not isinstance(source, Address):
            return False
        ip = ipaddress.ip_address(source.ip)
        block = peer["ipBlock"]
        if ip not in ipaddress.ip_network(block["cidr"]):
            return False
        return not any(ip in ipaddress.ip_network(e) for e in block.get("except") or [])
    if not isinstance(source, Pod):
        return False
    if "namespaceSelector" in peer:
        labels = ns_labels.get(source.namespace, namespace_labels(source.namespace))
        if not selects(peer["namespaceSelector"], labels):
            return False
    elif source.namespace != policy_ns:
        return False
    return "podSelector" not in peer or selects(peer["podSelector"], source.labels)


def _port_matches(spec: Mapping[str, Any], dest: Pod, port: int, protocol: str) -> bool:
    if spec.get("protocol", "TCP") != protocol:
        return False
    if "port" not in spec:
        return True
    value = spec["port"]
    if isinstance(value, str) and not value.isdigit():
        if "endPort" in spec:
            raise PolicyError(f"endPort with the named port {value!r}")
        return dest.named_ports.get(value) == port
    low = int(value)
    return low <= port <= int(spec.get("endPort", low))


def _isolates(policy: Mapping[str, Any]) -> bool:
    spec = policy["spec"]
    types = spec.get("policyTypes")
    if types is None:
        return True  # (Ingress is implied when policyTypes are left out)
    return "Ingress" in types


def allowed(
    policies: Iterable[Mapping[str, Any]],
    dest: Pod,
    port: int,
    source: Source,
    protocol: str = "TCP",
    ns_labels: Mapping[str, Mapping[str, str]] | None = None,
) -> bool:
    """Whether `source` may open a connection to `dest` on `port` under `policies` (ingress only)."""
    namespaces = dict(ns_labels or {})
    isolating = [
        p
        for p in policies
        if p.get("metadata", {}).get("namespace", dest.namespace) == dest.namespace
        and _isolates(p)
        and selects(p["spec"].get("podSelector"), dest.labels)
    ]
    if not isolating:
        return True
    for policy in isolating:
        ns = policy.get("metadata", {}).get("namespace", dest.namespace)
        for rule in policy["spec"].get("ingress") or []:
            peers: Sequence[Mapping[str, Any]] = rule.get("from") or []
            ports: Sequence[Mapping[str, Any]] = rule.get("ports") or []
            from_ok = not peers or any(_peer_matches(p, source, ns, namespaces) for p in peers)
            port_ok = not ports or any(_port_matches(s, dest, port, protocol) for s in ports)
            if from_ok and port_ok:
                return True
    return False


def reachability(
    policies: Sequence[Mapping[str, Any]],
    dests: Sequence[Pod],
    sources: Sequence[Source],
    ports: Sequence[int],
    ns_labels: Mapping[str, Mapping[str, str]] | None = None,
) -> dict[tuple[str, str], set[int]]:
    """{(source name, destination name): the ports of `ports` it may reach} for every pair."""
    return {
        (s.name, d.name): {p for p in ports if allowed(policies, d, p, s, ns_labels=ns_labels)}
        for s in sources
        for d in dests
    }


def format_table(table: Mapping[tuple[str, str], set[int]], sources: Sequence[str], dests: Sequence[str]) -> str:
    """The table as text, one line per source: what a failing assertion prints."""
    width = max(len(s) for s in sources)
    lines = [" " * width + " | " + " | ".join(dests)]
    for s in sources:
        cells = [",".join(str(p) for p in sorted(table[(s, d)])) or "-" for d in dests]
        lines.append(s.ljust(width) + " | " + " | ".join(cells))
    return "\n".join(lines)

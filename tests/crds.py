"""Validating the custom resources deploy/ renders, without their CRDs installed anywhere.

The schemas in tests/data/crd-schemas/ are ours, written from the fields of the upstream CRDs at the commits their
`$comment` names (DisaggregatedSet of LeaderWorkerSet; PodMonitor and PrometheusRule of the Prometheus operator):
unknown fields are refused, as the apiserver's strict field validation (kubectl's default) refuses them. What a
JSON schema cannot say is checked here: pod templates inside a DisaggregatedSet are validated as core/v1
PodTemplates with the Kubernetes schemas, the DisaggregatedSet's replicas rule (its CRD's CEL rule), and unique
PrometheusRule group names (a list-map key).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.image_build import INSTALL_HINT
from tests.kube import Doc, k8s_validate

SCHEMAS = Path(__file__).resolve().parent / "data" / "crd-schemas"
KINDS = {
    ("disaggregatedset.x-k8s.io/v1", "DisaggregatedSet"): "disaggregatedset",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule",
}


def is_custom(doc: Doc) -> bool:
    """Whether `doc` is of a custom kind we hold a schema for (any other kind goes to the Kubernetes schemas,
    which refuse one they do not know)."""
    return (doc["apiVersion"], doc["kind"]) in KINDS


def _validator(name: str) -> Any:
    try:
        import jsonschema
    except ImportError:
        pytest.fail(f"jsonschema is missing: {INSTALL_HINT}")
    schema = json.loads((SCHEMAS / f"{name}.schema.json").read_text())
    return jsonschema.Draft202012Validator(schema)


def crd_validate(doc: Doc) -> None:
    """AssertionError naming the object and the field unless `doc` is a valid custom resource of a known kind."""
    key = (doc["apiVersion"], doc["kind"])
    where = f"{doc['kind']}/{doc['metadata']['name']}"
    assert key in KINDS, f"{where}: no schema for {key[0]} {key[1]} in {SCHEMAS}"
    errors = sorted(_validator(KINDS[key]).iter_errors(doc), key=lambda e: list(e.absolute_path))
    assert not errors, f"{where}: " + "; ".join(f"{e.message} at {list(e.absolute_path)}" for e in errors)
    if doc["kind"] == "DisaggregatedSet":
        _check_disaggregated_set(doc, where)
    if doc["kind"] == "PrometheusRule":
        names = [g["name"] for g in doc["spec"].get("groups", [])]
        assert len(names) == len(set(names)), f"{where}: group names repeat: {names}"


def _check_disaggregated_set(doc: Doc, where: str) -> None:
    roles = doc["spec"]["roles"]
    names = [r["name"] for r in roles]
    assert len(names) == len(set(names)), f"{where}: role names repeat: {names}"
    static = [r for r in roles if r.get("scaling", {}).get("mode", "Static") != "External"]
    nonzero = [r["spec"].get("replicas", 1) > 0 for r in static]
    assert all(nonzero) or not any(nonzero), f"{where}: replicas must be zero for all roles or for none"
    for role in roles:
        lwt = role["spec"]["leaderWorkerTemplate"]
        for key in ("leaderTemplate", "workerTemplate"):
            if key in lwt:
                template = {
                    "apiVersion": "v1",
                    "kind": "PodTemplate",
                    "metadata": {"name": f"{doc['metadata']['name']}-{role['name']}-{key}"},
                    "template": lwt[key],
                }
                k8s_validate([template])


def validate_all(docs: list[Doc]) -> None:
    """Every rendered object: the Kubernetes schemas for built-in kinds, ours for custom ones."""
    k8s_validate([d for d in docs if not is_custom(d)])
    for doc in docs:
        if is_custom(doc):
            crd_validate(doc)

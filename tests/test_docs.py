"""The documents hold: the README's snippet and the example run as written, the configuration page is
what its generator writes, and every page the README links to exists."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import msgspec

from kvconnect.core.config import ConnectorConfig

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def run_python(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "NIXL_LOG_LEVEL": "WARN"},
    )


def test_the_readme_starts_with_its_two_commands_and_stays_short() -> None:
    first = re.search(r"```bash\n(.*?)```", README, re.S)
    assert first is not None and README.index(first.group(0)) < 40
    assert [line.split("#")[0].strip() for line in first.group(1).splitlines()] == [
        "bash scripts/dev.sh demo",
        "bash scripts/dev.sh test",
    ]
    assert len(README.split()) <= 850


def test_the_readme_library_snippet_runs_as_written() -> None:
    (snippet,) = re.findall(r"```python\n(.*?)```", README, re.S)
    done = run_python("-c", snippet)
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"^\d+ bytes in 1 descriptor\(s\)$", done.stdout, re.M), done.stdout


def test_the_two_process_example_pulls_byte_exact() -> None:
    done = run_python("examples/two_process_pull.py")
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert "bytes equal: True" in done.stdout and "ended completed" in done.stdout, done.stdout


def test_the_configuration_page_is_generated_from_the_settings() -> None:
    done = run_python("scripts/config_doc.py", "--check")
    assert done.returncode == 0, done.stderr
    page = (ROOT / "docs" / "configuration.md").read_text()
    for field in msgspec.structs.fields(ConnectorConfig):
        (row,) = [line for line in page.splitlines() if line.startswith(f"| `{field.name}` |")]
        assert f"`KVCONNECT_{field.name.upper()}`" in row
        assert row.rstrip(" |").rsplit("|", 1)[-1].strip(), f"{field.name} has no meaning in config.py"


def test_every_page_the_docs_link_to_exists() -> None:
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#\s]+)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to missing {target}"

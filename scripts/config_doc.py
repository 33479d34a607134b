"""Write docs/configuration.md from `kvconnect.core.config.ConnectorConfig`: every field, its KVCONNECT_*
variable, its default and what it means (the comments beside and above the field in config.py).

    python scripts/config_doc.py            # rewrite docs/configuration.md
    python scripts/config_doc.py --check    # exit 1 if docs/configuration.md is not what this writes
"""

from __future__ import annotations

import ast
import enum
import io
import sys
import tokenize
from pathlib import Path

import msgspec

from kvconnect.core.config import ENV_PREFIX, ConnectorConfig

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "kvconnect" / "core" / "config.py"
OUT = ROOT / "docs" / "configuration.md"

HEADER = """# Configuration

Every setting of a kvconnect connector (`kvconnect.ConnectorConfig`), wherever it runs: the variable
`KVCONNECT_<NAME>` sets it for kvconnect's workers and containers, `connector_config(name=value)` in code,
and `kv_connector_extra_config` inside vLLM (the same names). Most have a `kvconnect serve` flag of the
same name as well (`--lease-ttl-s`). A bad value stops start-up with one line naming the setting.

Generated from `kvconnect/core/config.py` by `python scripts/config_doc.py`; a test keeps it in sync.

| setting | variable | default | meaning |
|---|---|---|---|
"""


def comments() -> dict[str, str]:
    """{field: its comment}: the comment lines right above the field, then the one at the end of its line."""
    text = SOURCE.read_text()
    by_line: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            by_line[tok.start[0]] = tok.string.lstrip("#").strip()
    (cls,) = [n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == "ConnectorConfig"]
    out = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            above, line = [], node.lineno - 1
            while line in by_line and text.splitlines()[line - 1].strip().startswith("#"):
                above.insert(0, by_line[line])
                line -= 1
            parts = [*above, by_line.get(node.lineno, "")]
            out[node.target.id] = " ".join(p for p in parts if p)
    return out


def default_text(value: object) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    if value == "":
        return '`""`'
    return f"`{str(value).lower() if isinstance(value, bool) else value}`"


def render() -> str:
    meaning = comments()
    rows = []
    for f in msgspec.structs.fields(ConnectorConfig):
        text = meaning.get(f.name, "").replace("|", "\\|")
        if isinstance(f.default, enum.Enum):
            text += " One of " + ", ".join(f"`{m.value}`" for m in type(f.default)) + "."
        rows.append(f"| `{f.name}` | `{ENV_PREFIX}{f.name.upper()}` | {default_text(f.default)} | {text.strip()} |")
    return HEADER + "\n".join(rows) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is out of date: run python scripts/config_doc.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

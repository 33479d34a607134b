"""Every measured figure the README and docs/ cite is what a committed run measured.

A cited figure is marked by being the text of a link into results/ (`[0.96-1.04 ms](results/gpu/h2h-fair/README.md)`).
results/README.md's catalogue has a row per figure: the pages that cite it, the figure, the raw files it comes from
and the command. The tests hold the three together: every number of a figure link is in a catalogue row for that
page and folder, every number of a row is in the row's files (as printed or rounded, or scaled: seconds to ms,
bytes to MB, a percentage to a ratio), every row's files exist and every row is cited; and a time, throughput,
percentage or ratio outside such a link is a figure nobody can check, so the README and docs have none.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
CATALOGUE = RESULTS / "README.md"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

LINK = re.compile(r"\[([^\]]+)\]\(([^)\s#]+)[^)]*\)")
NUMBER = re.compile(r"\d+(?:,\d{3})*(?:\.\d+)?")
FILE_NUMBER = re.compile(r"\d+(?:,\d{3})*(?:\.\d+)?(?:[eE][-+]?\d+)?")
# as printed; s -> ms; ms -> s; bytes -> MB; % -> ratio; ratio -> %
SCALES = (Decimal(1), Decimal(1000), Decimal("0.001"), Decimal("0.000001"), Decimal("0.01"), Decimal(100))
UNMARKED = re.compile(
    r"(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?(?:-\d+(?:,\d{3})*(?:\.\d+)?)? ?(?:ms|us|µs|GB/s|TB/s|%)(?!\w)"
)
UNMARKED_X = re.compile(r"(?<![\w.])\d+(?:\.\d+)?x(?!\w)")
NOT_MEASURED = {  # bounds the code sets, not results: (page, the phrase)
    ("docs/vllm.md", "up to 5 ms each time"),  # Python's default thread switch interval
    ("docs/vllm.md", "waits up to 5 ms for a pull"),  # the plug-in's idle wait
    ("docs/operations.md", "more than 5 % of its pulls"),  # alert thresholds (deploy/components/monitoring)
    ("docs/operations.md", "more than 10 % of a prefill's ended leases"),
}


def numbers(text: str) -> list[str]:
    """The numbers a text states: not the digits of a name (H200, p99, Llama-3-8B, vllm026), commas dropped."""
    found = []
    for m in NUMBER.finditer(text):
        before = text[m.start() - 2 : m.start()].rjust(2)
        after = text[m.end() : m.end() + 2].ljust(2)
        if before[1].isalnum() or before[1] in "._" or (before[1] == "-" and before[0].isalpha()):
            continue
        if after[0].isalpha() and not (after[0] == "x" and not after[1].isalnum()):  # (1.6x is a number, 8B not)
            continue
        found.append(m.group(0).replace(",", ""))
    return found


def prose(text: str) -> str:
    """The text without code blocks and code spans (commands, paths and example output are not citations)."""
    text = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    return re.sub(r"`[^`\n]*`", "``", text)


@dataclass(frozen=True)
class Figure:
    page: str  # "README.md", "docs/vllm.md"
    text: str
    target: Path

    @property
    def numbers(self) -> set[str]:
        return set(numbers(self.text))


@dataclass(frozen=True)
class Row:
    line: int
    pages: tuple[str, ...]
    figure: str
    files: tuple[str, ...]
    command: str

    def matches(self, fig: Figure) -> bool:
        """This row can be the catalogue's entry for that figure link."""
        folder = fig.target if fig.target.is_dir() or fig.target.name != "README.md" else fig.target.parent
        here = any((RESULTS / f).resolve().is_relative_to(folder.resolve()) for f in self.files)
        return fig.page in self.pages and here and fig.numbers <= set(numbers(self.figure))


def figures() -> list[Figure]:
    out = []
    for page in PAGES:
        name = str(page.relative_to(ROOT))
        for m in LINK.finditer(prose(page.read_text())):
            target = (page.parent / m.group(2)).resolve()
            if target.is_relative_to(RESULTS.resolve()) and numbers(m.group(1)):
                out.append(Figure(name, " ".join(m.group(1).split()), target))
    return out


def rows() -> list[Row]:
    lines = CATALOGUE.read_text().splitlines()
    start = lines.index("## Cited figures")
    out = []
    for i, line in enumerate(lines[start:], start + 1):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| ") or len(cells) != 4 or cells[0] == "cited in" or set(cells[0]) <= set("-: "):
            continue
        pages = tuple(re.findall(r"README\.md|docs/[\w-]+\.md", cells[0]))
        out.append(Row(i, pages, cells[1], tuple(re.findall(r"`([^`]+)`", cells[2])), cells[3]))
    return out


@functools.cache
def printed(path: Path) -> frozenset[tuple[int, Decimal]]:
    """Every number in a file, rounded to 0-3 decimals, as printed and scaled by each of SCALES."""
    out = set()
    for m in FILE_NUMBER.finditer(path.read_text(errors="replace")):
        try:
            value = Decimal(m.group(0).replace(",", ""))
        except InvalidOperation:
            continue
        for scale in SCALES:
            for places in range(4):
                out.add((places, (value * scale).quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_UP)))
    return frozenset(out)


def held_by(number: str, files: tuple[str, ...]) -> bool:
    value = Decimal(number)
    places = max(-value.as_tuple().exponent, 0)
    return any((places, value) in printed(RESULTS / f) for f in files if places < 4)


def test_the_catalogue_has_rows_and_the_pages_have_figure_links() -> None:
    assert len(rows()) >= 20 and len(figures()) >= 40  # (a parser that finds nothing passes nothing)


@pytest.mark.parametrize("row", rows(), ids=lambda r: f"line{r.line}")
def test_a_catalogue_row_names_its_pages_files_and_command_and_its_files_hold_its_numbers(row: Row) -> None:
    assert row.pages and row.files and row.command, f"results/README.md:{row.line} lacks a page, a file or a command"
    for f in row.files:
        assert (RESULTS / f).is_file(), f"results/README.md:{row.line} names results/{f}, which does not exist"
    missing = [n for n in numbers(row.figure) if not held_by(n, row.files)]
    assert not missing, f"results/README.md:{row.line}: {missing} are in none of {row.files}"


def test_every_figure_the_readme_and_docs_cite_is_in_the_catalogue() -> None:
    catalogue = rows()
    lacking = [f for f in figures() if not f.target.exists() or not any(r.matches(f) for r in catalogue)]
    assert not lacking, "figures with no catalogue row (page, link text, numbers): " + "; ".join(
        f"{f.page}: [{f.text}] {sorted(f.numbers)}" for f in lacking
    )


def test_every_catalogue_row_is_cited_where_it_says() -> None:
    cited = figures()
    stale = [(r.line, p) for r in rows() for p in r.pages if not any(r.matches(f) for f in cited if f.page == p)]
    assert not stale, f"catalogue rows (line, page) that page does not cite: {stale}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_timing_throughput_or_ratio_is_cited_without_its_link(page: Path) -> None:
    name = str(page.relative_to(ROOT))
    text = LINK.sub("", prose(page.read_text()))
    for phrase in (p for pg, p in NOT_MEASURED if pg == name):
        text = text.replace(phrase, "")
    found = UNMARKED.findall(text) + UNMARKED_X.findall(text)
    assert not found, f"{name} cites {found} without a link to the results they come from"


def test_the_readme_speed_paragraph_says_what_was_measured() -> None:
    readme = (ROOT / "README.md").read_text()
    speed = readme[readme.index("**Speed**") :].split("\n\n")[0]
    for words in ("same-host", "CUDA IPC gather", "lease board", "one shared H200", "random weights",
                  "Llama-3-8B's KV shape", "hidden size 1,024", "less compute", "run per cell", "NIXL"):  # fmt: skip
        assert words in speed, f"the README's speed paragraph does not say {words!r}"

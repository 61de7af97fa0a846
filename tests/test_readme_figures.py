"""Every measured figure in README's "Measured on an H200" table comes from a committed
result file under benchmarks/results/ (copied exactly, not rounded or remembered)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## Measured on an H200"

NUMBER = r"\d[\d,]*(?:\.\d+)?"
# "1 / 8 / 256 us" gives each number the unit; "x" (a ratio) only right after the number, so
# that "64 x 8k" is not read as a ratio of 64.
UNIT = r"(?:µs|us|ms|s|TB/s|TFLOP/s|M/s|k/s|pairs/s|%)"
WITH_UNIT = re.compile(rf"({NUMBER}(?:\s*/\s*{NUMBER})*)\s*{UNIT}(?![A-Za-z/])|({NUMBER})x(?![A-Za-z])")


def figures(text: str) -> list[str]:
    """Every number that carries a unit in text, as written ('1,713,663', '0.188', '4.41')."""
    out = []
    for m in WITH_UNIT.finditer(text):
        group = m.group(1) or m.group(2)
        out += [n.strip() for n in group.split("/")]
    return out


def section_table(readme: str) -> str:
    start = readme.index(SECTION)
    end = readme.find("\n## ", start + len(SECTION))
    body = readme[start:end if end >= 0 else len(readme)]
    return "\n".join(line for line in body.splitlines() if line.startswith("|"))


def results_text() -> str:
    files = [p for p in (ROOT / "benchmarks" / "results").iterdir() if p.suffix in (".md", ".log", ".txt")]
    assert files, "no result files under benchmarks/results"
    return "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files)


def holds(text: str, number: str) -> bool:
    """number appears in text as a whole number (0.48 not inside 10.48 or 0.481)."""
    return re.search(rf"(?<![\d.,]){re.escape(number)}(?![\d]|[.,]\d)", text) is not None


def test_parser_reads_units_and_lists() -> None:
    assert figures("25.76 / 81.76 / 1910 us, 4.41 TB/s (95.38 % of it), 0.188 µs") == [
        "25.76", "81.76", "1910", "4.41", "95.38", "0.188"]
    assert figures("1,713,663 pairs/s; 0.9x SDPA; 64 x 8k; block 16; 8 splits") == ["1,713,663", "0.9"]
    assert holds("| 10.48 | 0.481 | 0.48 / 0.46 |", "0.48") and not holds("| 10.48 | 0.481 |", "0.48")


def test_every_figure_of_the_measured_table_is_in_a_result_file() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = section_table(readme)
    found = figures(table)
    # Most cells hold figures: a table the parser cannot read must not pass by finding none.
    assert len(found) >= 30, f"only {len(found)} figures parsed from the table:\n{table}"
    results = results_text()
    missing = sorted({f for f in found if not holds(results, f)})
    assert not missing, (f"README figures {missing} are in no file under benchmarks/results/; copy them from a "
                         "result file exactly, or drop them")


def test_the_ceilings_line_is_checked_too() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    start = readme.index(SECTION)
    line = next(ln for ln in readme[start:].splitlines() if ln.startswith("Ceilings measured"))
    found = figures(line)
    assert len(found) == 3
    results = results_text()
    assert all(holds(results, f) for f in found), f"ceilings {found} not all in benchmarks/results/"

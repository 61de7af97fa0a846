"""Every measured figure the README and docs/benchmarks.md quote comes from a committed record under
benchmarks/results/ (copied exactly, not rounded or remembered):

* README's "Results" table: each figure of a row is in the record(s) that row links;
* README's line on the test job's time: its minutes are in the record it links;
* docs/benchmarks.md's "Measured on an H200" table and its ceilings line: each figure is in some record."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
BENCHMARKS_DOC = ROOT / "docs" / "benchmarks.md"

NUMBER = r"\d[\d,]*(?:\.\d+)?"
# "1 / 8 / 256 us" gives each number the unit; "x" (a ratio) only right after the number, so
# that "64 x 8k" is not read as a ratio of 64.
UNIT = r"(?:µs|us|ms|s|TB/s|TFLOP/s|M/s|k/s|pairs/s|tok/s|req/s|%)"
WITH_UNIT = re.compile(rf"({NUMBER}(?:\s*/\s*{NUMBER})*)\s*{UNIT}(?![A-Za-z/])|({NUMBER})x(?![A-Za-z])")
RECORD_LINK = re.compile(r"\]\((?:\.\./)?benchmarks/results/([^)#\s]+)\)")


def figures(text: str) -> list[str]:
    """Every number that carries a unit in text, as written ('1,713,663', '0.188', '4.41')."""
    out = []
    for m in WITH_UNIT.finditer(text):
        group = m.group(1) or m.group(2)
        out += [n.strip() for n in group.split("/")]
    return out


def section(text: str, title: str) -> str:
    start = text.index(title)
    end = text.find("\n## ", start + len(title))
    return text[start:end if end >= 0 else len(text)]


def table_rows(body: str) -> list[str]:
    return [line for line in body.splitlines() if line.startswith("|") and not line.startswith("| ---")][1:]


def results_text() -> str:
    files = [p for p in RESULTS.iterdir() if p.suffix in (".md", ".log", ".txt")]
    assert files, "no result files under benchmarks/results"
    return "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files)


def holds(text: str, number: str) -> bool:
    """number appears in text as a whole number (0.48 not inside 10.48 or 0.481)."""
    return re.search(rf"(?<![\d.,]){re.escape(number)}(?![\d]|[.,]\d)", text) is not None


def test_parser_reads_units_and_lists() -> None:
    assert figures("25.76 / 81.76 / 1910 us, 4.41 TB/s (95.38 % of it), 0.188 µs, 6174 tok/s") == [
        "25.76", "81.76", "1910", "4.41", "95.38", "0.188", "6174"]
    assert figures("1,713,663 pairs/s; 0.9x SDPA; 64 x 8k; block 16; 8 splits") == ["1,713,663", "0.9"]
    assert figures("4.5 req/s at 99 % (10x idle)") == ["4.5", "99", "10"]
    assert holds("| 10.48 | 0.481 | 0.48 / 0.46 |", "0.48") and not holds("| 10.48 | 0.481 |", "0.48")
    assert RECORD_LINK.findall("[a](benchmarks/results/x_h200.md) [b](../benchmarks/results/y.log)") == [
        "x_h200.md", "y.log"]


def test_each_results_row_quotes_the_records_it_links() -> None:
    rows = table_rows(section(README.read_text(encoding="utf-8"), "## Results"))
    assert len(rows) >= 5, rows
    total = 0
    for row in rows:
        records = RECORD_LINK.findall(row)
        assert records, f"a Results row links no record: {row}"
        text = "\n".join((RESULTS / r).read_text(encoding="utf-8", errors="replace") for r in records)
        found = figures(row)
        assert found, f"a Results row quotes no figure: {row}"
        missing = [f for f in found if not holds(text, f)]
        assert not missing, f"{missing} are not in {records}; copy them from the record exactly:\n{row}"
        total += len(found)
    assert total >= 12, total


def test_the_test_job_line_quotes_its_record() -> None:
    readme = README.read_text(encoding="utf-8")
    line = next(ln for ln in readme.splitlines() if "The test job from a fresh clone" in ln)
    minutes = re.findall(rf"({NUMBER}) min\b", line)
    (record,) = RECORD_LINK.findall(line)
    assert len(minutes) == 1 and record == "test_job_time_cpu.md", line
    assert holds((RESULTS / record).read_text(encoding="utf-8"), minutes[0]), (minutes, record)


def test_every_figure_of_the_measured_table_is_in_a_result_file() -> None:
    table = "\n".join(table_rows(section(BENCHMARKS_DOC.read_text(encoding="utf-8"), "## Measured on an H200")))
    found = figures(table)
    # Most cells hold figures: a table the parser cannot read must not pass by finding none.
    assert len(found) >= 30, f"only {len(found)} figures parsed from the table:\n{table}"
    results = results_text()
    missing = sorted({f for f in found if not holds(results, f)})
    assert not missing, (f"docs/benchmarks.md figures {missing} are in no file under benchmarks/results/; copy "
                         "them from a result file exactly, or drop them")


def test_the_ceilings_line_is_checked_too() -> None:
    body = section(BENCHMARKS_DOC.read_text(encoding="utf-8"), "## Measured on an H200")
    line = next(ln for ln in body.splitlines() if ln.startswith("Ceilings measured"))
    found = figures(line)
    assert len(found) == 3
    results = results_text()
    assert all(holds(results, f) for f in found), f"ceilings {found} not all in benchmarks/results/"

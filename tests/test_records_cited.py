"""Every result record that the docs, the code or another record names is there to read.

A record name (``<what>_<where>.md|.log|.png``: ``_h200``, ``_cpu``, ``_host``, ``_triton36``...) in README.md,
docs/, kvcached/, benchmarks/ or scripts/ must be a file under benchmarks/results/, unless it is pinned to a commit
as ``name@commit``: a record no longer in the tree (a superseded run, an experiment not kept), read with
``git show commit:benchmarks/results/name``; the pin must resolve in this checkout's history (checked where the
history is there: not in a shallow clone).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SCANNED = ["README.md", "docs", "kvcached", "benchmarks", "scripts"]
NAME = re.compile(r"(?<![\w<.-])([a-z0-9][a-z0-9_]*_(?:h200|cpu|host|triton\d+)[a-z0-9_]*\.(?:md|log|png))"
                  r"(?:@([0-9a-f]{7,40}))?(?![\w-])")


def _texts() -> dict[Path, str]:
    out = {}
    for entry in SCANNED:
        path = ROOT / entry
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.suffix in (".md", ".py", ".sh", ".log")]
        for p in files:
            out[p] = p.read_text(encoding="utf-8", errors="replace")
    return out


def _citations() -> list[tuple[Path, str, str | None]]:
    return [(p, m.group(1), m.group(2)) for p, text in _texts().items() for m in NAME.finditer(text)]


def test_the_name_pattern() -> None:
    found = [(m.group(1), m.group(2)) for m in NAME.finditer(
        "`peers_h200.md`, benchmarks/results/vmm_cuda_nvidia_h200.md; `old_h200_run.md@0a1b2c3` and "
        "compile_check_full_triton36.log; not kernels_<gpu>.md, README.md or x_h200.mdx")]
    assert found == [("peers_h200.md", None), ("vmm_cuda_nvidia_h200.md", None), ("old_h200_run.md", "0a1b2c3"),
                     ("compile_check_full_triton36.log", None)]


def test_every_cited_record_is_in_the_tree_or_pinned() -> None:
    cited = _citations()
    assert len(cited) > 50, "the scan found almost no record names: has the pattern or the layout changed?"
    missing = sorted({f"{p.relative_to(ROOT)}: {name}" for p, name, pin in cited
                      if pin is None and not (RESULTS / name).is_file()})
    assert not missing, ("records named but not under benchmarks/results/ (rename the reference, or pin a removed "
                         "record to the commit that has it, name@commit):\n" + "\n".join(missing))


def test_every_pinned_record_is_in_the_history() -> None:
    pins = sorted({(name, pin) for _, name, pin in _citations() if pin})
    if not pins:
        pytest.skip("no record is pinned to a commit")
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    shallow = subprocess.run([git, "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True, text=True)
    if shallow.stdout.strip() != "false":
        pytest.skip("a shallow clone: the pinned commits may not be here")
    spec = "".join(f"{pin}:benchmarks/results/{name}\n" for name, pin in pins)
    out = subprocess.run([git, "cat-file", "--batch-check"], cwd=ROOT, input=spec, capture_output=True, text=True,
                         check=True)
    bad = [line for line in out.stdout.splitlines() if line.endswith("missing")]
    assert not bad, f"pinned records not in the history: {bad}"

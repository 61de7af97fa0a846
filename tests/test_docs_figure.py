"""The README's picture (docs/figures/overview.svg) is what tools/draw_overview.py draws: edit the script, then run
it, never the SVG by hand."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_committed_picture_is_the_scripts(tmp_path: Path) -> None:
    out = tmp_path / "overview.svg"
    subprocess.run([sys.executable, str(ROOT / "tools" / "draw_overview.py"), str(out)], check=True,
                   capture_output=True)
    committed = (ROOT / "docs" / "figures" / "overview.svg").read_text(encoding="utf-8")
    assert out.read_text(encoding="utf-8") == committed, "run python3 tools/draw_overview.py and commit the SVG"
    assert committed.startswith("<svg") and "Memory follows load" in committed and "per-layer" in committed

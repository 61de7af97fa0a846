"""benchmarks/decode_timeline.py patches a copy of the decode kernel at fixed anchors: each must still occur once
(the script stops with the anchor's name otherwise), and the patched modules must still parse."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import decode_timeline  # noqa: E402


def test_the_patches_apply_to_this_tree(tmp_path: Path) -> None:
    decode_timeline.patched_copy(str(tmp_path))
    kern = (tmp_path / "kvcached" / "kernels" / "attention_decode.py").read_text()
    assert kern.count("_now(p)") == 4 and kern.count("def _now(") == 1
    host = (tmp_path / "kvcached" / "kernels" / "paged_attention.py").read_text()
    assert "lock = TIMING" in host
    for text in (kern, host):
        ast.parse(text)
    original = (ROOT / "kvcached" / "kernels" / "attention_decode.py").read_text()
    assert "_now(" not in original  # only the copy is patched

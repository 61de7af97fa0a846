#!/usr/bin/env python
"""Instructions a loop iteration of an NVIDIA compile of our kernels issues, read from its SASS (no GPU needed).

    python tools/sass_loops.py 'attn_decode-short64\\[bf16-bf16-d128\\]' [--target sm90] [--root OTHER_TREE]

Compiles the first ``compile_variants`` entry (of ``kvcached.kernels.paged_attention``) whose name matches the
pattern, as the compile check does (``triton.compile``; the Triton on the path: ``PYTHONPATH=.venv-triton36``
for 3.6), disassembles the cubin with the Triton wheel's ``nvdisasm`` and prints registers, stack and, for each
loop (a backward branch), its instruction count and most frequent opcodes. ``--root``: import kvcached from
another tree, for a before/after. Run without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import re
import subprocess
import sys
import tempfile
from pathlib import Path


def loops(sass: str) -> list[tuple[int, dict]]:
    """(instructions, top opcodes) of every loop: the code from a label to a branch back to it."""
    labels: dict[str, int] = {}
    ins: list[str] = []
    for line in sass.splitlines():
        m = re.match(r"^\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(ins)
            continue
        m = re.match(r"^\s*/\*[0-9a-f]+\*/\s+(.*?);", line)
        if m:
            ins.append(m.group(1))
    out = []
    for j, text in enumerate(ins):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", text)
        if m and labels.get(m.group(1), j + 1) < j:
            body = ins[labels[m.group(1)]:j + 1]
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", b).split()[0].split(".")[0] for b in body)
            out.append((len(body), dict(ops.most_common(6))))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("pattern", help="regular expression on the variant name")
    ap.add_argument("--target", default="sm90")
    ap.add_argument("--root", default="", help="import kvcached from this tree")
    args = ap.parse_args()
    if not re.fullmatch(r"sm\d+", args.target):
        ap.error(f"--target {args.target!r}: an NVIDIA target (sm80, sm90...), whose cubin nvdisasm reads")
    if args.root:
        sys.path.insert(0, str(Path(args.root).resolve()))
    import triton

    # this checkout's compile check (by path: another tree's may predate compile_variant); kvcached from the path
    here = Path(__file__).resolve().parents[1] / "kvcached" / "kernels" / "compile_check.py"
    spec = importlib.util.spec_from_file_location("compile_check_here", here)
    cc = sys.modules["compile_check_here"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cc)
    variant = next((v for v in cc._variants("kvcached.kernels.paged_attention", args.target)
                    if re.search(args.pattern, v.name)), None)
    if variant is None:
        print(f"no variant matches {args.pattern!r} on {args.target}", file=sys.stderr)
        return 1
    compiled = cc.compile_variant(variant, args.target).asm["cubin"]
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled)
        f.flush()
        sass = subprocess.run([str(bin_dir / "nvdisasm"), "-c", f.name], capture_output=True, text=True).stdout
    print(f"{variant.name} {variant.options} triton {triton.__version__} {args.target}: {cc._resources_cuda(compiled)}")
    for n, ops in loops(sass):
        print(f"  loop of {n} instructions: {ops}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

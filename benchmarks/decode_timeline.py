#!/usr/bin/env python
"""Where a stream-K decode program's time goes: each program's clock at four points, on the GPU.

    python benchmarks/decode_timeline.py

Copies kvcached into a temporary directory and adds, to that copy only, four reads of the GPU's
``%globaltimer`` to the stream-K path of ``decode_kernel`` (the one batches of single-token decodes
take): at the program's start, after it has planned its share of the batch's key tiles, after its
last key tile, and at its end (its partials stored). The reads are stored through the kernel's
``lock_ptr``, which the copy's host code points at a timing buffer (the split merge in a second
launch, as under CUDA graphs, so the kernel does not use that pointer itself). Each line gives, in
us, the 0 / 10 / 50 / 90 / 100 % points over the programs of one call (after warm-up calls) of:
start (from the first program's start), plan, keys, finish, end (from the first start); span is the
last end. bf16, 32 query / 8 KV heads, head 128, block 16, random block tables.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _bench_common import Table, environment, gpu_slug, write_report  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CASES = ((8, 8192), (4, 32768), (64, 8192))

# (file, anchor, text inserted after it): each anchor must occur exactly once in the copy
PATCHES = [
    ("kernels/attention_decode.py",
     "from kvcached.kernels.attention_common import LOG2E, NEG_BIG, attn_tiles, fp8_query\n",
     '\n\n@triton.jit\ndef _now(x):\n    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [x],'
     ' dtype=tl.int64, is_pure=False, pack=1)\n'),
    ("kernels/attention_decode.py", "        p = tl.program_id(0)\n",
     "        tid = (p + tl.num_programs(0) * hslot) * 4\n        tptr = lock_ptr.to(tl.pointer_type(tl.int64))\n"
     "        tl.store(tptr + tid, _now(p))\n"),
    ("kernels/attention_decode.py", "        cur = a\n", "        tl.store(tptr + tid + 1, _now(p))\n"),
    ("kernels/attention_decode.py", "                    BT_AHEAD, INTERP, SAME_KV,\n                )\n",
     "                tl.store(tptr + tid + 2, _now(p))\n"),
    ("kernels/attention_decode.py", "            seq += 1\n            s = e\n",
     "        tl.store(tptr + tid + 3, _now(p))\n"),
    ("kernels/paged_attention.py", "    lock = dummy\n",
     "    global TIMING\n    TIMING = torch.zeros(4 * 65536, dtype=torch.int64, device=dev)\n    lock = TIMING\n"),
]

CHILD = r"""
import sys, torch, importlib
sys.path.insert(0, sys.argv[2])
import kvcached
from _bench_common import paged_batch
assert kvcached.__file__.startswith(sys.argv[1]), kvcached.__file__
from kvcached.kernels import attention_config as cfg
pa = importlib.import_module("kvcached.kernels.paged_attention")
dev = torch.device("cuda")

def pct(x):
    x = x.double().sort().values
    return " / ".join(f"{x[int(q * (len(x) - 1))].item() / 1e3:.1f}" for q in (0, 0.1, 0.5, 0.9, 1.0))

for b, s in CASES:
    q, table, lens, qsl, _bases, kc, vc = paged_batch([1] * b, [s] * b, 0, dev)
    with cfg.override(decode_fused_reduce=0):
        for call in range(4):
            pa.paged_attention(q, kc, vc, table, lens, qsl, max_query_len=1, max_seq_len=s, scale=128**-0.5)
            torch.cuda.synchronize()
            tm = pa.TIMING.view(-1, 4)
            tm = tm[(tm > 0).all(1)]  # programs that ran a key tile (the last ones may have none)
            r = tm - tm[:, 0].min()
            print("ROW", f"{b}x{s}", call, len(r), f"{r[:, 3].max().item() / 1e3:.1f}", pct(r[:, 0]),
                  pct(r[:, 1] - r[:, 0]), pct(r[:, 2] - r[:, 1]), pct(r[:, 3] - r[:, 2]), pct(r[:, 3]), sep="|",
                  flush=True)
"""


def patched_copy(tmp: str) -> None:
    """kvcached copied into tmp, with PATCHES applied to the copy."""
    pkg = Path(tmp) / "kvcached"
    shutil.copytree(ROOT / "kvcached", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    for rel, anchor, text in PATCHES:
        f = pkg / rel
        src = f.read_text()
        if src.count(anchor) != 1:
            raise SystemExit(f"{rel}: the anchor {anchor!r} occurs {src.count(anchor)} times; update PATCHES.")
        f.write_text(src.replace(anchor, anchor + text))


def main() -> None:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("decode_timeline.py reads the GPU's clock: it needs a CUDA GPU.")
    with tempfile.TemporaryDirectory() as tmp:
        patched_copy(tmp)
        child = f"CASES = {CASES!r}\n" + CHILD
        env = dict(os.environ, PYTHONPATH=tmp)
        run = subprocess.run([sys.executable, "-c", child, tmp, str(ROOT / "benchmarks")], capture_output=True,
                             text=True, env=env, cwd=tmp)
        if run.returncode:
            raise SystemExit(run.stderr[-3000:])
    tab = Table("A stream-K decode program's clock (us; 0 / 10 / 50 / 90 / 100 % over the programs of one call)",
                ["case", "call", "programs", "span", "start", "plan", "keys", "finish", "end"])
    for line in run.stdout.splitlines():
        if line.startswith("ROW|"):
            tab.add(*line.split("|")[1:])
    dev = torch.device("cuda")
    write_report(ROOT / "benchmarks" / "results", f"decode_timeline_{gpu_slug(dev)}",
                 "Where a decode program's time goes", environment(dev), [], [tab])


if __name__ == "__main__":
    main()

"""benchmarks/sweep_kv_write_slots.py's slot patterns and its kvcached rows on the CPU (Triton interpreter,
host VMM backend, 64 tokens written (4 blocks: the rows' plumbing and checks, not a size, are the point here; 256
took twice as long) and 1,024 in the patterns, the GPU timer stubbed): every row's bit-for-bit check passes and each
pattern is what its name says."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = r"""
import json, sys
sys.path.insert(0, "benchmarks")
import torch
import sweep_kv_write_slots as m
from _bench_common import Table
m.DEV, m.T = torch.device("cpu"), 64
m.graph_time_us = lambda fn, dev: 1.0  # _time_write has run and checked the write once already
tab = Table("t", ["cache", "slots", "impl", "us", "TB/s", "%", "check"])
lines = []
key = torch.randn(m.T, m.H, m.D).to(torch.bfloat16)
m._kvcached_rows(tab, lines, key, torch.randn_like(key), 1.0, 1)
m.T = 1024  # the page pattern takes whole pages of 64 blocks
pats = {k: v.tolist() for k, v in m._patterns(m.T // m.BS * 2).items()}
print(json.dumps({"rows": tab.rows, "lines": lines, "pats": pats, "page_blocks": m.PAGE_BLOCKS, "bs": m.BS}))
"""


def test_patterns_and_kvcached_rows_on_cpu() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, env=env,
                         cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    import json

    got = json.loads(run.stdout.strip().splitlines()[-1])
    rows, bs, pb = got["rows"], got["bs"], got["page_blocks"]
    assert pb == 64  # 2 MiB of one layer's K: 64 blocks of 16 tokens x 8 heads x 128 x bf16
    caches = [r[0] for r in rows]
    assert caches.count("kvcached per-layer, 4 layers") == 2 and caches.count("kvcached contiguous, 4 layers") == 2
    assert caches.count("plain, as large as the highest slot") == 2
    assert all(r[-1] == "ok" for r in rows), rows
    assert any("after churn" in line for line in got["lines"]), got["lines"]
    for name, slots in got["pats"].items():
        assert len(set(slots)) == len(slots) == 1024, name
        assert 0 <= min(slots) and max(slots) < 2 * 1024, name
    pages = got["pats"]["whole pages (64 blocks) in random order, blocks shuffled within"]
    blocks = [s // bs for s in pages[::bs]]
    assert all(pages[i] == blocks[i // bs] * bs + i % bs for i in range(len(pages)))  # whole blocks
    assert sorted(b % pb for b in blocks) == list(range(pb)) and len({b // pb for b in blocks}) == 1  # one whole page
    assert blocks != sorted(blocks)  # shuffled within the page

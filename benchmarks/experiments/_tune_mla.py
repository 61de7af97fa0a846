#!/usr/bin/env python
"""Sweep the MLA decode launch knobs on a GPU and print the best per shape (a tuning aid, not a benchmark).

    python benchmarks/experiments/_tune_mla.py            # about 2-4 minutes on an H200
    python benchmarks/experiments/_tune_mla.py --fast     # fewer combinations

Uses ``kvcached.kernels.mla_decode.override``; copy the winners into ``launch_config`` /
``choose_num_splits``. Every configuration is checked against the float64 reference first.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from _bench_common import time_us  # noqa: E402

from kvcached.kernels import mla_decode as mla  # noqa: E402
from kvcached.kernels.reference import mla_decode_ref  # noqa: E402
from kvcached.layout import KVGeometry, KVSpec, Layout, allocate_plain, mla_view  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fast", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda")
    shapes = [(1, 16, 8192), (32, 16, 8192), (128, 16, 4096), (64, 128, 4096)]
    knobs = {
        "BLOCK_N": [16, 32, 64],
        "num_warps": [4, 8],
        "num_stages": [1, 2, 3],
        "programs_per_unit": [2, 4, 8, 16],
    }
    if args.fast:
        knobs = {"BLOCK_N": [32, 64], "num_warps": [4, 8], "num_stages": [2], "programs_per_unit": [4, 8]}
    for batch, heads, ctx in shapes:
        nb = ctx // 16
        geom = KVGeometry(KVSpec(4, batch * nb, 16, 1, 576, torch.bfloat16, kv_factor=1), Layout.CONTIGUOUS, 18 << 20)
        bases = allocate_plain(geom, dev)
        cache = mla_view(bases, geom, 3)
        cache.normal_()
        q = torch.randn(batch, heads, 576, dtype=torch.bfloat16, device=dev)
        table = torch.randperm(batch * nb, device=dev).to(torch.int32).view(batch, nb)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        want = mla_decode_ref(q[:2], cache, table[:2], lens[:2], scale=576**-0.5)
        nbytes = batch * ctx * 576 * 2
        def run(q=q, cache=cache, table=table, lens=lens, ctx=ctx):
            return mla.paged_mla_decode(q, cache, table, lens, scale=576**-0.5, max_seq_len=ctx)

        results = []
        for combo in itertools.product(*knobs.values()):
            cfg = dict(zip(knobs, combo, strict=True))
            try:
                with mla.override(**cfg):
                    err = (run()[:2].double() - want).abs().max().item()
                    if err > 3e-2:
                        print(f"  WRONG {cfg}: error {err:.2e}")
                        continue
                    t = time_us(run, dev)
                results.append((t, cfg))
            except Exception as exc:  # e.g. out of shared memory for big tiles
                print(f"  skip {cfg}: {type(exc).__name__}: {str(exc)[:100]}")
        results.sort(key=lambda r: r[0])
        default = time_us(run, dev)
        print(f"b{batch} h{heads} s{ctx}: default {default:.0f} us ({nbytes / default / 1e6:.2f} TB/s)")
        for t, cfg in results[:3]:
            print(f"    {t:8.0f} us {nbytes / t / 1e6:5.2f} TB/s  {cfg}")
        del bases, cache, run
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

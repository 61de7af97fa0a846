#!/usr/bin/env python
"""MLA decode of one kvcached checkout: graph-replay and eager time a shape; prints one MLA line each.

    python benchmarks/experiments/mla_ab.py ROOT TAG   # ROOT: the checkout to import (an A/B runs two, one each)

Shapes (bf16 latent 576 = 512 + 64 rope, block 16, per-layer cache, random block tables, every sequence at
the full context): 1, 4 and 32 x 8k and 128 x 4k at 16 heads; 1 x 8k and 64 x 4k at 128 heads. Graph time:
the median of 3 CUDA-graph captures (``graph_time_us``); eager: triton's do_bench median (``time_us``), which
at small batches is mostly host time. TB/s counts the latent cache read once. The first two sequences are
checked against the float64 reference (max abs error).
"""

from __future__ import annotations

import os
import sys

ROOT, TAG = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.abspath(ROOT))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # _bench_common

import torch  # noqa: E402
from _bench_common import BLOCK, DT, graph_time_us, mla_cache, time_us  # noqa: E402

import kvcached  # noqa: E402
from kvcached.kernels import paged_mla_decode  # noqa: E402
from kvcached.kernels.reference import mla_decode_ref  # noqa: E402
from kvcached.layout import Layout  # noqa: E402

assert os.path.abspath(kvcached.__file__).startswith(os.path.abspath(ROOT)), kvcached.__file__
DEV = torch.device("cuda")
SHAPES = [(1, 16, 8192), (4, 16, 8192), (32, 16, 8192), (128, 16, 4096), (1, 128, 8192), (64, 128, 4096)]


def main() -> None:
    for batch, heads, ctx in SHAPES:
        torch.manual_seed(0)
        nb = ctx // BLOCK
        num_blocks = batch * nb
        q = torch.randn(batch, heads, 576, dtype=DT, device=DEV)
        table = torch.randperm(num_blocks, device=DEV).to(torch.int32).view(batch, nb)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
        bases, cache = mla_cache(Layout.PER_LAYER, num_blocks, 1, DEV)

        def fn(q=q, cache=cache, table=table, lens=lens, ctx=ctx):
            return paged_mla_decode(q, cache, table, lens, scale=576**-0.5, max_seq_len=ctx)

        sl = min(batch, 2)
        want = mla_decode_ref(q[:sl], cache, table[:sl], lens[:sl], scale=576**-0.5)
        err = (fn()[:sl].double() - want).abs().max().item()
        g = sorted(graph_time_us(fn, DEV) for _ in range(3))
        e = time_us(fn, DEV)
        tbs = batch * ctx * 576 * 2 / g[1] / 1e6
        print(f"MLA {TAG} b{batch} h{heads} s{ctx} graph_us={g[1]:.1f} ({g[0]:.1f}..{g[2]:.1f}) eager_us={e:.1f} "
              f"TB/s={tbs:.2f} err={err:.1e}", flush=True)
        del bases, cache


if __name__ == "__main__":
    main()

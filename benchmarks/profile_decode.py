#!/usr/bin/env python
"""Where a decode's CUDA-graph time goes: the graph time, and each kernel of one replay with the gap before it.

    python benchmarks/profile_decode.py [ROOT] [TAG]     # ROOT: the kvcached checkout to import (default .)

Prints one PROF line a case: the graph time as bench_peers takes it (median of three captures), ``span`` from
the first kernel's start to the last kernel's end in one replay under torch.profiler, the largest error against
float64, then each kernel's duration and the idle gap before it. The graph time minus ``span`` is the graph
launch and the timing around it, which every peer timed the same way pays too. Cases: bf16, 32 query / 8 KV
heads, head 128, block 16, random block tables, per-layer cache: 1, 8 and 64 x 8k, 4 x 32k, 8 x 8k x q4.
"""

from __future__ import annotations

import os
import sys

ROOT = sys.argv[1] if len(sys.argv) > 1 else "."
TAG = sys.argv[2] if len(sys.argv) > 2 else "head"
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _bench_common import HEAD, capture_graph, graph_time_us, kernel_modules, paged_batch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

kvcached, pa, cfg, ref = kernel_modules(ROOT)
DEV = torch.device("cuda")
CASES = [(1, 8192, 1), (8, 8192, 1), (4, 32768, 1), (64, 8192, 1), (8, 8192, 4)]
REPLAYS = 5


def case(batch: int, ctx: int, q_len: int) -> str:
    q, table, lens, qsl, _, kc, vc = paged_batch([q_len] * batch, [ctx] * batch, batch * ctx + q_len, DEV)

    def fn():
        return pa.paged_attention(q, kc, vc, table, lens, qsl, max_query_len=q_len, max_seq_len=ctx,
                                  scale=HEAD**-0.5)

    want = ref.paged_attention_ref(q, kc, vc, table, lens, qsl, scale=HEAD**-0.5).double()
    err = (fn().double() - want).abs().max().item()
    t = sorted(graph_time_us(fn, DEV) for _ in range(3))[1]
    graph = capture_graph(fn, DEV)
    for _ in range(REPLAYS):
        graph.replay()
    torch.cuda.synchronize(DEV)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            graph.replay()
        torch.cuda.synchronize(DEV)
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    last = kernels[-(len(kernels) // REPLAYS):]  # the last replay's kernels
    parts, prev_end = [], None
    for e in last:
        gap = 0.0 if prev_end is None else e.time_range.start - prev_end
        parts.append(f"{e.name[:28]} {e.time_range.elapsed_us():.1f}us gap {gap:.1f}")
        prev_end = e.time_range.end
    span = last[-1].time_range.end - last[0].time_range.start
    return (f"PROF {TAG} {batch}x{ctx}x{q_len} graph={t:.1f}us span={span:.1f} err={err:.1e} | "
            + " | ".join(parts))


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("profile_decode.py profiles GPU kernels: it needs a CUDA or ROCm GPU.")
    print("kvcached from", kvcached.__file__, flush=True)
    for c in CASES:
        print(case(*c), flush=True)


if __name__ == "__main__":
    main()

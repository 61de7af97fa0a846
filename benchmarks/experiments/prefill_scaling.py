#!/usr/bin/env python
"""Prefill at equal total tokens (8192) and different prompt lengths: ours and FA3; prints one PSCALE line a case.

    python benchmarks/experiments/prefill_scaling.py --fa3                          # ours and FA3 (vLLM's CUDA build)
    python benchmarks/experiments/prefill_scaling.py --root OTHER --tag x --knobs '{"prefill_num_stages": 2}' \\
        --min-query-len 128

Cases: 64 x 128, 32 x 256, ... 1 x 8192 causal prompts (bf16, 32 query / 8 KV heads, head 128, block 16,
random block tables, per-layer cache). Every case launches the same number of prefill programs (1024 on the
sm90 tile), so the time against the key tiles they run splits into a cost a key tile and a cost a program
(benchmarks/results/prefill_overhead_h200.md). Time: median of 3 CUDA-graph replays (do_bench medians).
``--min-query-len`` is passed to paged_attention (128: no decode launch beside the prefill).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # _bench_common
ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--root", default=".", help="the kvcached checkout to import")
ap.add_argument("--tag", default="head", help="label of the lines")
ap.add_argument("--fa3", action="store_true", help="also time FA3's flash_attn_varlen_func (vLLM's CUDA build)")
ap.add_argument("--knobs", default="{}", help="JSON attention_config.override knobs")
ap.add_argument("--min-query-len", type=int, default=1)
ARGS = ap.parse_args()

import torch  # noqa: E402
from _bench_common import (  # noqa: E402
    HEAD,
    Q_HEADS,
    graph_time_us,
    kernel_modules,
    paged_batch,
    peer_call,
    vllm_peers,
)

kvcached, pa, cfg, ref = kernel_modules(ARGS.root)

DEV = torch.device("cuda")
CASES = [(64, 128), (32, 256), (16, 512), (8, 1024), (4, 2048), (2, 4096), (1, 8192)]


def case(n: int, length: int, knobs: dict, fa) -> str:
    q, table, lens, qsl, _, kc, vc = paged_batch([length] * n, [length] * n, n, DEV)

    def fn():
        return pa.paged_attention(q, kc, vc, table, lens, qsl, max_query_len=length, max_seq_len=length,
                                  scale=HEAD**-0.5, min_query_len=ARGS.min_query_len)

    with cfg.override(**knobs) if knobs else contextlib.nullcontext():
        ts = sorted(graph_time_us(fn, DEV) for _ in range(3))
    flop = 4 * Q_HEADS * HEAD * n * length * (length + 1) / 2
    line = f"PSCALE {ARGS.tag} {n}x{length} ours={ts[1]:.1f}us ({flop / ts[1] / 1e6:.0f} TF/s)"
    if fa is not None and not isinstance(fa, Exception):
        g = peer_call("FA3", fa, q, kc, vc, table, lens, qsl, length, length)
        tf = sorted(graph_time_us(g, DEV) for _ in range(3))
        line += f" fa3={tf[1]:.1f}us ({flop / tf[1] / 1e6:.0f} TF/s)"
    return line


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("prefill_scaling.py times GPU kernels: it needs a CUDA or ROCm GPU.")
    knobs = json.loads(ARGS.knobs)
    fa = vllm_peers().get("FA3 paged (peer)") if ARGS.fa3 else None
    for n, length in CASES:
        print(case(n, length, knobs, fa), flush=True)
        torch.cuda.empty_cache()  # the case's cache went with case()


if __name__ == "__main__":
    main()

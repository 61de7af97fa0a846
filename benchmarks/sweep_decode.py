#!/usr/bin/env python
"""Time the decode / short-query kernel under launch-knob overrides (graph replay, do_bench median).

    python benchmarks/sweep_decode.py --cases 64x8192x1,64xux1 --sweep '[{}, {"split_waves": 0}]'
    python benchmarks/sweep_decode.py --root OLD_CHECKOUT --tag old     # another kvcached, for an A/B

A case is ``BxCxQ``: B sequences of C context keys (``u``: uniform draws from 256..16384, fixed
seed) with Q new tokens each, or ``BxCxQxM`` with ``max_seq_len`` M passed instead of the
longest length (as a vLLM CUDA graph captured at ``max_model_len`` M passes it); bf16, 32 query
/ 8 KV heads, head 128, block 16, block tables from randperm. ``--sweep`` is a JSON list of
``attention_config.override`` knob sets. Each line printed: the case, the knobs, graph time
(us), TB/s (K+V read once + q/out), and the largest error of the first 64 sequences against
float64. Ends with the register / spill / shared-memory use of every decode kernel compiled
(GPU only).
"""

from __future__ import annotations

import argparse
import json

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--root", default=".", help="the kvcached checkout to import (for an A/B against another)")
ap.add_argument("--tag", default="head", help="label of the printed lines")
ap.add_argument("--cases", default="64x8192x1", help="comma-separated BxCxQ or BxCxQxM")
ap.add_argument("--sweep", default="[{}]", help="JSON list of override knob sets")
ARGS = ap.parse_args()

import torch  # noqa: E402
from _bench_common import (  # noqa: E402
    HEAD,
    KV_HEADS,
    Q_HEADS,
    case_lens,
    graph_time_us,
    kernel_modules,
    sweep_batch,
    time_us,
)

kvcached, pa, cfg, ref = kernel_modules(ARGS.root)


def run_case(case: str, sweep: list[dict], dev: torch.device) -> None:
    b, c, n, *bound = case.split("x")
    b, n = int(b), int(n)
    lens_l = case_lens(b, c)
    mx = max([*lens_l, *(int(m) for m in bound)])
    # columns up to the bound (never read: past every length), so the cache holds only the real keys
    q, kc, vc, table, lens, qsl = sweep_batch(lens_l, n, mx, dev)
    k = min(b, 64)  # every sequence of a batch up to 64 (a stream-K program's run may span several)
    want = ref.paged_attention_ref(q[: k * n], kc, vc, table[:k], lens[:k], qsl[: k + 1], scale=HEAD**-0.5).double()
    moved = sum(lens_l) * KV_HEADS * HEAD * 4 + b * n * Q_HEADS * HEAD * 4

    def fn():
        return pa.paged_attention(q, kc, vc, table, lens, qsl, max_query_len=n, max_seq_len=mx, scale=HEAD**-0.5)

    for knobs in sweep:
        try:
            with cfg.override(**knobs):
                err = (fn()[: k * n].double() - want).abs().max().item()
                t = graph_time_us(fn, dev) or time_us(fn, dev)
            print(f"RESULT {ARGS.tag} {case} ov={knobs} graph_us={t:.1f} TB/s={moved / t / 1e6:.2f} err={err:.1e}",
                  flush=True)
        except Exception as exc:  # a knob set that does not compile or launch is a line, not the end
            print(f"RESULT {ARGS.tag} {case} ov={knobs} ERROR {type(exc).__name__}: {str(exc)[:200]}", flush=True)


def main() -> None:
    print("kvcached from", kvcached.__file__, flush=True)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sweep = json.loads(ARGS.sweep)
    for case in ARGS.cases.split(","):
        run_case(case, sweep, dev)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    regs = []
    for cache in getattr(pa.decode_kernel, "device_caches", {}).values():
        regs += [(c.n_regs, c.n_spills, c.metadata.shared, c.metadata.num_warps) for c in cache[0].values()]
    print("REGS (registers, spills, shared bytes, warps)", ARGS.tag, regs)


if __name__ == "__main__":
    main()

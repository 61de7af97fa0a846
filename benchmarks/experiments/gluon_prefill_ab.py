#!/usr/bin/env python
"""The Gluon prefill experiment (experiments/gluon_prefill.py) against kvcached's prefill: correctness and speed.

    python benchmarks/experiments/gluon_prefill_ab.py                     # Hopper GPU, Triton 3.6 (the GPU machine's)
    python benchmarks/experiments/gluon_prefill_ab.py --knobs '{"stages": 4}' --tag stages4

Checks: both kernels against a float64 reference on small batches (per-layer and contiguous layouts, chunked
prompts after cached tokens, a decode beside them), then timing by CUDA-graph replay (median of 3 do_bench
medians) on the prefill shapes of bench_peers / prefill_scaling (bf16, 32 query / 8 KV heads, head 128, block 16,
random block tables). kvcached's side runs with ``min_query_len`` above the decode kernel's limit, so both time
the prefill launch alone. Writes benchmarks/results/gluon_prefill_<gpu>.md (--out for another folder).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # gluon_prefill beside it, _bench_common one folder up
ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--knobs", default="{}", help="JSON keyword arguments of gluon_prefill.launch_prefill_hopper")
ap.add_argument("--tag", default="", help="suffix of the results file")
ap.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "results"))
ARGS = ap.parse_args()

import torch  # noqa: E402
import triton  # noqa: E402

if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 and not torch.version.hip
        and triton.__version__.startswith("3.6")):
    sys.exit("gluon_prefill_ab.py needs a Hopper GPU (sm90) and Triton 3.6 (Gluon's API changes between releases).")

from _bench_common import (  # noqa: E402
    HEAD,
    Table,
    environment,
    gpu_slug,
    graph_time_us,
    kv_cache,
    paged_batch,
    prefill_flops,
    write_report,
)
from gluon_prefill import launch_prefill_hopper  # noqa: E402

from kvcached.kernels.reference import paged_attention_ref  # noqa: E402
from kvcached.layout import Layout  # noqa: E402

pa = importlib.import_module("kvcached.kernels.paged_attention")  # the package exports a function of that name
DEV = torch.device("cuda")
UNITS = torch.cuda.get_device_properties(DEV).multi_processor_count
KNOBS = json.loads(ARGS.knobs)
SHORT = pa.short_max(True)  # queries up to this length are the decode kernel's: the prefill leaves them
SCALE = HEAD**-0.5
CHECKS = [("chunks and a decode", [1000, 37, 513, 1], [1000, 300, 2000, 77]), ("short prompts", [17, 18], [17, 40]),
          ("contiguous layout", [700, 300], [900, 300])]
CASES = [("1 x 8k", [8192], [8192]), ("8 x 1k", [1024] * 8, [1024] * 8), ("4 x 2k", [2048] * 4, [2048] * 4),
         ("16 x 512", [512] * 16, [512] * 16), ("64 x 128", [128] * 64, [128] * 64),
         ("4 chunks of 1024 after 3072", [1024] * 4, [4096] * 4)]


def batch(q_lens, seq_lens, seed, layout=Layout.PER_LAYER):
    q, table, lens, qsl, bases, kc, vc = paged_batch(q_lens, seq_lens, seed, DEV)
    if layout is not Layout.PER_LAYER:
        bases, kc, vc = kv_cache(layout, table.numel(), 4, DEV)
    return q, table, lens, qsl, (bases, kc, vc)


def ours(q, table, lens, qsl, kc, vc, q_lens, seq_lens, out=None):
    return pa.paged_attention(q, kc, vc, table, lens, qsl, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
                              scale=SCALE, min_query_len=max(min(q_lens), SHORT + 1), out=out)


def gluon(q, table, lens, qsl, kc, vc, out):
    launch_prefill_hopper(q, kc, vc, out, table, lens, qsl, SCALE, SHORT, UNITS, **KNOBS)
    return out


def prefill_rows(qsl, q_lens) -> torch.Tensor:
    return torch.cat([torch.arange(int(qsl[i]), int(qsl[i + 1])) for i, n in enumerate(q_lens) if n > SHORT])


def check(name, q_lens, seq_lens, table_out: Table) -> None:
    layout = Layout.CONTIGUOUS if "contiguous" in name else Layout.PER_LAYER
    q, table, lens, qsl, (_, kc, vc) = batch(q_lens, seq_lens, 1, layout)
    want = paged_attention_ref(q, kc, vc, table, lens, qsl, scale=SCALE)
    rows = prefill_rows(qsl, q_lens)
    got_ours = ours(q, table, lens, qsl, kc, vc, q_lens, seq_lens, out=torch.zeros_like(q))
    got = gluon(q, table, lens, qsl, kc, vc, torch.full_like(q, float("nan")))
    torch.cuda.synchronize()
    err = [(g[rows].double() - want[rows]).abs().max().item() for g in (got_ours, got)]
    table_out.add(name, str(q_lens), str(seq_lens), err[0], err[1], "ok" if max(err) < 2e-2 else "WRONG")


def case(name, q_lens, seq_lens, table_out: Table) -> None:
    q, table, lens, qsl, (_, kc, vc) = batch(q_lens, seq_lens, 2)
    out = torch.empty_like(q)
    t_ours = sorted(graph_time_us(lambda: ours(q, table, lens, qsl, kc, vc, q_lens, seq_lens), DEV)
                    for _ in range(3))
    t_gluon = sorted(graph_time_us(lambda: gluon(q, table, lens, qsl, kc, vc, out), DEV) for _ in range(3))
    flop = prefill_flops(q_lens, seq_lens, short_max=SHORT)
    table_out.add(name, t_ours[1], flop / t_ours[1] / 1e6, t_gluon[1], flop / t_gluon[1] / 1e6,
                  t_ours[1] / t_gluon[1], f"{t_gluon[0]:.0f}-{t_gluon[2]:.0f}")


def main() -> None:
    checks = Table("Correctness: max |error| of the prefill rows against the float64 reference",
                   ["batch", "query lengths", "sequence lengths", "kvcached", "Gluon", "verdict"])
    for name, ql, sl in CHECKS:
        check(name, ql, sl, checks)
    times = Table("Prefill time, CUDA-graph replay (us; TFLOP/s causal)",
                  ["batch", "kvcached us", "TFLOP/s", "Gluon us", "TFLOP/s", "kvcached / Gluon", "Gluon spread"])
    for name, ql, sl in CASES:
        case(name, ql, sl, times)
    lines = [f"- Gluon launch options: {KNOBS or 'defaults'} (gluon_prefill.launch_prefill_hopper)", "",
             "A ratio below 1 means the Gluon kernel is slower. Not used by kvcached (see gluon_prefill.py).", ""]
    write_report(ARGS.out, f"gluon_prefill_{gpu_slug(DEV)}{ARGS.tag}", "Gluon prefill experiment against kvcached's",
                 environment(DEV), lines, [checks, times])


if __name__ == "__main__":
    main()

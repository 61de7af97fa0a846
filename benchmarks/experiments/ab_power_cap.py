#!/usr/bin/env python
"""Attention A/B at full clock and at the power cap: one kvcached tree per process, run them in turn.

    python3 benchmarks/experiments/ab_power_cap.py ROOT TAG 64x8192x16,8x8192x1,1x8192x8192 [KNOB=VALUE,... ...]

A case is ``BxCxQ``: B sequences of C keys with Q query tokens each (Q = C: a whole prompt; C = ``u``: lengths
drawn from 256..16384 as ``sweep_decode.py`` draws them), ``BxCxQ:fp8`` the same values in an fp8 KV cache; bf16,
32 query / 8 KV heads, head 128, block 16, inputs as ``sweep_decode.py`` makes them (``_bench_common.sweep_batch``);
the call gets ``min_query_len`` = Q, as kvcached's vLLM backend passes it (prompts alone: no decode launch). "cold": a
captured graph's ``do_bench`` (median) after 2 s idle, at full clock; "hot": the same graph replayed for 1.5 s
first, so the GPU is at its power cap (an H200 reaches its 700 W within about 0.2 s and its SM clock falls to
1200-1700 MHz, ``benchmarks/results/kv_offsets_h200.md``), then ``do_bench``. Prints a checksum of the output
(two trees that differ only in addressing must agree bit for bit) and, for queries of up to 16 tokens, the
largest error of the first two sequences against float64. Each ``KNOB=VALUE,...`` argument (integers; ``-``: none)
runs the cases again under ``attention_config.override`` (tile or launch knobs of the tree's dispatcher against
its defaults), tagged ``TAG/KNOBS``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _bench_common

import torch  # noqa: E402
from _bench_common import HEAD, capture_graph, case_lens, kernel_modules, sweep_batch, time_us  # noqa: E402


def run_case(pa, ref, tag: str, case: str, dev: torch.device) -> None:
    from triton.testing import do_bench

    shape, _, kv = case.partition(":")
    b, c, n = shape.split("x")
    b, n = int(b), int(n)
    lens_l = case_lens(b, c)
    longest = max(lens_l)
    q, kc, vc, table, lens, qsl = sweep_batch(lens_l, n, longest, dev)
    scales = {}
    if kv == "fp8":  # the same values in the vendor's fp8 cache (kvcached's own choice of e4m3), scales 1
        from kvcached.kernels.platform import fp8_kv_dtype  # the tree kernel_modules put on the path

        kc, vc = kc.to(fp8_kv_dtype()), vc.to(fp8_kv_dtype())
        one = torch.ones((), dtype=torch.float32, device=dev)
        scales = {"k_scale": one, "v_scale": one}
    elif kv:
        raise SystemExit(f"case {case!r}: the only cache suffix is ':fp8'")

    def fn():
        return pa.paged_attention(q, kc, vc, table, lens, qsl, max_query_len=n, max_seq_len=longest, scale=HEAD**-0.5,
                                  min_query_len=n, **scales)

    o = fn().double()
    line = f"sum={o.sum().item():.6e} abs={o.abs().sum().item():.6e}"
    if n <= 16:
        k = min(b, 2)
        want = ref.paged_attention_ref(q[: k * n], kc, vc, table[:k], lens[:k], qsl[: k + 1], scale=HEAD**-0.5,
                                       **scales)
        line += f" err={(o[: k * n] - want.double()).abs().max().item():.1e}"
    graph = capture_graph(fn, dev)
    time.sleep(2.0)
    cold = time_us(graph.replay, dev)
    t_end = time.time() + 1.5
    while time.time() < t_end:
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
    hot = do_bench(graph.replay, warmup=5, rep=200, return_mode="median") * 1e3
    try:
        clk = torch.cuda.clock_rate()  # MHz, through NVML where torch finds it
    except Exception:
        clk = -1
    print(f"AB {tag} {case} cold_us={cold:.1f} hot_us={hot:.1f} clk_after={clk} {line}", flush=True)


def main() -> None:
    root, tag, cases = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    _, pa, ac, ref = kernel_modules(root)
    dev = torch.device("cuda")
    for spec in sys.argv[4:] or ["-"]:
        knobs = {k: int(v) for k, v in (kv.split("=") for kv in spec.split(",") if spec != "-")}
        with ac.override(**knobs):
            for case in cases:
                run_case(pa, ref, tag if spec == "-" else f"{tag}/{spec}", case, dev)
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

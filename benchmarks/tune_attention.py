#!/usr/bin/env python
"""Launch-config sweep and host-overhead breakdown for the paged-attention kernels (GPU only).

    python benchmarks/tune_attention.py                    # host breakdown, decode + prefill sweeps, checks
    python benchmarks/tune_attention.py --parts decode     # one part: host, decode, prefill, grid
    python benchmarks/tune_attention.py --quick            # fewer configs

Every timed configuration is first checked against a float64 reference (first
sequences of the batch) on fresh random data. Two times per point:
- ``eager``: ``do_bench`` of the Python call (L2 flushed; includes host time when the
  host is slower than the GPU, which is what a caller without CUDA graphs sees);
- ``graph``: ``do_bench`` of a CUDA-graph replay of the same call (GPU time).
Counting (bf16): decode bytes = B*S*Hk*D*2*2 + B*H*D*2*2; causal prefill FLOPs = 4*H*D*n(n+1)/2.
Writes ``benchmarks/results/attention_sweep_<gpu>.md``.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _bench_common import Table, environment, gpu_slug  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from kvcached.kernels import attention_config as cfg  # noqa: E402
from kvcached.kernels.reference import fill_random_, paged_attention_ref, relative_error  # noqa: E402
from kvcached.layout import KVGeometry, KVSpec, Layout, allocate_plain, k_v_views  # noqa: E402

PA = importlib.import_module("kvcached.kernels.paged_attention")
KV_HEADS, Q_HEADS, HEAD, BLOCK = 8, 32, 128, 16
DT = torch.bfloat16
DEV = torch.device("cuda")
FAILED: list[str] = []


def cache(layout: Layout, num_blocks: int, layers: int = 1):
    geom = KVGeometry(KVSpec(layers, num_blocks, BLOCK, KV_HEADS, HEAD, DT), layout, 2 << 20)
    bases = allocate_plain(geom, DEV)
    fill_random_(bases, DT)
    return bases, *k_v_views(bases, geom, layers - 1)


def bench(fn, rep: int = 40) -> float:
    return float(do_bench(fn, warmup=10, rep=rep, return_mode="median")) * 1e3


def graph_of(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def host_us(fn, n: int = 300) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


class Decode:
    """One decode problem (random block table, fresh random K/V and queries) and its reference."""

    def __init__(self, batch: int, ctx: int, layout: Layout = Layout.PER_LAYER, layers: int = 1):
        nb = ctx // BLOCK
        self.batch, self.ctx = batch, ctx
        self.bases, self.k, self.v = cache(layout, batch * nb, layers)
        self.q = torch.randn(batch, Q_HEADS, HEAD, dtype=DT, device=DEV)
        self.bt = torch.randperm(batch * nb, device=DEV).to(torch.int32).view(batch, nb)
        self.sl = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
        self.qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
        self.out = torch.empty_like(self.q)
        n = min(batch, 2)
        self.ref = paged_attention_ref(self.q[:n], self.k, self.v, self.bt[:n], self.sl[:n], self.qsl[: n + 1])
        self.bytes = batch * ctx * KV_HEADS * HEAD * 2 * 2 + batch * Q_HEADS * HEAD * 2 * 2

    def __call__(self):
        return PA.paged_attention(self.q, self.k, self.v, self.bt, self.sl, self.qsl, max_query_len=1,
                                  max_seq_len=self.ctx, out=self.out)

    def check(self, what: str) -> bool:
        self.out.fill_(float("nan"))
        self()
        err = relative_error(self.out[: self.ref.shape[0]], self.ref)
        if not err < 2e-2:
            FAILED.append(f"{what}: relative error {err:.3g}")
            return False
        return True

    def times(self) -> tuple[float, float]:
        g = graph_of(self)
        return bench(self), bench(g.replay)

    def sdpa(self) -> float:
        k = self.k[self.bt.long()].reshape(self.batch, self.ctx, KV_HEADS, HEAD).transpose(1, 2).contiguous()
        v = self.v[self.bt.long()].reshape(self.batch, self.ctx, KV_HEADS, HEAD).transpose(1, 2).contiguous()
        q4 = self.q.unsqueeze(2)
        return bench(lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True))


def part_host(out: list[str]) -> None:
    tab = Table("Host time per call, batch 1 x 8k decode (us, no sync)", ["what", "host us"])
    p = Decode(1, 8192)
    p.check("host decode")
    args = (p.q, p.k, p.v, p.bt, p.sl, p.qsl)
    tab.add("paged_attention (eager, direct launch)", host_us(p))
    tab.add("_validate only", host_us(lambda: PA._validate(*args, 1, 8192, None, True, None, None, None, None,
                                                             p.out)))
    tab.add("custom op (dispatcher + launch)", host_us(lambda: PA.paged_attention_op(
        *args, p.out, 1, 8192, HEAD**-0.5, True, 0, 0.0, None, None, None, None)))
    tab.add("_launch only (split, merged in-kernel)", host_us(lambda: PA._launch(
        *args, p.out, 1, 8192, HEAD**-0.5, True, 0, 0.0, None, None, None, None)))
    with cfg.override(decode_fused_reduce=0):
        tab.add("_launch only (split, decode + reduce_kernel)", host_us(lambda: PA._launch(
            *args, p.out, 1, 8192, HEAD**-0.5, True, 0, 0.0, None, None, None, None)))
        e, g = p.times()
        tab.add(f"reduce_kernel path: do_bench eager {e:.1f} us / graph replay {g:.1f} us", "-")
    with cfg.override(decode_num_splits=1):
        tab.add("_launch only, no split (decode kernel alone)", host_us(lambda: PA._launch(
            *args, p.out, 1, 8192, HEAD**-0.5, True, 0, 0.0, None, None, None, None)))
    e, g = p.times()
    tab.add(f"do_bench eager {e:.1f} us / graph replay {g:.1f} us", "-")
    out.append(tab.markdown())
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        p()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
    body = [ln for ln in text.getvalue().splitlines() if ln.strip()][-16:]
    out.append("Profile of 200 eager calls (tottime):\n\n```\n" + "\n".join(body) + "\n```\n")


DECODE_SHAPES = {1: (16, 32, 64, 128), 8: (4, 8, 16), 64: (1, 2), 256: (1,)}


def part_decode(out: list[str], quick: bool) -> None:
    tab = Table("Decode sweep (per-layer, ctx 8k): GPU time of a CUDA-graph replay",
                ["batch", "block_n", "warps", "stages", "splits", "graph us", "TB/s"])
    best: dict[int, tuple] = {}
    combos = list(itertools.product((32, 64, 128), (4, 8), (1, 2, 3))) + [(64, 4, 4), (128, 4, 4), (64, 2, 3)]
    if quick:
        combos = list(itertools.product((64, 128), (4, 8), (2, 3)))
    for batch, splits_list in DECODE_SHAPES.items():
        p = Decode(batch, 8192)
        for bn, w, st in combos:
            for sp in splits_list:
                knobs = dict(decode_block_n=bn, decode_num_warps=w, decode_num_stages=st, decode_num_splits=sp)
                try:
                    with cfg.override(**knobs):
                        if not p.check(f"decode b{batch} {knobs}"):
                            continue
                        g = bench(graph_of(p).replay, rep=20)
                except Exception as exc:  # out of resources etc.: a row, not the end
                    tab.add(batch, bn, w, st, sp, None, f"ERROR {type(exc).__name__}")
                    break
                tab.add(batch, bn, w, st, sp, g, p.bytes / g / 1e6)
                if batch not in best or g < best[batch][0]:
                    best[batch] = (g, knobs)
        del p
        torch.cuda.empty_cache()
    out.append(tab.markdown())
    summary = Table("Decode sweep: best per batch", ["batch", "graph us", "knobs"])
    for b, (g, k) in best.items():
        summary.add(b, g, k)
    out.append(summary.markdown())


def part_grid(out: list[str]) -> None:
    """Default configs over batch x context: eager and graph times, and dense SDPA, both layouts."""
    tab = Table("Decode, default configs: ours (per-layer / contiguous) vs dense SDPA, us",
                ["batch", "ctx", "splits", "eager", "graph", "graph, reduce_kernel", "contig eager", "contig graph",
                 "SDPA", "TB/s (graph)"])
    for batch, ctx in itertools.product((1, 8, 64, 256), (1024, 8192, 32768)):
        if batch * ctx > 256 * 8192:
            continue
        try:
            p = Decode(batch, ctx)
            p.check(f"grid b{batch} s{ctx}")
            e, g = p.times()
            with cfg.override(decode_fused_reduce=0):
                g2 = bench(graph_of(p).replay)
            sd = p.sdpa()
            del p
            c = Decode(batch, ctx, Layout.CONTIGUOUS, 2)
            c.check(f"grid contiguous b{batch} s{ctx}")
            ce, cg = c.times()
            splits = cfg.decode_config(batch, KV_HEADS, HEAD, 16, 2, ctx, 0).num_splits
            tab.add(batch, ctx, splits, e, g, g2, ce, cg, sd, c.bytes / cg / 1e6)
            del c
        except Exception as exc:
            tab.add(batch, ctx, None, None, None, None, None, None, None, f"ERROR {type(exc).__name__}: {exc}"[:200])
        torch.cuda.empty_cache()
    out.append(tab.markdown())


def part_prefill(out: list[str], quick: bool) -> None:
    n = 8192
    tab = Table(f"Prefill sweep: one causal {n}-token prompt (per-layer)",
                ["block_m", "block_n", "warps", "stages", "us", "TFLOP/s"])
    bases, k, v = cache(Layout.PER_LAYER, n // BLOCK + 1)
    q = torch.randn(n, Q_HEADS, HEAD, dtype=DT, device=DEV)
    bt = torch.randperm(n // BLOCK + 1, device=DEV).to(torch.int32)[None, : n // BLOCK]
    sl = torch.tensor([n], dtype=torch.int32, device=DEV)
    qsl = torch.tensor([0, n], dtype=torch.int32, device=DEV)
    o = torch.empty_like(q)
    ref = paged_attention_ref(q[-256:], k, v, bt, sl, torch.tensor([0, 256], dtype=torch.int32, device=DEV))
    flops = 4 * Q_HEADS * HEAD * n * (n + 1) / 2

    def fn():
        return PA.paged_attention(q, k, v, bt, sl, qsl, max_query_len=n, max_seq_len=n, out=o)

    configs = [(128, 64, 4, 4), (128, 64, 4, 5), (128, 64, 8, 4), (64, 64, 4, 4), (64, 128, 4, 3), (128, 32, 8, 4)]
    if quick:
        configs = configs[:4]
    best = None
    for bm, bn, w, st in configs:
        knobs = dict(prefill_block_m=bm, prefill_block_n=bn, prefill_num_warps=w, prefill_num_stages=st)
        try:
            with cfg.override(**knobs):
                o.fill_(float("nan"))
                fn()
                err = relative_error(o[-256:], ref)
                if not err < 2e-2:
                    FAILED.append(f"prefill {knobs}: relative error {err:.3g}")
                    continue
                t = bench(fn, rep=60)
        except Exception as exc:
            tab.add(bm, bn, w, st, None, f"ERROR {type(exc).__name__}")
            continue
        tab.add(bm, bn, w, st, t, flops / t / 1e6)
        if best is None or t < best[0]:
            best = (t, knobs)
    qd = q.view(1, n, Q_HEADS, HEAD).transpose(1, 2)
    kd = k[bt[0].long()].reshape(1, n, KV_HEADS, HEAD).transpose(1, 2).contiguous()
    vd = v[bt[0].long()].reshape(1, n, KV_HEADS, HEAD).transpose(1, 2).contiguous()
    t = bench(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True), rep=60)
    tab.notes.append(f"dense SDPA causal: {t:.0f} us = {flops / t / 1e6:.0f} TFLOP/s; best ours: {best}")
    out.append(tab.markdown())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="host,decode,prefill,grid")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("tune_attention needs a GPU (CUDA or ROCm).")
        return 2
    env = environment(DEV)
    out = ["# Paged-attention tuning sweep", ""] + [f"- {k}: {v}" for k, v in env.items()] + [""]
    for part in args.parts.split(","):
        t0 = time.time()
        try:
            if part == "host":
                part_host(out)
            elif part == "decode":
                part_decode(out, args.quick)
            elif part == "prefill":
                part_prefill(out, args.quick)
            elif part == "grid":
                part_grid(out)
            else:
                raise ValueError(f"unknown part {part!r}")
        except Exception as exc:
            out.append(f"part {part} failed: {type(exc).__name__}: {exc}\n")
        out.append(f"({part}: {time.time() - t0:.0f} s)\n")
        print("\n".join(out[-2:]), flush=True)
    out.append("correctness: " + ("all checks passed" if not FAILED else "FAILED: " + "; ".join(FAILED)))
    path = Path(args.out) / f"attention_sweep_{gpu_slug(DEV)}.md"
    path.write_text("\n".join(out) + "\n")
    print(out[-1])
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())

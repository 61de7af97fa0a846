"""Attention time against the distance between one layer's KV blocks: is the contiguous layout's gap an address pattern?

    python3 benchmarks/experiments/block_stride.py [--prefill] [--quick] [--device cpu]

Issue 38: decode of 4 x 32k keys is ~12 % slower on the contiguous layout than on the per-layer one (bench_peers,
every run since 11-30), whose only difference for the kernel is the block stride: per-layer, one layer's K blocks
lie 32 KiB apart (dense); contiguous, a block's K and V of every layer sit side by side, so one layer's blocks lie
layers x 64 KiB apart (bench_peers' cache: 8 layers, 512 KiB; Llama-3-8B's 32 layers: 2 MiB, one block a 2 MiB
page). Hypothesis: the GPU's TLB (a 2 MiB page holds 64 K blocks dense, 4 at 512 KiB, 1 at 2 MiB) or the L2's
address hashing, not the kernel's arithmetic.

The same kernel on the same values with only the stride changed: K and V of block b at b x S and b x S + 32 KiB of
one buffer (S >= 64 KiB; the contiguous layout's arrangement), against the dense per-layer tensors; block tables
random (as bench_peers' and a long-running engine's) and in order (a fresh engine's). CUDA-graph replay, median.
Every output is checked against a float64 reference. Writes benchmarks/results/block_stride_<gpu>.md.

--prefill: one causal prompt of 32k tokens instead (H100, bench_peers 2026-12-07: 8.4 % slower on the contiguous
layout, 19437 against 17928 us, where 1 x 8k was not). A prefill reads each key tile once for every query tile after
it, from programs spread over the whole prompt at once: the pages in use at a time are the prompt's, where a
decode's are its programs' current tiles. Checked on the last 256 query rows (the float64 reference of the whole
prompt would take 32 x 32k x 32k scores); writes block_stride_prefill_<gpu>.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import _bench_common as bc  # noqa: E402
from _bench_common import BLOCK, DT, HEAD, KV_HEADS, Q_HEADS  # noqa: E402

_ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
_ap.add_argument("--prefill", action="store_true", help="one causal 32k prompt instead of 4 x 32k decodes")
ARGS = bc.bench_args(_ap)

import torch  # noqa: E402

from kvcached.kernels import paged_attention  # noqa: E402
from kvcached.kernels.reference import paged_attention_ref  # noqa: E402

DEV = torch.device(ARGS.device or ("cuda" if torch.cuda.is_available() else "cpu"))
KiB = 1 << 10
BLOCK_BYTES = BLOCK * KV_HEADS * HEAD * DT.itemsize  # one block of K (or V): 32 KiB


def strided(dense_k: torch.Tensor, dense_v: torch.Tensor, stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views whose block b lies at b x stride (bytes) and 32 KiB after it, holding the dense values."""
    nb = dense_k.shape[0]
    buf = torch.empty((nb - 1) * stride + 2 * BLOCK_BYTES, dtype=torch.uint8, device=dense_k.device).view(DT)
    shape, step = tuple(dense_k.shape), stride // DT.itemsize
    inner = (KV_HEADS * HEAD, HEAD, 1)
    k = buf.as_strided(shape, (step, *inner))
    v = buf.as_strided(shape, (step, *inner), BLOCK_BYTES // DT.itemsize)
    k.copy_(dense_k)
    v.copy_(dense_v)
    return k, v


CHECK_ROWS = 256  # --prefill: the query rows checked against float64 (the prompt's last)


def main() -> None:
    seqs, keys = (2, 256) if ARGS.quick or DEV.type != "cuda" else (4, 32768)
    if ARGS.prefill:
        seqs = 1
    strides = [64 * KiB, 512 * KiB, 2048 * KiB] if DEV.type != "cuda" else [
        64 * KiB, 128 * KiB, 256 * KiB, 512 * KiB, 1024 * KiB, 2048 * KiB, 4096 * KiB]
    torch.manual_seed(0)
    nb = -(-keys // BLOCK)
    q_len = keys if ARGS.prefill else 1
    q = torch.randn(seqs * q_len, Q_HEADS, HEAD, dtype=DT, device=DEV)
    kd = torch.randn(seqs * nb, BLOCK, KV_HEADS, HEAD, dtype=DT, device=DEV)
    vd = torch.randn_like(kd)
    lens = torch.full((seqs,), keys, dtype=torch.int32, device=DEV)
    qsl = torch.arange(seqs + 1, dtype=torch.int32, device=DEV) * q_len
    tables = {"random": torch.randperm(seqs * nb, device=DEV).to(torch.int32).view(seqs, nb),
              "in order": torch.arange(seqs * nb, device=DEV, dtype=torch.int32).view(seqs, nb)}

    def call(k: torch.Tensor, v: torch.Tensor, table: torch.Tensor):
        return lambda: paged_attention(q, k, v, table, lens, qsl, max_query_len=q_len, max_seq_len=keys,
                                       scale=HEAD**-0.5, min_query_len=q_len)

    rows = min(CHECK_ROWS, q_len) if ARGS.prefill else q.shape[0]  # the last rows: every decode row
    qsl_check = torch.tensor([0, rows], dtype=torch.int32, device=DEV) if ARGS.prefill else qsl

    def timed(fn) -> float:
        t = bc.graph_time_us(fn, DEV)
        return t if t is not None else bc.time_us(fn, DEV)

    what = f"prefill 1 x {keys} (causal)" if ARGS.prefill else f"decode {seqs} x {keys} keys"
    table_out = bc.Table(f"{what}, bf16, {Q_HEADS} q / {KV_HEADS} KV heads, d{HEAD}, block "
                         f"{BLOCK}: time (us) by block stride", ["block table", "K/V layout", "block stride",
                                                                 "blocks a 2 MiB page", "us", "vs dense", "check"])
    env = bc.environment(DEV)

    def report(quiet: bool = True) -> None:  # after every row, so a run cut short still leaves what it measured
        bc.write_report(ARGS.out, f"block_stride_{'prefill_' if ARGS.prefill else ''}{bc.gpu_slug(DEV)}",
                        f"{'Prefill' if ARGS.prefill else 'Decode'} time by KV block stride", env, [],
                        [table_out], quiet=quiet)

    table_out.notes.append("contiguous layout of Llama-3-8B's shape (32 layers): 2048 KiB; bench_peers' contiguous "
                           "cache (8 layers): 512 KiB")
    for name, table in tables.items():
        want = paged_attention_ref(q[-rows:], kd, vd, table, lens, qsl_check, scale=HEAD**-0.5)  # float64
        fn = call(kd, vd, table)
        check = bc.close(fn()[-rows:], want, f"{name} dense")
        base = timed(fn)
        table_out.add(name, "dense per-layer (K, V apart)", "32 KiB", 64, base, 1.0, check)
        for s in strides:
            k, v = strided(kd, vd, s)
            fn = call(k, v, table)
            check = bc.close(fn()[-rows:], want, f"{name} stride {s // KiB} KiB")
            t = timed(fn)
            table_out.add(name, "K, V side by side (contiguous)", f"{s // KiB} KiB", max(1, (2048 * KiB) // s), t,
                          t / base, check)
            report()
            del k, v
            bc.free_memory(DEV)
    report(quiet=False)
    if bc.FAILED_CHECKS:
        sys.exit("wrong outputs: " + "; ".join(bc.FAILED_CHECKS))


if __name__ == "__main__":
    main()

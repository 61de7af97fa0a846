#!/usr/bin/env python
"""KV-cache write tile sweep on the GPU: every (tokens a program, warps) pair, beside a copy of the same bytes.

    python benchmarks/sweep_kv_write.py

65,536 tokens x 8 KV heads x head 128, bf16, block 16, slots a random permutation of a
cache twice that size (so writes scatter as in serving); direct launches of the write
kernel, graph replay, best of 3 captures. Bytes = read K and V + write them + the slots.
The copy row is ``y.copy_(x)`` of the same K+V bytes (read + write), timed the same way.
Each row checks that every token landed in its slot, bit for bit.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import triton  # noqa: E402
from _bench_common import Table, environment, gpu_slug, graph_time_us, write_report  # noqa: E402

from kvcached.kernels import write_kv  # noqa: E402

DEV = torch.device("cuda")
T, H, D, BS = 65536, 8, 128, 16


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("sweep_kv_write.py times GPU kernels: it needs a CUDA or ROCm GPU.")
    nb = T // BS * 2
    key = torch.randn(T, H, D, dtype=torch.bfloat16, device=DEV)
    val = torch.randn(T, H, D, dtype=torch.bfloat16, device=DEV)
    kc = torch.zeros(nb, BS, H, D, dtype=torch.bfloat16, device=DEV)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(nb * BS, device=DEV)[:T].to(torch.int64)
    one = torch.ones(1, device=DEV)
    x = torch.empty(2 * T * H * D, dtype=torch.bfloat16, device=DEV).normal_()
    y = torch.empty_like(x)
    t_copy = min(graph_time_us(lambda: y.copy_(x), DEV) for _ in range(3))
    copy_bw = 2 * x.numel() * 2 / t_copy / 1e6
    moved = 2 * T * H * D * 2 * 2 + T * 8
    default = write_kv.launch_config(H, D)
    tab = Table("KV write tiles (65,536 tokens, random slots)",
                ["tokens a program", "warps", "us (best of 3)", "TB/s", "% of same-size copy", "check"])
    tab.add("copy", "-", t_copy, copy_bw, 100.0, "-")

    def launch(bt: int, w: int) -> None:
        write_kv._write_kv_kernel[(triton.cdiv(T, bt),)](
            key, val, kc, vc, slots, one, one, T, nb * BS, BS, H, D,
            *key.stride(), *val.stride(), *kc.stride(), *vc.stride(), FP8=False, FP8_MAX=448.0,
            BLOCK_T=bt, BLOCK_H=H, BLOCK_D=D, num_warps=w,
        )  # fmt: skip

    for bt in (1, 2, 4, 8, 16, 32):
        for w in (1, 2, 4, 8, 16):
            per_thread = bt * H * D // (w * 32)
            if not 8 <= per_thread <= 128:  # under one 16-byte vector, or spilling
                continue
            kc.zero_()
            vc.zero_()
            launch(bt, w)
            ok = torch.equal(kc.view(-1, H, D)[slots], key) and torch.equal(vc.view(-1, H, D)[slots], val)
            t = min(graph_time_us(lambda bt=bt, w=w: launch(bt, w), DEV) for _ in range(3))
            mark = " (default)" if (bt, w) == (default["BLOCK_T"], default["num_warps"]) else ""
            tab.add(f"{bt}{mark}", w, t, moved / t / 1e6, 100 * moved / t / 1e6 / copy_bw, "ok" if ok else "WRONG")
            print(tab.rows[-1], flush=True)
    write_report(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                 f"kv_write_tiles_{gpu_slug(DEV)}", "KV write tile sweep", environment(DEV), [], [tab])


if __name__ == "__main__":
    main()

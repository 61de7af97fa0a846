#!/usr/bin/env python
"""Small-batch decode against dense SDPA flash: the block table's pattern, and each side's kernels.

    python benchmarks/decode_vs_sdpa.py

Issue 10 asks our paged decode to match dense SDPA (flash backend, K/V already gathered per
sequence) at batch 1 and 8 x 8k and 4 x 32k. Two questions this answers on the same data, in a
process that never imports vLLM (FACTS.md: its import slows SDPA):

1. Does the paging cost the gap? Ours with the block table in three patterns: random (a
   randperm of the cache, as every other benchmark here), in order (each sequence's blocks
   contiguous), and whole 2 MiB groups of blocks in random order, shuffled within a group (what
   kvcached's block pool hands out). Graph replay, the implementations in turn, 3 rounds.
2. Where the time goes: the kernels of one call and their GPU times (torch.profiler, 20 eager
   calls; our eager call merges its splits inside the decode kernel, so ours is also profiled
   with that merge off, ``decode_fused_reduce=0``, the CUDA-graph path).

bf16, 32 query / 8 KV heads, head 128, block 16; every implementation's output for the first sequence of each
batch checked against float64 (the check column; the whole batch in float64 would take minutes).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _bench_common import (  # noqa: E402
    BLOCK,
    HEAD,
    KV_HEADS,
    Q_HEADS,
    Table,
    close,
    environment,
    gathered_kv,
    gpu_slug,
    graph_time_us,
    paged_batch,
    write_report,
)
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from kvcached.kernels import attention_config as cfg  # noqa: E402
from kvcached.kernels import paged_attention  # noqa: E402
from kvcached.kernels.reference import paged_attention_ref  # noqa: E402

DEV = torch.device("cuda")
GROUP = (2 << 20) // (BLOCK * KV_HEADS * HEAD * 2)  # blocks of one layer's K in 2 MiB
CASES = ((1, 8192), (8, 8192), (4, 32768), (64, 8192))
PATTERNS = ("random", "in order", "2 MiB groups")


def block_table(pattern: str, b: int, nb: int) -> torch.Tensor:
    """The other patterns over the same b x nb blocks ("random" is paged_batch's randperm)."""
    cache = b * nb
    if pattern == "in order":
        t = torch.arange(cache, device=DEV)
    else:
        groups = torch.randperm(cache // GROUP, device=DEV)
        t = (groups[:, None] * GROUP + torch.argsort(torch.rand(len(groups), GROUP, device=DEV), dim=1)).flatten()
    return t.to(torch.int32).view(b, nb)


def kernels_of(fn) -> str:
    """The GPU kernels of one call and their mean time over 20 eager calls."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            name = e.name.split("<")[0].replace("void ", "").split("(")[0]
            times.setdefault(name, []).append(e.device_time)
    return "; ".join(f"{n} {sum(v) / len(v):.1f} us" for n, v in times.items())


def ours_call(q, kc, vc, table, lens, qsl, s: int):
    return lambda: paged_attention(q, kc, vc, table, lens, qsl, max_query_len=1, max_seq_len=s, scale=HEAD**-0.5,
                                   min_query_len=1)


def sdpa_call(q, kc, vc, table, b: int):
    """Dense SDPA flash on each sequence's K/V gathered contiguously (what it is given in bench_peers.py too)."""
    k, v = gathered_kv(kc, vc, table)
    q4 = q.view(b, 1, Q_HEADS, HEAD).transpose(1, 2).contiguous()

    def fn():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True).transpose(1, 2).reshape(b, Q_HEADS, HEAD)

    return fn


def run_case(b: int, s: int, tab: Table, prof: Table) -> None:
    q, table, lens, qsl, _bases, kc, vc = paged_batch([1] * b, [s] * b, 0, DEV)
    tables = {p: table if p == "random" else block_table(p, b, s // BLOCK) for p in PATTERNS}
    calls = [("ours", p, ours_call(q, kc, vc, t, lens, qsl, s), t) for p, t in tables.items()]
    calls.append(("SDPA flash", "dense (gathered)", sdpa_call(q, kc, vc, tables["random"], b), tables["random"]))
    checks = []
    for impl, pattern, fn, t in calls:  # the first sequence against float64 (the whole batch costs minutes)
        want = paged_attention_ref(q[:1], kc, vc, t[:1], lens[:1], qsl[:2], scale=HEAD**-0.5)
        checks.append(close(fn()[:1], want, f"{impl} {b}x{s} {pattern}"))
    rounds = [[graph_time_us(fn, DEV) for _, _, fn, _ in calls] for _ in range(3)]
    for i, (impl, pattern, _, _) in enumerate(calls):
        ts = [r[i] for r in rounds]
        tab.add(f"{b}x{s}", impl, pattern, *ts, min(ts), checks[i])
        print(tab.rows[-1], flush=True)
    ours_random, sdpa = calls[0][2], calls[-1][2]
    prof.add(f"{b}x{s}", "ours, eager (merge in the decode kernel)", kernels_of(ours_random))
    with cfg.override(decode_fused_reduce=0):
        prof.add(f"{b}x{s}", "ours, merge launch (the graph path)", kernels_of(ours_random))
    prof.add(f"{b}x{s}", "SDPA flash", kernels_of(sdpa))
    for row in prof.rows[-3:]:
        print(row, flush=True)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("decode_vs_sdpa.py times GPU kernels: it needs a CUDA or ROCm GPU.")
    assert "vllm" not in sys.modules
    tab = Table("Decode by block-table pattern beside dense SDPA flash (graph replay, us, 3 rounds in turn)",
                ["case", "impl", "block table", "round 1", "round 2", "round 3", "best", "check"])
    prof = Table("The kernels of one call (torch.profiler, mean of 20 eager calls)", ["case", "impl", "kernels"])
    for b, s in CASES:
        run_case(b, s, tab, prof)
        torch.cuda.empty_cache()
    write_report(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                 f"decode_vs_sdpa_{gpu_slug(DEV)}", "Small-batch decode against dense SDPA flash", environment(DEV),
                 [], [tab, prof])


if __name__ == "__main__":
    main()

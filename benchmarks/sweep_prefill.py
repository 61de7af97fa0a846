#!/usr/bin/env python
"""Time the prefill path (and the mixed batch) under prefill-tile overrides; writes a markdown table.

    python benchmarks/sweep_prefill.py                                   # the defaults, then the tile sweep
    python benchmarks/sweep_prefill.py --root OLD_CHECKOUT --tag before --tiles ""   # another kvcached (A/B)

Cases (bf16, 32 query / 8 KV heads, head 128, block 16, random block tables, per-layer
cache): one causal 8k prompt; 8 prompts of 1k; 4 chunks of 1024 new tokens after 3072
cached ones; those chunks beside 60 decodes of 8k (the mixed batch of bench_peers); the
60 decodes alone; the 8k prompt with softcap 30, a 4096-key sliding window, ALiBi or sinks, and
8 x 1k with softcap (the ``FEATURES`` compile); the 8k prompt and 8 x 1k with an fp8 (e4m3) cache,
and the 8k one with fp8 and softcap. FLOPs count
only the causal pairs (4 x heads x head size x visible keys per query token). Each time
is the median of 3 CUDA-graph captures (min..max shown), after the last 64 query rows of
the first and last sequence are checked against float64. ``--tiles`` is a comma-separated
list of BLOCK_MxBLOCK_NxWARPSxSTAGES[xAHEAD] for ``attention_config.override`` (AHEAD: 1 loads
each key tile's block ids a tile ahead, 0 in the tile's own iteration; left out: the default). With ``--profile``
the mixed batch also gets a per-kernel breakdown from torch.profiler.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import zlib

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--root", default=".", help="the kvcached checkout to import (for an A/B against another)")
ap.add_argument("--tag", default="head", help="label of this run (file name: prefill_tiles_<gpu>_<tag>.md)")
ap.add_argument("--tiles", default="256x64x16x3,256x64x8x3,128x128x8x3,256x64x16x2,256x32x16x3,128x64x4x4",
                help="BLOCK_MxBLOCK_NxWARPSxSTAGES[xAHEAD] override sets, after the defaults ('' for none)")
ap.add_argument("--sweep", default="[]", help='JSON list of other override knob sets, e.g. [{"prefill_bt_ahead": 0}]')
ap.add_argument("--profile", action="store_true", help="per-kernel times of the mixed batch (torch.profiler)")
ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
ARGS = ap.parse_args()

import torch  # noqa: E402
from _bench_common import (  # noqa: E402
    HEAD,
    Q_HEADS,
    Table,
    environment,
    gpu_slug,
    graph_time_us,
    kernel_modules,
    paged_batch,
    prefill_flops,
    write_report,
)

kvcached, pa, cfg, ref = kernel_modules(ARGS.root)

DEV = torch.device("cuda")

CASES = [
    ("prefill 1x8192", [8192], [8192], {}),
    ("prefill 8x1024", [1024] * 8, [1024] * 8, {}),
    ("chunks 4x1024(+3072)", [1024] * 4, [4096] * 4, {}),
    ("mixed 4x1024(+3072) + 60x8192", [1024] * 4 + [1] * 60, [4096] * 4 + [8192] * 60, {}),
    ("decodes 60x8192", [1] * 60, [8192] * 60, {}),
    ("prefill 1x8192 softcap 30", [8192], [8192], {"softcap": 30.0}),
    ("prefill 1x8192 window 4096", [8192], [8192], {"sliding_window": 4096}),
    ("prefill 1x8192 alibi", [8192], [8192], {"alibi": True}),
    ("prefill 1x8192 sinks", [8192], [8192], {"sinks": True}),
    ("prefill 8x1024 softcap 30", [1024] * 8, [1024] * 8, {"softcap": 30.0}),
    ("prefill 1x8192 fp8", [8192], [8192], {"fp8": True}),
    ("prefill 8x1024 fp8", [1024] * 8, [1024] * 8, {"fp8": True}),
    ("prefill 1x8192 fp8 softcap 30", [8192], [8192], {"fp8": True, "softcap": 30.0}),
]
TILED = {name for name, *_ in CASES} - {"chunks 4x1024(+3072)", "decodes 60x8192"}  # the cases a tile sweep times


def run(name: str, q_lens: list[int], seq_lens: list[int], extra: dict, knobs: dict) -> tuple:
    q, table, lens, qsl, bases, kc, vc = paged_batch(q_lens, seq_lens, zlib.crc32(name.encode()), DEV)
    extra = dict(extra)
    if extra.pop("fp8", False):  # an e4m3 copy of the cache (dense per-layer strides), scales 1
        kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
        one = torch.ones(1, dtype=torch.float32, device=DEV)
        extra.update(k_scale=one, v_scale=one)
    gen = torch.Generator().manual_seed(3)  # ALiBi slopes and sink logits of the size models use
    if extra.pop("alibi", False):
        extra["alibi_slopes"] = (torch.rand(Q_HEADS, generator=gen) * 0.05).to(DEV)
    if extra.pop("sinks", False):
        extra["sinks"] = (torch.randn(Q_HEADS, generator=gen) * 2).to(DEV)

    def fn():
        return pa.paged_attention(q, kc, vc, table, lens, qsl, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
                                  scale=HEAD**-0.5, **extra)

    with cfg.override(**knobs) if knobs else contextlib.nullcontext():
        o = fn()
        err, st = 0.0, qsl.tolist()
        for i in (0, len(q_lens) - 1):
            a, b = max(st[i], st[i + 1] - 64), st[i + 1]
            want = ref.paged_attention_ref(q[a:b], kc, vc, table[i:i + 1], lens[i:i + 1],
                                           torch.tensor([0, b - a], dtype=torch.int32, device=DEV),
                                           scale=HEAD**-0.5, **extra)
            err = max(err, (o[a:b].double() - want.double()).abs().max().item())
        ts = [graph_time_us(fn, DEV) for _ in range(3)]
        prof = profile(fn) if ARGS.profile and name.startswith("mixed") else ""
    t = statistics.median(ts)
    f = prefill_flops(q_lens, seq_lens, extra.get("sliding_window", 0))
    return t, min(ts), max(ts), (f / t / 1e6 if f else None), err, prof


def profile(fn) -> str:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    parts = [f"{e.key} {e.device_time_total / e.count:.0f} us" for e in p.key_averages() if e.key.endswith("_kernel")]
    return "; ".join(parts)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("sweep_prefill.py times GPU kernels: it needs a CUDA or ROCm GPU.")
    tiles = [tuple(int(x) for x in c.split("x")) for c in ARGS.tiles.split(",") if c]
    tab = Table(f"Prefill tiles ({ARGS.tag}: {os.path.relpath(os.path.dirname(kvcached.__file__))})",
                ["case", "tile (rows x keys, warps, stages)", "us (median)", "min..max", "TFLOP/s", "max err",
                 "kernels (profiler)"])
    names = ("prefill_block_m", "prefill_block_n", "prefill_num_warps", "prefill_num_stages", "prefill_bt_ahead")
    sets = [(dict(zip(names[:len(t)], t, strict=True)),
             "{}x{}, {}, {}".format(*t) + (f", ids ahead {t[4]}" if len(t) > 4 else "")) for t in tiles]
    sets += [(k, json.dumps(k)) for k in json.loads(ARGS.sweep)]
    runs = [(({}, "default"), c) for c in CASES] + [(s, c) for s in sets for c in CASES if c[0] in TILED]
    for (knobs, label), (name, ql, sl, extra) in runs:
        try:
            t, lo, hi, tflops, err, prof = run(name, ql, sl, extra, knobs)
            torch.cuda.empty_cache()  # the case's cache went with run()
            tab.add(name, label, t, f"{lo:.0f}..{hi:.0f}", tflops, f"{err:.1e}", prof or "-")
        except Exception as exc:  # a tile that does not compile or launch is a row, not the end
            tab.add(name, label, None, "-", None, f"ERROR {type(exc).__name__}: {str(exc)[:120]}", "-")
        print(tab.rows[-1], flush=True)
    tab.notes.append("default = attention_config.prefill_base for this GPU; rows are (query token, query head) "
                     "pairs where the kvcached imported packs the group (see attention_prefill.py)")
    write_report(ARGS.out, f"prefill_tiles_{gpu_slug(DEV)}_{ARGS.tag}", "Prefill tile sweep", environment(DEV),
                 [], [tab])


if __name__ == "__main__":
    main()

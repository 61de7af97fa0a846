#!/usr/bin/env python
"""Kernel benchmark: paged attention (decode, prefill), KV write and MLA decode on both layouts.

    python benchmarks/bench_kernels.py            # full run (GPU, < 6 min on an H200)
    python benchmarks/bench_kernels.py --quick    # a handful of shapes
    python benchmarks/bench_kernels.py --quick --device cpu   # plumbing only (Triton interpreter)
    python benchmarks/bench_kernels.py --only short           # some sections (kernels_<gpu>_short.md)

Runs unchanged on NVIDIA and ROCm. Ceilings are measured in the same run; every
timed kernel's output is first checked against a float64 reference on a slice.
Writes benchmarks/results/kernels_<gpu>.md (+ .png when matplotlib is there).

Counting (bf16 = 2 B; H = query heads, Hk = KV heads, D = head size, S = context):
- decode bytes  = B*S*Hk*D*2*2 (K and V read once) + B*H*D*2*2 (query in, output out)
- decode FLOPs  = 4*B*H*S*D (QK^T and PV)
- prefill FLOPs = 4*H*D*n*(n+1)/2 (causal: query i sees i+1 keys)
- write bytes   = 2 (K,V) * T*Hk*D*2 * 2 (read the input, write the cache) + T*8 (slots)
- MLA bytes     = B*S*576*2 (the latent read once) + B*H*(576+512)*2; FLOPs = 2*B*H*S*(576+512)
- copy ceiling: bytes = 2 * buffer (read + write); gather ceiling: bytes read by a Triton
  kernel summing random 32 KiB blocks; matmul ceiling: 2*n^3.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

SECTIONS = ("decode", "prefill", "write", "mla", "short")


from _bench_common import bench_args  # noqa: E402  (torch only: the kernels come once the device is known)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mem-gb", type=float, default=100.0, help="skip shapes whose largest phase exceeds this")
    ap.add_argument("--no-flex", action="store_true", help="skip the FlexAttention peer (its compiles are slow)")
    ap.add_argument("--only", default="", help="comma-separated sections of " + ",".join(SECTIONS) +
                    "; the table then goes to kernels_<gpu>_<sections>.md, leaving the full one as it was")
    return bench_args(ap)  # --quick, --out, --device


ARGS = parse_args()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from _bench_common import (  # noqa: E402
    BLOCK,
    DT,
    FAILED_CHECKS,
    GB,
    HEAD,
    KV_HEADS,
    Q_HEADS,
    Table,
    close,
    environment,
    err_text,
    free_memory,
    gathered_kv,
    gpu_slug,
    graph_time_us,
    kv_cache,
    layers_for,
    mla_cache,
    peer_call,
    time_us,
    vllm_peers,
    write_report,
)

from kvcached.kernels import paged_attention, paged_mla_decode, write_kv_cache  # noqa: E402
from kvcached.kernels.reference import mla_decode_ref, paged_attention_ref  # noqa: E402
from kvcached.layout import Layout  # noqa: E402

T_START = time.time()
FLEX_DEADLINE_S = 240  # FlexAttention compiles per shape; stop adding flex rows after this
DEV = torch.device(ARGS.device or ("cuda" if torch.cuda.is_available() else "cpu"))
GPU = DEV.type == "cuda"


# -- ceilings ---------------------------------------------------------------------------------
@triton.jit
def _gather_sum_kernel(x_ptr, idx_ptr, out_ptr, BLOCK_ELEMS: tl.constexpr, CHUNK: tl.constexpr):
    pid = tl.program_id(0)
    blk = tl.load(idx_ptr + pid).to(tl.int64)
    acc = tl.zeros([CHUNK], dtype=tl.float32)
    for c in range(0, BLOCK_ELEMS, CHUNK):
        acc += tl.load(x_ptr + blk * BLOCK_ELEMS + c + tl.arange(0, CHUNK)).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


def ceilings(tab: Table) -> dict[str, float]:
    size = (4 << 30) if GPU and not ARGS.quick else ((1 << 30) if GPU else (1 << 20))
    x = torch.randn(size // 2, dtype=DT, device=DEV)
    y = torch.empty_like(x)
    t = time_us(lambda: y.copy_(x), DEV)
    copy_bw = 2 * size / t / 1e6
    tab.add("copy (y.copy_(x))", f"{size >> 20} MiB", t, f"{copy_bw:.2f} TB/s")
    blk_elems = 16384  # 32 KiB of bf16
    nblk = x.numel() // blk_elems
    idx = torch.randperm(nblk, device=DEV).to(torch.int32)
    out = torch.empty(nblk, dtype=torch.float32, device=DEV)

    def gather():
        _gather_sum_kernel[(nblk,)](x, idx, out, BLOCK_ELEMS=blk_elems, CHUNK=4096 if GPU else 16384, num_warps=8)

    gather()
    want = x.view(nblk, blk_elems).float().sum(1)[idx.long()]
    if not torch.allclose(out, want, rtol=1e-3, atol=1e-1):
        FAILED_CHECKS.append("gather ceiling kernel")
    t = time_us(gather, DEV)
    gather_bw = size / t / 1e6
    tab.add("gathered read, random 32 KiB blocks (Triton)", f"{size >> 20} MiB", t, f"{gather_bw:.2f} TB/s")
    n = 8192 if GPU and not ARGS.quick else (4096 if GPU else 256)
    a = torch.randn(n, n, dtype=DT, device=DEV)
    b = torch.randn(n, n, dtype=DT, device=DEV)
    t = time_us(lambda: a @ b, DEV)
    mm = 2 * n**3 / t / 1e6
    tab.add(f"bf16 matmul {n}^3", "-", t, f"{mm:.0f} TFLOP/s")
    return {"copy": copy_bw, "gather": gather_bw, "matmul": mm}


# -- decode ----------------------------------------------------------------------------------
def flex_decode_fn(q, kc, vc, table, ctx):
    """FlexAttention over the paged cache itself: KV = the layer's [1, Hk, N*16, D] tokens, a block
    mask listing each sequence's physical blocks (per-layer layout only: blocks must be dense)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    n_blocks = kc.shape[0]
    b, nb = table.shape
    kp = kc.reshape(n_blocks * BLOCK, KV_HEADS, HEAD).permute(1, 0, 2).unsqueeze(0).expand(b, -1, -1, -1)
    vp = vc.reshape(n_blocks * BLOCK, KV_HEADS, HEAD).permute(1, 0, 2).unsqueeze(0).expand(b, -1, -1, -1)
    owner = torch.full((n_blocks,), -1, dtype=torch.int32, device=DEV)
    owner[table.long()] = torch.arange(b, dtype=torch.int32, device=DEV)[:, None].expand(b, nb)
    idx = torch.zeros(b, 1, 1, n_blocks, dtype=torch.int32, device=DEV)
    idx[..., :nb] = table.view(b, 1, 1, nb)
    none = torch.zeros(b, 1, 1, dtype=torch.int32, device=DEV)
    full = torch.full((b, 1, 1), nb, dtype=torch.int32, device=DEV)
    mask = BlockMask.from_kv_blocks(none, torch.zeros_like(idx), full, idx, BLOCK_SIZE=(1, BLOCK),
                                    mask_mod=lambda bb, h, qi, kv: owner[kv // BLOCK] == bb,
                                    seq_lengths=(1, n_blocks * BLOCK))
    fa = torch.compile(flex_attention, dynamic=False) if GPU else flex_attention
    q4 = q.unsqueeze(2)
    return lambda: fa(q4, kp, vp, block_mask=mask, enable_gqa=True).squeeze(2)


def flex_dense_fn(q4, k, v, causal):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    fa = torch.compile(flex_attention, dynamic=False) if GPU else flex_attention
    mask = None
    if causal:
        n = q4.shape[2]
        mask = create_block_mask(lambda b, h, qi, kv: qi >= kv, 1, None, n, n, device=DEV)
    return lambda: fa(q4, k, v, block_mask=mask, enable_gqa=True)


def run_decode(tab: Table, ceil: dict[str, float], shapes, flex_shapes: set) -> dict:
    series: dict = {}
    for batch, ctx in shapes:
        nb = ctx // BLOCK
        num_blocks = batch * nb
        per_layer = num_blocks * BLOCK * KV_HEADS * HEAD * 2 * 2
        if 2 * per_layer > ARGS.mem_gb * GB:
            tab.add(batch, ctx, "all", None, None, None, None, None, None,
                    f"skipped: {2 * per_layer / GB:.0f} GB > budget")
            continue
        bytes_moved = per_layer + batch * Q_HEADS * HEAD * 2 * 2
        q = torch.randn(batch, Q_HEADS, HEAD, dtype=DT, device=DEV)
        table = torch.randperm(num_blocks, device=DEV).to(torch.int32).view(batch, nb)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
        qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
        sl = min(batch, 2)
        want = None
        times = {}
        for layout in (Layout.PER_LAYER, Layout.CONTIGUOUS):
            layers = layers_for(layout, per_layer, ARGS.mem_gb)
            try:
                bases, kc, vc = kv_cache(layout, num_blocks, layers, DEV)
                if want is None or layout is Layout.CONTIGUOUS:
                    want = paged_attention_ref(q[:sl], kc, vc, table[:sl], lens[:sl], qsl[: sl + 1],
                                               scale=HEAD**-0.5)

                def fn(kc=kc, vc=vc, q=q, table=table, lens=lens, qsl=qsl, ctx=ctx):
                    return paged_attention(q, kc, vc, table, lens, qsl, max_query_len=1, max_seq_len=ctx,
                                           scale=HEAD**-0.5)

                check = close(fn()[:sl], want, f"decode {layout.value} b{batch} s{ctx}")
                t_eager = time_us(fn, DEV)
                t_graph = graph_time_us(fn, DEV)
                t = t_graph or t_eager
                times[layout] = t
                bw = bytes_moved / t / 1e6
                note = f"{layers} layer(s), block stride {kc.stride(0) * 2 // 1024} KiB"
                ratio = times[layout] / times[Layout.PER_LAYER] if layout is Layout.CONTIGUOUS else None
                tab.add(batch, ctx, f"ours {layout.value}", t_eager, t_graph, bw, 100 * bw / ceil["gather"], ratio,
                        check, note)
                series.setdefault(f"ours {layout.value}", []).append((batch, ctx, bw))
                if layout is Layout.PER_LAYER:
                    try:  # a failing peer is its own row, never charged to ours
                        peers(tab, series, q, kc, vc, table, lens, want, batch, ctx, bytes_moved, ceil, flex_shapes, t)
                    except Exception as exc:
                        tab.add(batch, ctx, "peer", None, None, None, None, None, "ERROR", err_text(exc))
                del bases, kc, vc
                fn = None  # the closure holds the cache: drop it before the next layout allocates
            except Exception as exc:  # a failure is a row of the table, not the end of the run
                tab.add(batch, ctx, f"ours {layout.value}", None, None, None, None, None, "ERROR", err_text(exc))
            free_memory(DEV)
    return series


def peers(tab, series, q, kc, vc, table, lens, want, batch, ctx, bytes_moved, ceil, flex_shapes, t_ours):
    sl = want.shape[0]
    try:  # dense SDPA on the same data, gathered into contiguous [B, Hk, S, D]
        k, v = gathered_kv(kc, vc, table)
        q4 = q.unsqueeze(2)

        def sdpa():
            return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)

        check = close(sdpa()[:sl, :, 0], want, f"decode sdpa b{batch} s{ctx}")
        t_eager = time_us(sdpa, DEV)
        t_graph = graph_time_us(sdpa, DEV)
        t = t_graph or t_eager
        bw = bytes_moved / t / 1e6
        tab.add(batch, ctx, "SDPA dense (peer)", t_eager, t_graph, bw, 100 * bw / ceil["gather"], t / t_ours, check,
                "contiguous K/V, enable_gqa")
        series.setdefault("SDPA dense", []).append((batch, ctx, bw))
    except Exception as exc:
        tab.add(batch, ctx, "SDPA dense (peer)", None, None, None, None, None, "ERROR", err_text(exc))
        k = v = None
    if ARGS.no_flex or (batch, ctx) not in flex_shapes:
        return
    if time.time() - T_START > FLEX_DEADLINE_S:
        tab.add(batch, ctx, "Flex (peer)", None, None, None, None, None, "-",
                "skipped: run time budget (compiles are slow)")
        return
    name, fn, note = "Flex paged (peer)", None, "block mask over the paged per-layer cache"
    try:
        fn = flex_decode_fn(q, kc, vc, table, ctx)
        check = close(fn()[:sl], want, "flex paged")
        if check.startswith("WRONG"):
            FAILED_CHECKS.pop()
            raise RuntimeError(f"paged flex gave a wrong answer ({check})")
    except Exception as exc:
        if k is None:
            tab.add(batch, ctx, name, None, None, None, None, None, "ERROR", err_text(exc))
            return
        name, note = "Flex gathered (peer)", f"paged flex failed ({err_text(exc)[:120]}); plain flex on gathered K/V"
        dense = flex_dense_fn(q.unsqueeze(2), k, v, causal=False)

        def fn():
            return dense().squeeze(2)

        check = close(fn()[:sl], want, "flex gathered")
    t_eager = time_us(fn, DEV)
    try:
        t_graph = graph_time_us(fn, DEV)
    except Exception:  # not every compiled peer can be captured; then the eager time stands
        t_graph = None
    t = t_graph or t_eager
    bw = bytes_moved / t / 1e6
    tab.add(batch, ctx, name, t_eager, t_graph, bw, 100 * bw / ceil["gather"], t / t_ours, check, note)
    series.setdefault("Flex", []).append((batch, ctx, bw))


# -- short queries (speculative decoding) ------------------------------------------------------
def run_short(tab: Table, ceil: dict[str, float], batch: int, ctx: int, q_lens) -> None:
    """Each of ``batch`` sequences of ``ctx`` keys with q new tokens (causal): the KV must be read once."""
    nb = ctx // BLOCK + 1
    num_blocks = batch * nb
    kc = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD, dtype=DT, device=DEV)
    vc = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD, dtype=DT, device=DEV)
    table = torch.randperm(num_blocks, device=DEV).to(torch.int32).view(batch, nb)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    peers_found = vllm_peers() if GPU else {}
    t_decode = None
    for n in q_lens:
        qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEV) * n
        q = torch.randn(batch * n, Q_HEADS, HEAD, dtype=DT, device=DEV)
        bytes_moved = batch * ctx * KV_HEADS * HEAD * 2 * 2 + batch * n * Q_HEADS * HEAD * 2 * 2
        sl = min(batch, 2)
        want = paged_attention_ref(q[: sl * n], kc, vc, table[:sl], lens[:sl], qsl[: sl + 1], scale=HEAD**-0.5)

        def ours(q=q, qsl=qsl, n=n):
            return paged_attention(q, kc, vc, table, lens, qsl, max_query_len=n, max_seq_len=ctx, scale=HEAD**-0.5)

        rows = [("ours", ours, "")]
        for name, peer in peers_found.items():
            if isinstance(peer, Exception):
                rows.append((name, None, f"absent: {err_text(peer)[:100]}"))
            else:
                rows.append((name, peer_call(name, peer, q, kc, vc, table, lens, qsl, n, ctx), ""))
        for name, fn, note in rows:
            if fn is None:
                tab.add(batch, ctx, n, name, None, None, None, None, "-", note)
                continue
            try:
                check = close(fn()[: sl * n], want, f"short {name} q{n}")
                t = graph_time_us(fn, DEV) or time_us(fn, DEV)
                if name == "ours" and n == 1:
                    t_decode = t
                bw = bytes_moved / t / 1e6
                ratio = t / t_decode if t_decode else None
                tab.add(batch, ctx, n, name, t, bw, 100 * bw / ceil["gather"], ratio, check, note)
            except Exception as exc:
                tab.add(batch, ctx, n, name, None, None, None, None, "ERROR", err_text(exc))
            free_memory(DEV)


# -- prefill ---------------------------------------------------------------------------------
def run_prefill(tab: Table, ceil: dict[str, float], sizes, flex_sizes: set[int]) -> None:
    for n in sizes:
        nb = n // BLOCK
        flops = 4 * Q_HEADS * HEAD * n * (n + 1) / 2
        q = torch.randn(n, Q_HEADS, HEAD, dtype=DT, device=DEV)
        table = torch.randperm(nb, device=DEV).to(torch.int32).view(1, nb)
        lens = torch.tensor([n], dtype=torch.int32, device=DEV)
        qsl = torch.tensor([0, n], dtype=torch.int32, device=DEV)
        w = min(64, n)
        t_sdpa = None
        for layout in (Layout.PER_LAYER, Layout.CONTIGUOUS):
            try:
                layers = layers_for(layout, nb * BLOCK * KV_HEADS * HEAD * 4, ARGS.mem_gb)
                bases, kc, vc = kv_cache(layout, nb, layers, DEV)
                # check the first and the last w query rows against float64 (whole context for the last)
                first = paged_attention_ref(q[:w], kc, vc, table, torch.tensor([w], dtype=torch.int32, device=DEV),
                                            torch.tensor([0, w], dtype=torch.int32, device=DEV), scale=HEAD**-0.5)
                last = paged_attention_ref(q[-w:], kc, vc, table, lens,
                                           torch.tensor([0, w], dtype=torch.int32, device=DEV), scale=HEAD**-0.5)

                def fn(kc=kc, vc=vc, q=q, table=table, lens=lens, qsl=qsl, n=n):
                    return paged_attention(q, kc, vc, table, lens, qsl, max_query_len=n, max_seq_len=n,
                                           scale=HEAD**-0.5)

                out = fn()
                check = close(torch.cat([out[:w], out[-w:]]), torch.cat([first, last]), f"prefill {layout.value} {n}")
                # graph replay like the other tables: eager, a 2048-token prompt's ~100 us of GPU time hid behind
                # 200-290 us of host launch (benchmarks/results/prefill_launch_order_h200.md, section 5)
                t = graph_time_us(fn, DEV) or time_us(fn, DEV)
                tf = flops / t / 1e6
                tab.add(n, f"ours {layout.value}", t, tf, 100 * tf / ceil["matmul"], None, check)
                if layout is Layout.PER_LAYER:
                    row = tab.rows[-1]
                    t_sdpa = prefill_peers(tab, ceil, q, kc, vc, table, n, flops, first, last, w, flex_sizes)
                if t_sdpa:
                    row = row if layout is Layout.PER_LAYER else tab.rows[-1]
                    row[5] = f"{t_sdpa / t:.2f}"
                del bases, kc, vc
                fn = None
            except Exception as exc:
                tab.add(n, f"ours {layout.value}", None, None, None, None, "ERROR " + err_text(exc))
            free_memory(DEV)


def prefill_peers(tab, ceil, q, kc, vc, table, n, flops, first, last, w, flex_sizes):
    try:
        k, v = gathered_kv(kc, vc, table)
        q4 = q.transpose(0, 1).unsqueeze(0).contiguous()

        def sdpa():
            return F.scaled_dot_product_attention(q4, k, v, is_causal=True, enable_gqa=True)

        o = sdpa()[0].transpose(0, 1)
        check = close(torch.cat([o[:w], o[-w:]]), torch.cat([first, last]), f"prefill sdpa {n}")
        t = graph_time_us(sdpa, DEV) or time_us(sdpa, DEV)
        tf = flops / t / 1e6
        tab.add(n, "SDPA dense causal (peer)", t, tf, 100 * tf / ceil["matmul"], None, check)
        if not ARGS.no_flex and n in flex_sizes:
            fn = flex_dense_fn(q4, k, v, causal=True)
            o = fn()[0].transpose(0, 1)
            check = close(torch.cat([o[:w], o[-w:]]), torch.cat([first, last]), f"prefill flex {n}")
            tf_flex = flops / time_us(fn, DEV) / 1e6
            tab.add(n, "Flex causal on gathered K/V (peer, not paged)", flops / tf_flex / 1e6, tf_flex,
                    100 * tf_flex / ceil["matmul"], None, check)
        return t
    except Exception as exc:
        tab.add(n, "peers", None, None, None, None, "ERROR " + err_text(exc))
        return None


# -- KV write --------------------------------------------------------------------------------
def run_write(tab: Table, ceil: dict[str, float], tokens: int) -> None:
    bytes_moved = 2 * tokens * KV_HEADS * HEAD * 2 * 2 + tokens * 8
    num_blocks = 2 * tokens // BLOCK
    key = torch.randn(tokens, KV_HEADS, HEAD, dtype=DT, device=DEV)
    value = torch.randn(tokens, KV_HEADS, HEAD, dtype=DT, device=DEV)
    # random slots: every token on its own (the worst case); whole blocks: a prefill's tokens fill the blocks
    # of its sequence in order, the blocks themselves anywhere in the cache (as an engine writes a prompt)
    blocks = torch.randperm(num_blocks, device=DEV)[:tokens // BLOCK]
    patterns = {"random slots": torch.randperm(num_blocks * BLOCK, device=DEV)[:tokens],
                "whole blocks": (blocks[:, None] * BLOCK + torch.arange(BLOCK, device=DEV)).flatten()}
    for name, slots in patterns.items():
        t_per = None
        for layout in (Layout.PER_LAYER, Layout.CONTIGUOUS):
            impl = f"ours {layout.value}, {name}"
            try:
                bases, kc, vc = kv_cache(layout, num_blocks, 1 if layout is Layout.PER_LAYER else 4, DEV)

                def fn(kc=kc, vc=vc, slots=slots):
                    write_kv_cache(key, value, kc, vc, slots)

                fn()
                ok = torch.equal(kc[slots // BLOCK, slots % BLOCK], key) and torch.equal(
                    vc[slots // BLOCK, slots % BLOCK], value)
                if not ok:
                    FAILED_CHECKS.append(f"write {layout.value} {name}")
                # GPU time from a graph replay, as an engine runs it (an eager do_bench call adds the host launch)
                t = graph_time_us(fn, DEV) or time_us(fn, DEV)
                bw = bytes_moved / t / 1e6
                ratio = None if t_per is None else t / t_per
                t_per = t_per or t
                tab.add(tokens, impl, t, bw, 100 * bw / ceil["copy"], ratio, "exact" if ok else "WRONG")
                del bases, kc, vc
                fn = None
            except Exception as exc:
                tab.add(tokens, impl, None, None, None, None, "ERROR " + err_text(exc))
            free_memory(DEV)


# -- MLA decode ------------------------------------------------------------------------------
def run_mla(tab: Table, ceil: dict[str, float], shapes) -> None:
    for batch, heads, ctx in shapes:
        nb = ctx // BLOCK
        num_blocks = batch * nb
        bytes_moved = batch * ctx * 576 * 2 + batch * heads * (576 + 512) * 2
        flops = 2 * batch * heads * ctx * (576 + 512)
        q = torch.randn(batch, heads, 576, dtype=DT, device=DEV)
        table = torch.randperm(num_blocks, device=DEV).to(torch.int32).view(batch, nb)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
        t_per = None
        for layout in (Layout.PER_LAYER, Layout.CONTIGUOUS):
            try:
                bases, cache = mla_cache(layout, num_blocks, 1 if layout is Layout.PER_LAYER else 4, DEV)
                sl = min(batch, 2)
                want = mla_decode_ref(q[:sl], cache, table[:sl], lens[:sl], scale=576**-0.5)

                def fn(cache=cache, q=q, table=table, lens=lens, ctx=ctx):
                    return paged_mla_decode(q, cache, table, lens, scale=576**-0.5, max_seq_len=ctx)

                check = close(fn()[:sl], want, f"mla {layout.value} b{batch} h{heads} s{ctx}")
                # graph replay like the other tables: eager calls are mostly host time at small batches
                # (50-128 us for batch 1 x 8k against 27 under a graph: results/mla_reduce_h200.md)
                t = graph_time_us(fn, DEV) or time_us(fn, DEV)
                bw = bytes_moved / t / 1e6
                ratio = None if t_per is None else t / t_per
                t_per = t_per or t
                tab.add(batch, heads, ctx, f"ours {layout.value}", t, bw, 100 * bw / ceil["gather"],
                        flops / t / 1e6, ratio, check)
                del bases, cache
                fn = None
            except Exception as exc:
                tab.add(batch, heads, ctx, f"ours {layout.value}", None, None, None, None, None,
                        "ERROR " + err_text(exc))
            free_memory(DEV)


# -- output ----------------------------------------------------------------------------------
def plot(series: dict, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no plot"
    ctxs = sorted({c for pts in series.values() for _, c, _ in pts})
    if not ctxs:
        return "no decode data: no plot"
    fig, axes = plt.subplots(1, len(ctxs), figsize=(5 * len(ctxs), 4), squeeze=False)
    for ax, ctx in zip(axes[0], ctxs, strict=True):
        for name, pts in sorted(series.items()):
            xs = [(b, bw) for b, c, bw in pts if c == ctx]
            if xs:
                ax.plot([b for b, _ in xs], [bw for _, bw in xs], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_title(f"decode, context {ctx}")
        ax.set_xlabel("batch")
        ax.set_ylabel("TB/s (K+V bytes / time)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return f"plot: {path.name}"


def main() -> int:
    t_start = time.time()
    torch.manual_seed(0)
    if GPU:
        decode_shapes = [(b, c) for c in (1024, 8192, 32768) for b in (1, 8, 16, 64, 256)]
        prefill_sizes, write_tokens = [2048, 8192, 16384], 65536
        mla_shapes = [(1, 16, 8192), (32, 16, 8192), (128, 16, 4096), (64, 128, 4096)]
        flex_shapes, flex_prefill = {(1, 8192), (8, 8192), (64, 8192), (256, 8192)}, {8192}
        if ARGS.quick:
            decode_shapes, prefill_sizes = [(1, 8192), (64, 8192)], [8192]
            flex_shapes = {(64, 8192)}
            mla_shapes = [(32, 16, 8192)]
    else:  # interpreter: plumbing only
        decode_shapes, prefill_sizes, write_tokens = [(1, 64), (2, 32)], [32], 256
        mla_shapes, flex_shapes, flex_prefill = [(1, 16, 32)], {(1, 64)}, {32}
    only = [x for x in ARGS.only.split(",") if x]
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        raise SystemExit(f"--only: unknown sections {unknown}; choose from {','.join(SECTIONS)}")
    want = set(only or SECTIONS)
    env = environment(DEV)
    ceil_tab = Table("Ceilings measured in this run", ["what", "size", "time (us)", "rate"])
    ceil = ceilings(ceil_tab)
    dec = Table(f"Decode: bf16, {Q_HEADS} query / {KV_HEADS} KV heads, head {HEAD}, block {BLOCK}, random block tables",
                ["batch", "context", "impl", "eager (us)", "graph (us)", "TB/s", "% gather ceiling",
                 "time / ours per-layer", "check vs fp64", "note"])
    dec.notes.append("eager: do_bench of the Python call (includes the host's launch cost); graph: the same call "
                     "replayed from a CUDA graph, what a serving engine sees. TB/s and ratios use the graph time.")
    series = run_decode(dec, ceil, decode_shapes, flex_shapes) if "decode" in want else {}
    pre = Table("Prefill: one causal prompt (graph replay; Flex eager)",
                ["tokens", "impl", "time (us)", "TFLOP/s", "% matmul ceiling", "ours / SDPA TFLOP/s", "check vs fp64"])
    if "prefill" in want:
        run_prefill(pre, ceil, prefill_sizes, flex_prefill)
    wr = Table("KV-cache write (graph replay)", ["tokens", "impl", "time (us)", "TB/s", "% copy ceiling",
                                                 "contig/per-layer time", "check"])
    if "write" in want:
        run_write(wr, ceil, write_tokens)
    mla = Table("MLA decode: latent 576 (512 + 64 rope), block 16, graph replay",
                ["batch", "heads", "context", "impl", "time (us)", "TB/s", "% gather ceiling", "TFLOP/s",
                 "contig/per-layer time", "check vs fp64"])
    if "mla" in want:
        run_mla(mla, ceil, mla_shapes)
    short = Table(f"Short queries (speculative decoding): bf16, {Q_HEADS}/{KV_HEADS} heads, head {HEAD}, block "
                  f"{BLOCK}, causal", ["batch", "context", "q tokens", "impl", "graph (us)", "TB/s",
                                       "% gather ceiling", "time / ours at q=1", "check vs fp64", "note"])
    short.notes.append("bytes = K and V of every sequence read once (as at q=1) + query in and output out; the "
                       "goal at q=4 is 1.15x the q=1 time. vLLM's peers come from its CUDA build when importable.")
    if "short" in want:
        run_short(short, ceil, *((64, 8192) if GPU else (2, 64)), (1, 2, 4, 8, 16))

    out = Path(ARGS.out)
    out.mkdir(parents=True, exist_ok=True)
    slug = gpu_slug(DEV)
    stem = f"kernels_{slug}" + ("_" + "_".join(x for x in SECTIONS if x in want) if only else "")
    plot_note = plot(series, out / f"{stem}.png") if series else "no decode plot"
    lines = [f"- wall time: {time.time() - t_start:.0f} s; {plot_note}",
             f"- correctness: {'all checks passed' if not FAILED_CHECKS else 'FAILED: ' + '; '.join(FAILED_CHECKS)}",
             "", "Formulas: see the docstring of benchmarks/bench_kernels.py (bytes = K+V read once; "
             "FLOPs = 4*B*H*S*D decode, 4*H*D*n(n+1)/2 causal prefill).", ""]
    tables = [ceil_tab] + [t for name, t in zip(SECTIONS, (dec, pre, wr, mla, short), strict=True) if name in want]
    write_report(out, stem, f"Kernel benchmark ({slug})", env, lines, tables)
    return 1 if FAILED_CHECKS else 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m kvcached.demo`` / ``kvcached demo``: elastic KV memory under a request trace.

On the default device (a GPU if torch sees one, else the host backend) it builds
a model-sized KV cache (32 layers, 8 KV heads, head size 128, block 16, bf16) in
both layouts, drives a synthetic trace (arrivals, growing sequences,
completions) through ``KVCacheManager``, writes every allocated block's K and V
through the engine-facing views and checks them when the request completes,
prints mapped memory as it grows and shrinks, and ends with PASS or FAIL.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass, field

import torch

MiB = 1 << 20


@dataclass
class Request:
    rid: int
    target: int  # tokens at completion
    tokens: int = 0
    blocks: list[int] = field(default_factory=list)


@dataclass
class Outcome:
    layout: str
    ok: bool
    steps: int
    completed: int
    stalls: int
    peak_mapped: int
    final_mapped: int
    errors: list[str]
    seconds: float


def _pattern(rid: int, idx: int, layers: int) -> torch.Tensor:
    # integers in [-125, 125] are exact in bf16; V gets a -0.5 offset so K != V
    base = torch.arange(layers, dtype=torch.float32)
    k = ((rid * 7 + idx * 3 + base) % 251) - 125
    return torch.stack([k, -k - 0.5], dim=1)  # (layers, 2)


def _write(views: list[torch.Tensor], blocks: list[int], req: Request, first_idx: int) -> None:
    for i, block in enumerate(blocks):
        vals = _pattern(req.rid, first_idx + i, len(views)).tolist()
        for layer, view in enumerate(views):  # view: (2, N, bs, H, D)
            view[0, block].fill_(vals[layer][0])
            view[1, block].fill_(vals[layer][1])


def _check(views: list[torch.Tensor], req: Request) -> bool:
    """Every element of every block of the request holds what was written there."""
    for i, block in enumerate(req.blocks):
        vals = _pattern(req.rid, i, len(views)).tolist()
        for layer, view in enumerate(views):
            for kv in (0, 1):
                got = view[kv, block]
                if not torch.equal(got, torch.full_like(got, vals[layer][kv])):
                    return False
    return True


def run_layout(device: str, contiguous: bool, *, layers: int, heads: int, head_size: int, block_size: int,
               seed: int, steps: int, quiet: bool, max_mapped_mb: int = 0) -> Outcome:
    from kvcached.integration.vllm import interfaces as vi
    from kvcached.kv_cache_manager import KVCacheManager

    name = "contiguous" if contiguous else "per_layer"
    t0 = time.perf_counter()
    errors: list[str] = []
    vi.init_kvcached(device=device, contiguous_layout=contiguous)
    try:
        dtype = torch.bfloat16
        nb = 1  # alloc_kv_cache sizes the virtual cache to the device
        views, meta = vi.alloc_kv_cache((2, nb, block_size, heads, head_size), block_size, dtype, device, layers,
                                        return_meta=True)
        tdev = views[0].device
        num_blocks = meta["num_blocks_per_layer"]
        cell = heads * head_size * dtype.itemsize
        mgr = KVCacheManager(num_blocks, block_size, cell, layers, reserve_null_block=False)
        if max_mapped_mb:  # a GPU's whole memory would make the trace needlessly long
            mgr.resize(max(1, max_mapped_mb * MiB // mgr.page_group_bytes) * mgr.page_size)
        cap_blocks = mgr.available_size()
        rng = random.Random(seed)
        # sequences long enough to need many pages in total, so the pool must grow and stall
        max_len = max(block_size * 8, cap_blocks * block_size // 6)
        live: list[Request] = []
        waiting: list[Request] = []
        handed: set[int] = set()
        next_rid = completed = stalls = preempted = 0
        peak = 0
        if not quiet:
            print(f"\n== layout {name}: {layers} layers x {heads} heads x {head_size}, block {block_size}, bf16; "
                  f"{mgr.blocks_per_page} blocks/page, page group {mgr.page_group_bytes // MiB} MiB, "
                  f"capacity {cap_blocks} blocks under the current limit")
            print(f"{'step':>5} {'live':>5} {'wait':>5} {'blocks':>7} {'in use MiB':>11} {'mapped MiB':>11}  bar")
        for step in range(steps):
            # two bursts of arrivals, a lull between them, then a drain
            burst = step < steps * 0.6 and (step // max(1, steps // 6)) % 2 == 0
            if burst and rng.random() < 0.7:
                for _ in range(rng.randint(1, 2)):
                    waiting.append(Request(next_rid, rng.randint(block_size * 2, max_len)))
                    next_rid += 1
            while waiting and len(live) < 12 and mgr.available_size() > max_len // block_size // 2:
                live.append(waiting.pop(0))
            progress = False
            for req in list(live):
                grow = rng.randint(block_size // 2, block_size * 3)
                want_tokens = min(req.target, req.tokens + grow)
                need = -(-want_tokens // block_size) - len(req.blocks)
                if need > 0:
                    got = mgr.alloc(need)
                    if got is None:
                        stalls += 1
                        continue
                    dup = handed.intersection(got)
                    if dup:
                        errors.append(f"blocks {sorted(dup)[:4]} handed out twice")
                    handed.update(got)
                    _write(views, got, req, len(req.blocks))
                    req.blocks.extend(got)
                progress = True
                req.tokens = want_tokens
                if req.tokens >= req.target:
                    if not _check(views, req):
                        errors.append(f"request {req.rid}: KV read back differs from what was written")
                    mgr.free(req.blocks)
                    handed.difference_update(req.blocks)
                    live.remove(req)
                    completed += 1
            if not progress and live:
                # every live request is blocked on memory: preempt the newest, as an engine would
                victim = live.pop()
                if not _check(views, victim):
                    errors.append(f"request {victim.rid}: KV read back differs from what was written")
                mgr.free(victim.blocks)
                handed.difference_update(victim.blocks)
                victim.blocks, victim.tokens = [], 0
                waiting.insert(0, victim)
                preempted += 1
            mapped = mgr.mapped_bytes
            peak = max(peak, mapped)
            if not quiet and (step % max(1, steps // 24) == 0 or step == steps - 1):
                bar = "#" * round(40 * mapped / max(1, mgr.num_pages * mgr.page_group_bytes))
                print(f"{step:5d} {len(live):5d} {len(waiting):5d} {mgr.num_allocated_blocks():7d} "
                      f"{mgr.get_mapped_memory_size('mb'):11.0f} {mapped / MiB:11.0f}  {bar}")
            if step > steps * 0.6 and not live and not waiting:
                break
        for req in live:  # still running at the end: check, then free
            if not _check(views, req):
                errors.append(f"request {req.rid}: KV read back differs from what was written")
            mgr.free(req.blocks)
        mgr.trim()
        final = mgr.mapped_bytes
        if not quiet:
            print(f"after trim: mapped {final / MiB:.0f} MiB (peak {peak / MiB:.0f} MiB), {completed} requests "
                  f"completed, {stalls} allocation misses (requests waited), {preempted} preempted")
        if peak <= final:
            errors.append("mapped memory never grew above its final size")
        if final != 0:
            errors.append(f"{final} B still mapped after every block was freed and trimmed")
        if completed == 0:
            errors.append("no request completed")
        if mgr.num_allocated_blocks() != 0:
            errors.append("blocks still allocated at the end")
        mgr.close()
    except Exception as exc:  # the verdict must report it, not a traceback alone
        errors.append(f"{type(exc).__name__}: {exc}")
        completed = completed if "completed" in locals() else 0
        stalls = stalls if "stalls" in locals() else 0
        peak = peak if "peak" in locals() else 0
        step = step if "step" in locals() else 0
    finally:
        vi.shutdown_kvcached()
    return Outcome(name, not errors, step + 1, completed, stalls, peak, locals().get("final", -1), errors,
                   time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvcached demo", description=__doc__.splitlines()[0])
    p.add_argument("--device", default=None, help="cuda:N, hip:N or cpu (default: a GPU if present)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--host-mem-mb", type=int, default=768,
                   help="physical budget of the host backend (KVCACHED_HOST_MEM_LIMIT_MB wins when set)")
    p.add_argument("--max-mapped-mb", type=int, default=None,
                   help="cap on mapped KV memory (default: 4096 on a GPU, the host budget on cpu)")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        os.environ.setdefault("KVCACHED_HOST_MEM_LIMIT_MB", str(args.host_mem_mb))
    # a small prealloc reserve, so freed pages are unmapped and the table shows the pool shrink
    os.environ.setdefault("KVCACHED_MIN_RESERVED_PAGES", "0")
    os.environ.setdefault("KVCACHED_MAX_RESERVED_PAGES", "1")
    cap = args.max_mapped_mb if args.max_mapped_mb is not None else (0 if device == "cpu" else 4096)
    print(f"kvcached demo on {device} (torch {torch.__version__})")
    outcomes = [run_layout(device, contiguous, layers=args.layers, heads=args.heads, head_size=args.head_size,
                           block_size=args.block_size, seed=args.seed, steps=args.steps, quiet=args.quiet,
                           max_mapped_mb=cap)
                for contiguous in (True, False)]
    ok = all(o.ok for o in outcomes)
    for o in outcomes:
        for e in o.errors:
            print(f"  [{o.layout}] {e}")
    summary = "; ".join(f"{o.layout}: {o.completed} requests, peak {o.peak_mapped / MiB:.0f} MiB, "
                        f"{o.seconds:.1f} s" for o in outcomes)
    print(f"{'PASS' if ok else 'FAIL'}: {summary}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

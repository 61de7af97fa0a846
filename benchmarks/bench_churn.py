"""Pages held under the elastic demo's churned trace, and the pool's alloc+free fast path.

A page goes back to the driver only once every block on it is free, so which page a
request's blocks come from decides how many pages a few long-lived blocks pin. This runs
``kvcached.demo``'s trace (arrivals in bursts, growing sequences, completions, preemption;
every block written and read back) on the host backend with one layer (the block-to-page
arithmetic of the demo's model: blocks of 16 tokens x 8 heads x 128 x bf16 = 32 KiB, 64 a
page) and samples after every alloc and free: pages holding blocks, and the pages those
blocks would need if packed (ceil(blocks / 64)). Then it times alloc(1)+free pairs on a
``BlockPool`` as benchmarks/bench_vmm.py does.

A second trace, closer to a serving engine with prefix caching (prompts taken in one call,
a bounded cache of each finished request's first blocks), is where the choice of page shows.

    python benchmarks/bench_churn.py [--seeds 0 1 2 3 4] [--steps 300] [--pairs 300000]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from pathlib import Path

MiB = 1 << 20

os.environ.setdefault("KVCACHED_HOST_MEM_LIMIT_MB", "256")  # 64 page groups of one layer
os.environ.setdefault("KVCACHED_MIN_RESERVED_PAGES", "0")  # as the demo: freed pages are unmapped
os.environ.setdefault("KVCACHED_MAX_RESERVED_PAGES", "1")
os.environ.setdefault("KVCACHED_IPC_NAME", f"kvcached_bench_churn_{os.getpid()}")

sys.path.insert(0, str(Path(__file__).resolve().parent))


def churn(seed: int, steps: int) -> dict[str, float]:
    from kvcached import demo
    from kvcached.kv_cache_manager import KVCacheManager

    samples: list[tuple[int, int]] = []  # (pages holding blocks, pages the blocks need packed)
    alloc, free = KVCacheManager.alloc, KVCacheManager.free

    def sample(mgr: KVCacheManager) -> None:
        blocks = mgr.num_allocated_blocks()
        samples.append((int(mgr.page_allocator.num_in_use), math.ceil(blocks / mgr.blocks_per_page)))

    def alloc_sampled(self: KVCacheManager, n: int):
        got = alloc(self, n)
        sample(self)
        return got

    def free_sampled(self: KVCacheManager, ids) -> None:
        free(self, ids)
        sample(self)

    KVCacheManager.alloc, KVCacheManager.free = alloc_sampled, free_sampled
    try:
        out = demo.run_layout("cpu", True, layers=1, heads=8, head_size=128, block_size=16, seed=seed, steps=steps,
                              quiet=True)
    finally:
        KVCacheManager.alloc, KVCacheManager.free = alloc, free
    if not out.ok:
        raise SystemExit(f"seed {seed}: the demo trace failed: {out.errors}")
    held = [h for h, _ in samples]
    extra = [h - need for h, need in samples]
    return {"mean_held": statistics.fmean(held), "peak_held": max(held), "mean_extra": statistics.fmean(extra),
            "max_extra": max(extra), "samples": len(samples)}


def prefix_cache_trace(seed: int, steps: int) -> dict[str, float]:
    """A serving-like trace the demo lacks: each request takes its prompt's blocks in one call (8-96),
    then one block every 4 steps; at completion its first 4 blocks stay as prefix cache (at most 256
    cached blocks, least recently used evicted first) and the rest are freed."""
    import random
    from collections import deque

    from kvcached import vmm_ops
    from kvcached.kv_cache_manager import KVCacheManager

    rng = random.Random(seed)
    vmm_ops.init_kvcached("cpu", contiguous_layout=True)
    try:
        vmm_ops.create_kv_tensors(64 * 4 * MiB, 2, "cpu", 1)
        mgr = KVCacheManager(64 * 64, 16, 2048, 1)
        live: list[list[int]] = []
        cache: deque[list[int]] = deque()
        samples = []
        for step in range(steps):
            if rng.random() < 0.5 and len(live) < 24:
                got = mgr.alloc(rng.randint(8, 96))
                if got is not None:
                    live.append(got)
            for blocks in live:
                if step % 4 == 0 and rng.random() < 0.8 and (more := mgr.alloc(1)) is not None:
                    blocks.extend(more)
            for blocks in [b for b in live if rng.random() < 0.05]:
                live.remove(blocks)
                cache.append(blocks[:4])
                mgr.free(blocks[4:])
            while sum(map(len, cache)) > 256 or (cache and mgr.available_size() < 96):
                mgr.free(cache.popleft())
            used = mgr.num_allocated_blocks()
            samples.append((int(mgr.page_allocator.num_in_use), math.ceil(used / mgr.blocks_per_page)))
        mgr.close()
    finally:
        vmm_ops.shutdown_kvcached()
    held = [h for h, _ in samples]
    extra = [h - need for h, need in samples]
    return {"mean_held": statistics.fmean(held), "peak_held": max(held), "mean_extra": statistics.fmean(extra),
            "max_extra": max(extra), "samples": len(samples)}


def churn_table(seeds: list[int], steps: int, trace=None) -> None:
    trace = trace or churn
    print("| seed | mean pages held | peak pages held | mean pages held beyond packed | most beyond packed |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    rows = []
    for seed in seeds:
        r = trace(seed, steps)
        rows.append(r)
        print(f"| {seed} | {r['mean_held']:.2f} | {r['peak_held']} | {r['mean_extra']:.2f} | {r['max_extra']} |")
    print(f"| all | {statistics.fmean(r['mean_held'] for r in rows):.2f} | "
          f"{max(r['peak_held'] for r in rows)} | {statistics.fmean(r['mean_extra'] for r in rows):.2f} | "
          f"{max(r['max_extra'] for r in rows)} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2, 3, 4], help="none: the fast path only")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--pairs", type=int, default=300_000)
    ap.add_argument("--repeats", type=int, default=5, help="fast-path timings (the median is reported)")
    args = ap.parse_args()
    import kvcached

    print(f"kvcached from {Path(kvcached.__file__).parent}")
    if args.seeds:
        print("the elastic demo's trace (kvcached.demo):")
        churn_table(args.seeds, args.steps)
        print("\nprompts in one call, a bounded prefix cache (prefix_cache_trace):")
        churn_table(args.seeds, args.steps, prefix_cache_trace)

    from bench_vmm import bench_pool_fast_path

    from kvcached import _vmm

    backend = _vmm.Backend("host", 0, 1 << 30)
    rates = sorted(bench_pool_fast_path(backend, args.pairs)["pairs_per_s"] for _ in range(args.repeats))
    print(f"BlockPool alloc(1)+free: median {rates[len(rates) // 2]:,.0f} pairs/s "
          f"(of {args.repeats}: {', '.join(f'{x:,.0f}' for x in rates)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

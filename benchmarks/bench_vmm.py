"""Benchmark of the native VMM core (kvcached._vmm): driver calls, KV-tensor creation,
growing and shrinking 1 GiB of KV in each layout, block-pool fast path, available() cost.

    python benchmarks/bench_vmm.py                  # GPU if torch sees one, else the host backend
    python benchmarks/bench_vmm.py --backend host   # force a backend

Writes benchmarks/results/vmm_<backend>_<gpu-or-host>.md and prints the table.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from kvcached import _vmm, vmm_ops
from kvcached.layout import KVGeometry, KVSpec, Layout

try:
    from kvcached import _vmm_bench  # the driver-call timers: not in the shipping module
except ImportError as exc:
    sys.exit(f"bench_vmm needs kvcached._vmm_bench ({exc}); build it with "
             "KVCACHED_BUILD_BENCH=1 python setup.py build_ext --inplace")

MiB = 1 << 20
GiB = 1 << 30
PAGE = 2 * MiB


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]


def default_backend() -> str:
    if torch.cuda.is_available():
        return "hip" if getattr(torch.version, "hip", None) else "cuda"
    return "host"


def device_text(kind: str) -> tuple[str, str]:
    """(device name, driver) for the header."""
    if kind == "host":
        cpu = platform.processor() or platform.machine()
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        return f"host ({cpu}, {os.cpu_count()} cores)", f"Linux {platform.release()} (memfd + mmap)"
    name = torch.cuda.get_device_name(0)
    driver = "unknown"
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
        m = re.search(r"Kernel Module\s+([\d.]+)", text)
        driver = f"NVIDIA {m.group(1)}" if m else text.splitlines()[0]
    except OSError:
        if getattr(torch.version, "hip", None):
            driver = f"ROCm/HIP {torch.version.hip}"
    return name, driver


def kv_spec(num_blocks: int) -> KVSpec:
    return KVSpec(num_layers=32, num_blocks=num_blocks, block_size=16, num_kv_heads=8, head_size=128,
                  dtype=torch.bfloat16)


def build(backend, geom: KVGeometry, min_res=0, max_res=0, prealloc=False, zero_chunk=0, max_run_pages=0):
    t0 = time.perf_counter()
    vts = [_vmm.VirtualTensor(backend, geom.tensor_bytes, geom.unit_bytes, zero_chunk)
           for _ in range(geom.num_tensors)]
    pa = _vmm.PageAllocator(backend, vts, geom.regions(), geom.num_pages, min_res, max_res, prealloc,
                            max_run_pages=max_run_pages)
    return vts, pa, (time.perf_counter() - t0) * 1e3


def bench_layout(backend, layout: Layout, virtual_bytes: int, reps: int, zero_chunk: int = 0,
                 max_run_pages: int | None = None) -> dict[str, float]:
    if max_run_pages is None:  # what kvcached itself picks for this layout
        max_run_pages = vmm_ops.page_runs(backend, layout)
    spec0 = kv_spec(1)
    bytes_per_block = spec0.block_bytes * spec0.num_layers * 2
    num_blocks = max(virtual_bytes // bytes_per_block, 1024)
    geom = KVGeometry(kv_spec(int(num_blocks)), layout, PAGE)
    vts, pa, create_ms = build(backend, geom, zero_chunk=zero_chunk, max_run_pages=max_run_pages)
    zero_maps = sum(v.num_zero_mappings for v in vts)
    pool = _vmm.BlockPool(pa, geom.blocks_per_page, geom.num_blocks)
    grow_blocks = GiB // bytes_per_block  # 512 blocks = 1 GiB of KV
    grow, shrink, released = [], [], []
    runs = 0
    pa.reset_phase_times()
    for _ in range(reps):
        t0 = time.perf_counter()
        ids = pool.alloc(grow_blocks)
        t1 = time.perf_counter()
        assert ids is not None, "could not map 1 GiB"
        runs = len(pa.runs())
        pool.free(ids)
        t2 = time.perf_counter()
        # The shrink returns once the memory is unmapped; the backend's thread releases it
        # after that. Wait for it (only reads: nothing here releases), so `released` is when
        # the memory is back with the driver, and the next grow starts with nothing pending.
        while backend.pending_release_bytes():
            pass
        t3 = time.perf_counter()
        grow.append((t1 - t0) * 1e3)
        shrink.append((t2 - t1) * 1e3)
        released.append((t3 - t1) * 1e3)
    phases = {k: (us / reps / 1e3, calls // reps) for k, (us, calls) in pa.phase_times().items()}
    vts_chunk_mib = vts[0].zero_chunk / MiB
    max_run = pa.max_run_pages
    pa.close()
    t0 = time.perf_counter()
    del pool, pa, vts
    destroy_ms = (time.perf_counter() - t0) * 1e3
    return {
        "virtual_gib": geom.num_tensors * geom.tensor_bytes / GiB,
        "num_tensors": geom.num_tensors,
        "create_ms": create_ms,
        "destroy_ms": destroy_ms,
        "grow_ms": statistics.median(grow),
        "grow_min_ms": min(grow),
        "shrink_ms": statistics.median(shrink),
        "shrink_min_ms": min(shrink),
        "released_ms": statistics.median(released),
        "released_min_ms": min(released),
        "phases": phases,
        "zero_maps": zero_maps,
        "zero_chunk_mib": vts_chunk_mib,
        "runs": runs,
        "max_run_pages": max_run,
    }


def time_fast_path(alloc, free, available, pairs: int, calls: int = 200_000) -> dict[str, float]:
    """alloc(1)+free pairs per second, and the cost of one available() call (empty loop subtracted)."""
    for _ in range(1000):
        free(alloc(1))
    t0 = time.perf_counter()
    for _ in range(pairs):
        free(alloc(1))
    dt = time.perf_counter() - t0
    t1 = time.perf_counter()
    for _ in range(calls):
        available()
    da = time.perf_counter() - t1
    t2 = time.perf_counter()
    for _ in range(calls):
        pass
    empty = time.perf_counter() - t2
    return {"pairs_per_s": pairs / dt, "available_us": (da - empty) / calls * 1e6}


def bench_pool_fast_path(backend, pairs: int) -> dict[str, float]:
    geom = KVGeometry(kv_spec(64 * 64), Layout.CONTIGUOUS, PAGE)
    vts, pa, _ = build(backend, geom, 1, 2, True)
    pool = _vmm.BlockPool(pa, geom.blocks_per_page, geom.num_blocks)
    keep = pool.alloc(1)  # a live block keeps its page, as in a serving engine
    result = time_fast_path(pool.alloc, pool.free, pool.available, pairs)
    pool.free(keep)
    pa.close()
    return result


def bench_manager(kind: str, pairs: int, deferred_free: bool | None = None) -> dict[str, float] | str:
    """The same fast path through kvcached.kv_cache_manager.KVCacheManager.

    deferred_free=True on the host times the GPU backends' free path: a live block keeps the
    page, so no free needs a device event (on the host one is complete at once)."""
    from kvcached.kv_cache_manager import KVCacheManager

    dev = "cpu" if kind == "host" else "cuda:0"
    spec = kv_spec(64 * 64)
    try:
        vmm_ops.init_kvcached(device=dev)
        try:
            cell = spec.num_kv_heads * spec.head_size * spec.itemsize
            num_blocks = spec.num_blocks
            vmm_ops.create_kv_tensors(2 * num_blocks * spec.block_bytes, spec.itemsize, dev, spec.num_layers)
            mgr = KVCacheManager(num_blocks, spec.block_size, cell, spec.num_layers, deferred_free=deferred_free)
            mgr.alloc(1)  # a live block keeps its page (shutdown below frees it)
            result = time_fast_path(mgr.alloc, mgr.free, mgr.available_size, pairs)
            if mgr.pending_free_blocks:
                return f"n/a ({mgr.pending_free_blocks} blocks waited for the device)"
            return result
        finally:
            vmm_ops.shutdown_kvcached()
    except Exception as e:  # noqa: BLE001 - reported in the table
        return f"n/a ({type(e).__name__}: {e})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["cuda", "hip", "host"], default=default_backend())
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--driver-pages", type=int, default=64, help="2 MiB pages timed per driver call kind")
    ap.add_argument("--virtual-gib", type=float, default=None,
                    help="virtual KV size for the creation time (default: 90%% of device memory; host 16)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--zero-chunk-mib", type=int, default=64,
                    help="also time per-layer tensors with zero mappings of up to this size (0: skip)")
    ap.add_argument("--breakdown-units", type=int, default=2048,
                    help="2 MiB units of the zero-page breakdown experiments (0: skip them)")
    ap.add_argument("--pairs", type=int, default=300_000)
    ap.add_argument("--no-page-runs", dest="page_runs", action="store_false",
                    help="skip the comparison row with one page per run (the mapping before runs)")
    ap.add_argument("--host-limit-gib", type=float, default=4.0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    limit = int(args.host_limit_gib * GiB) if args.backend == "host" else 0
    backend = _vmm.Backend(args.backend, args.device, limit)
    if args.virtual_gib is None:
        virtual = 16 * GiB if args.backend == "host" else int(backend.mem_info()[1] * 0.9)
    else:
        virtual = int(args.virtual_gib * GiB)

    calls = _vmm_bench.bench_driver_calls(backend, args.driver_pages, PAGE)
    breakdown = _vmm_bench.bench_breakdown(backend, args.breakdown_units, PAGE) if args.breakdown_units else {}
    layouts = {lay.value: bench_layout(backend, lay, virtual, args.reps)
               for lay in (Layout.CONTIGUOUS, Layout.PER_LAYER)}
    if args.page_runs:  # kvcached maps the contiguous layout page by page; this row is what runs would do
        layouts["contiguous, runs of up to 1 GiB"] = bench_layout(backend, Layout.CONTIGUOUS, virtual, args.reps,
                                                                 max_run_pages=0)
    if args.zero_chunk_mib:
        layouts[f"per_layer, zero_chunk {args.zero_chunk_mib} MiB"] = bench_layout(
            backend, Layout.PER_LAYER, virtual, args.reps, args.zero_chunk_mib * MiB)
        if args.page_runs:  # runs of 1 page: as before runs (one allocation and mapping per page and region);
            # 4 pages: half the default cap, so half the memory one live page can pin
            for n in (4, 1):
                layouts[f"per_layer, zero_chunk {args.zero_chunk_mib} MiB, runs of {n} page{'s' * (n > 1)}"] = (
                    bench_layout(backend, Layout.PER_LAYER, virtual, args.reps, args.zero_chunk_mib * MiB,
                                 max_run_pages=n))
    pool = bench_pool_fast_path(backend, args.pairs)
    managers = {"KVCacheManager": bench_manager(args.backend, args.pairs // 3)}
    if args.backend == "host":  # the host backend defers nothing by default; the GPU backends do
        managers["KVCacheManager, deferred_free=True (the GPU free path on the host)"] = bench_manager(
            args.backend, args.pairs // 3, deferred_free=True)

    name, driver = device_text(args.backend)
    gpu_tag = "host" if args.backend == "host" else re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    out = args.out or Path(__file__).parent / "results" / f"vmm_{args.backend}_{gpu_tag}.md"
    triton_version = "not installed"
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001
        pass
    cmd = " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])
    lines = [
        f"# VMM benchmark: {args.backend} backend",
        "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- device: {name}",
        f"- driver: {driver}",
        f"- torch {torch.__version__}, triton {triton_version}, python {platform.python_version()}",
        f"- backend granularity {backend.granularity} B, one physical allocation per page group: "
        f"{backend.map_offset_ok}",
        f"- command: `{cmd}`",
        f"- load average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())} (other work on the machine "
        "inflates every number)",
        "",
        f"## Driver calls (2 MiB pages, {args.driver_pages} calls each, timed in C++)",
        "",
        "| call | p50 µs | p99 µs | calls |",
        "| --- | ---: | ---: | ---: |",
    ]
    order = ["reserve", "free_va", "create", "map", "set_access", "set_access_all_pages_once", "unmap",
             "unmap_all_pages_once", "release"]
    for key in order:
        if key in calls:
            v = calls[key]
            label = {"reserve": f"reserve {args.driver_pages * 2} MiB", "free_va": "free address range",
                     "set_access_all_pages_once": f"set_access over {args.driver_pages} pages (1 call)",
                     "unmap_all_pages_once": f"unmap {args.driver_pages} pages (1 call)"}.get(key, key)
            lines.append(f"| {label} | {pct(v, 0.5):.2f} | {pct(v, 0.99):.2f} | {len(v)} |")
    lines += [
        "",
        "## KV cache: 32 layers, bf16, block 16, 8 KV heads, head size 128 (1 GiB = 512 blocks)",
        "",
        "Pages mapped in one call form runs (one physical allocation per region, at most `max run` pages); "
        "`runs` is how many one grow of 1 GiB made. A shrink returns once the memory is unmapped (its "
        "addresses read zeros); the backend's thread releases the physical memory after that: `memory "
        "released` is the time from the shrink's start until it is back with the driver.",
        "",
        "| layout | tensors | virtual GiB | zero mappings | max run | runs | create KV tensors ms "
        "| grow 1 GiB ms (p50 / min) | shrink 1 GiB ms (p50 / min) | memory released ms (p50 / min) | destroy ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for lay, r in layouts.items():
        lines.append(
            f"| {lay} | {r['num_tensors']} | {r['virtual_gib']:.1f} | {r['zero_maps']} | {r['max_run_pages']} | "
            f"{r['runs']} | {r['create_ms']:.1f} | "
            f"{r['grow_ms']:.2f} / {r['grow_min_ms']:.2f} | {r['shrink_ms']:.2f} / {r['shrink_min_ms']:.2f} | "
            f"{r['released_ms']:.2f} / {r['released_min_ms']:.2f} | {r['destroy_ms']:.1f} |"
        )
    lines += [
        "",
        "Steps inside one grow (map.*) and one shrink (unmap.*) of 1 GiB, from the allocator's counters; "
        "release.background is the releases the backend's thread did after the shrink returned (in `memory "
        "released`, not in the shrink), unmap.release_deferred the time to queue them:",
        "",
        "| layout | step | ms | calls |",
        "| --- | --- | ---: | ---: |",
    ]
    for lay, r in layouts.items():
        for step, (ms, n) in sorted(r["phases"].items()):
            lines.append(f"| {lay} | {step} | {ms:.3f} | {n} |")
    if breakdown:
        lines += [
            "",
            f"## Zero-page breakdown ({args.breakdown_units} units of 2 MiB, timed in C++; µs)",
            "",
            "| experiment | p50 | p99 | sum | n |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for key, v in breakdown.items():
            if not v:
                continue
            lines.append(f"| {key} | {pct(v, 0.5):.2f} | {pct(v, 0.99):.2f} | {sum(v):.1f} | {len(v)} |")
    lines += [
        "",
        "## Block allocation fast path (from Python, one live block keeps its page)",
        "",
        "| path | alloc(1)+free pairs/s | available() µs |",
        "| --- | ---: | ---: |",
        f"| _vmm.BlockPool | {pool['pairs_per_s']:,.0f} | {pool['available_us']:.3f} |",
    ]
    for label, mgr in managers.items():
        if isinstance(mgr, dict):
            lines.append(f"| {label} | {mgr['pairs_per_s']:,.0f} | {mgr['available_us']:.3f} (available_size) |")
        else:
            lines.append(f"| {label} | {mgr} | |")
    lines += [
        "",
        "Goals on the H200: grow/shrink 1 GiB within 0.6 ms contiguous and 10 ms per-layer; per-layer KV-tensor "
        "creation within 200 ms; >= 250,000 pairs/s; available() < 1 µs.",
        "",
    ]
    text = "\n".join(lines)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    print(f"written to {out}")


if __name__ == "__main__":
    main()

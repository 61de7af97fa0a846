"""Where a vLLM serving step's time goes, with and without kvcached (``bench_serving.py --profile``).

One generate of the benchmark's prompt set, run in the engine's own process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), with:

- host timers around vLLM's engine step, scheduler, model runner and kvcached's block
  pool hooks (seconds in each and calls; the step is what the GPU waits on when the
  host falls behind);
- kvcached's native allocator counters (``PageAllocator.phase_times``): every driver
  call of mapping and unmapping pages during the run, time and count, whichever thread
  made it (the step's or the prealloc thread);
- torch's profiler (CUPTI) over the same run: GPU busy time (union of kernel and copy
  intervals), idle time and its gaps, the kernels that take the most time.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

HOOKS_KVCACHED = ("get_new_blocks", "free_blocks", "get_num_free_blocks", "end_allocation", "shrink_to_limit",
                  "_evict")


class Timers:
    def __init__(self) -> None:
        self.total: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        self.steps: list[float] = []
        self._undo: list[tuple[Any, str, Any, bool]] = []

    def wrap(self, owner: Any, name: str, label: str, steps: bool = False) -> None:
        orig = getattr(owner, name, None)
        if orig is None:
            return
        on_instance = name in getattr(owner, "__dict__", {}) and not isinstance(owner, type)

        @functools.wraps(orig)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                e = self.total[label]
                e[0] += dt
                e[1] += 1
                if steps:
                    self.steps.append(dt)

        setattr(owner, name, timed)
        self._undo.append((owner, name, orig, on_instance))

    def undo(self) -> None:
        for owner, name, orig, on_instance in reversed(self._undo):
            if on_instance or isinstance(owner, type):
                setattr(owner, name, orig)
            else:
                delattr(owner, name)
        self._undo.clear()


def _allocator() -> Any:
    try:
        from kvcached import vmm_ops

        if not vmm_ops.is_initialized():
            return None
        return vmm_ops.get_group(0).allocator
    except Exception:
        return None


def _gpu_summary(prof: Any) -> dict:
    intervals, kernels = [], defaultdict(lambda: [0.0, 0])
    for evt in prof.events():
        if str(getattr(evt, "device_type", "")).endswith("CUDA"):
            tr = evt.time_range
            if tr.end > tr.start:
                intervals.append((tr.start, tr.end))
                k = kernels[evt.name[:70]]
                k[0] += tr.end - tr.start
                k[1] += 1
    if not intervals:
        return {"error": "no device events recorded"}
    intervals.sort()
    busy, gaps = 0.0, []
    cur_s, cur_e = intervals[0]
    for s, e in intervals[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append(s - cur_e)
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    wall = intervals[-1][1] - intervals[0][0]
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:8]
    return {"wall_ms": wall / 1e3, "busy_ms": busy / 1e3, "idle_ms": (wall - busy) / 1e3,
            "gaps_over_100us": sum(1 for g in gaps if g > 100), "idle_in_gaps_over_100us_ms":
            sum(g for g in gaps if g > 100) / 1e3, "largest_gap_ms": max(gaps, default=0) / 1e3,
            "top_kernels": [(n, round(t / 1e3, 2), c) for n, (t, c) in top]}


def profile_generate(llm: Any, runner: Any, generate: Callable[[], Any]) -> dict:
    """Run ``generate`` once under the timers, the allocator's counters and torch's profiler."""
    import torch

    timers = Timers()
    try:  # the in-process engine core: its loop calls step_fn, bound at its start (step or step_with_batch_queue)
        core = llm.llm_engine.engine_core.engine_core
        timers.wrap(core, "step_fn", "vllm EngineCore step", steps=True)
    except AttributeError:
        pass
    try:
        from vllm.v1.core.sched.scheduler import Scheduler

        timers.wrap(Scheduler, "schedule", "vllm Scheduler.schedule")
        timers.wrap(Scheduler, "update_from_output", "vllm Scheduler.update_from_output")
    except ImportError:
        pass
    if runner is not None:
        for name in ("execute_model", "sample_tokens"):
            timers.wrap(runner, name, f"vllm model runner {name}")
    try:
        from kvcached.integration.vllm.block_pool import KVCachedBlockPool

        for name in HOOKS_KVCACHED:
            timers.wrap(KVCachedBlockPool, name, f"kvcached BlockPool.{name}")
    except ImportError:
        pass
    alloc = _allocator()
    if alloc is not None:
        alloc.reset_phase_times()
        before = (int(alloc.num_in_use), int(alloc.num_reserved))
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    t0 = time.perf_counter()
    try:
        with torch.profiler.profile(activities=acts) as prof:
            generate()
    finally:
        timers.undo()
    wall = time.perf_counter() - t0
    out: dict[str, Any] = {"wall_s": wall, "host": {k: (round(v[0], 4), int(v[1])) for k, v in timers.total.items()}}
    if timers.steps:
        st = sorted(timers.steps)
        out["steps"] = {"n": len(st), "p50_ms": 1e3 * statistics.median(st), "p90_ms": 1e3 * st[int(0.9 * len(st))],
                        "max_ms": 1e3 * st[-1], "sum_s": sum(st)}
    if alloc is not None:
        out["vmm"] = {k: (round(v[0] / 1e3, 3), int(v[1])) for k, v in alloc.phase_times().items()}  # ms, calls
        out["pages_before"] = before
        out["pages_after"] = (int(alloc.num_in_use), int(alloc.num_reserved))
        out["page_bytes"] = int(alloc.page_bytes) if hasattr(alloc, "page_bytes") else None
    out["gpu"] = _gpu_summary(prof)
    return out


def profile_markdown(profiles: dict[str, dict]) -> str:
    """One table per view, a column per configuration."""
    names = list(profiles)
    lines = ["One generate of the benchmark's prompt set per configuration, profiled (see "
             "`benchmarks/serving_profile.py`; the profiler slows the run, so compare columns, not with the "
             "throughput table).", ""]

    def table(title: str, rows: list[tuple[str, list[str]]]) -> None:
        lines.extend([f"### {title}", "", "| | " + " | ".join(names) + " |", "| --- |" + " ---: |" * len(names)])
        lines.extend(f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows)
        lines.append("")

    table("Run", [("wall (s)", [f"{p['wall_s']:.2f}" for p in profiles.values()]),
                  ("engine steps", [str(p.get("steps", {}).get("n", "-")) for p in profiles.values()]),
                  ("step p50 / p90 / max (ms)", [
                      f"{p['steps']['p50_ms']:.1f} / {p['steps']['p90_ms']:.1f} / {p['steps']['max_ms']:.1f}"
                      if "steps" in p else "-" for p in profiles.values()])])
    gpu_keys = ("wall_ms", "busy_ms", "idle_ms", "gaps_over_100us", "idle_in_gaps_over_100us_ms", "largest_gap_ms")
    table("GPU (CUPTI)", [(k, [f"{p['gpu'].get(k, float('nan')):.1f}" if isinstance(p["gpu"].get(k), float)
                               else str(p["gpu"].get(k, "-")) for p in profiles.values()]) for k in gpu_keys])
    host_keys = sorted({k for p in profiles.values() for k in p["host"]})
    table("Host time in hooks (s, calls)", [(k, [f"{p['host'][k][0]:.3f} ({p['host'][k][1]})" if k in p["host"]
                                                 else "-" for p in profiles.values()]) for k in host_keys])
    vmm_keys = sorted({k for p in profiles.values() for k in p.get("vmm", {})})
    if vmm_keys:
        table("kvcached driver calls during the run (ms, calls)",
              [(k, [f"{p['vmm'][k][0]:.2f} ({p['vmm'][k][1]})" if k in p.get("vmm", {}) else "-"
                    for p in profiles.values()]) for k in vmm_keys])
    lines.append("### Top kernels (ms, launches)")
    lines.append("")
    for n, p in profiles.items():
        tops = "; ".join(f"{k} {t} ({c})" for k, t, c in p["gpu"].get("top_kernels", [])[:5])
        lines.append(f"- {n}: {tops}")
    return "\n".join(lines) + "\n"

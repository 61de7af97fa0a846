"""Shared plumbing for the benchmark scripts: timing, environment, markdown tables."""

from __future__ import annotations

import datetime
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


def time_us(fn: Callable[[], object], device: torch.device, *, reps: int = 3) -> float:
    """Median time of one call in microseconds (triton's do_bench on a GPU: L2 flushed, median)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode="median")) * 1e3
    fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def graph_time_us(fn: Callable[[], object], device: torch.device) -> float | None:
    """Median GPU time of one call replayed from a CUDA/HIP graph (no host launch cost), or None off-GPU.

    A serving engine replays decode steps from graphs, so this is the time it sees; the
    eager time adds the host's launch overhead, which dominates small shapes.
    """
    if device.type != "cuda":
        return None
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    try:
        return time_us(graph.replay, device)
    finally:
        del graph


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cmd(args: list[str]) -> str:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def environment(device: torch.device) -> dict[str, str]:
    import triton

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": sys.version.split()[0],
        "command": " ".join(shlex.quote(a) for a in [sys.executable.rsplit("/", 1)[-1], *sys.argv]),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["gpu"] = f"{props.name} ({props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} CUs/SMs)"
        if torch.version.hip:
            env["driver"] = f"ROCm/HIP {torch.version.hip}; " + (
                _cmd(["rocm-smi", "--showdriverversion"]).splitlines() or [""])[-1]
        else:
            drv = _cmd(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]).splitlines()
            env["driver"] = f"NVIDIA {drv[0] if drv else '?'}; CUDA {torch.version.cuda}"
    else:
        env["gpu"] = "none (CPU, Triton interpreter: plumbing check only, times are meaningless)"
        env["driver"] = "-"
    return env


def gpu_slug(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    for word in ("nvidia", "amd", "instinct", "geforce", "radeon"):
        name = name.replace(word, "")
    slug = re.sub(r"[^a-z0-9]+", "_", name).strip("_")
    return slug or "gpu"


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *values: object) -> None:
        self.rows.append([_fmt(v) for v in values])

    def markdown(self) -> str:
        lines = [f"### {self.title}", "", "| " + " | ".join(self.columns) + " |",
                 "|" + "|".join(" --- " for _ in self.columns) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in self.rows]
        if self.notes:
            lines += [""] + [f"- {n}" for n in self.notes]
        return "\n".join(lines) + "\n"


def _fmt(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != v:
            return "-"
        if abs(v) >= 100:
            return f"{v:.0f}"
        if abs(v) >= 1:
            return f"{v:.2f}"
        return f"{v:.3g}"
    return str(v).replace("|", "/")

"""Shared plumbing for the benchmark scripts: timing, environment, markdown tables."""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import inspect
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch

# The shapes of the attention benchmarks: bf16, 32 query / 8 KV heads, head 128, block 16.
KV_HEADS, Q_HEADS, HEAD, BLOCK = 8, 32, 128, 16
DT = torch.bfloat16
GB = 1e9
FAILED_CHECKS: list[str] = []  # every check close() found wrong, for the result file's correctness line


def bench_args(ap: argparse.ArgumentParser) -> argparse.Namespace:
    """Adds --quick, --out and --device to a script's own options and parses them; on the CPU (--device cpu,
    or no GPU) switches Triton to its interpreter, which must come before any kernel module is imported."""
    ap.add_argument("--quick", action="store_true", help="fewer shapes (smoke run)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), help="output directory")
    ap.add_argument("--device", default=None, help="cuda (default when a GPU is there) or cpu (interpreter)")
    args = ap.parse_args()
    if args.device == "cpu" or (args.device is None and not torch.cuda.is_available()):
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return args


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
    graph = capture_graph(fn, device)
    try:
        return time_us(graph.replay, device)
    finally:
        del graph


def capture_graph(fn: Callable[[], object], device: torch.device) -> torch.cuda.CUDAGraph:
    """One call of fn captured in a CUDA/HIP graph, after three warm-up calls on a side stream (compiles, caches)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


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


def write_report(out_dir: str | Path, stem: str, title: str, env: dict[str, str], lines: list[str],
                 tables: list[Table], *, quiet: bool = False) -> None:
    """Writes <out_dir>/<stem>.md (the title, the environment, lines, then the tables) and, unless quiet, prints it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    head = [f"# {title}", ""] + [f"- {k}: {v}" for k, v in env.items()] + lines
    text = "\n".join(head) + "\n" + "\n".join(t.markdown() for t in tables)
    (out / f"{stem}.md").write_text(text)
    if quiet:
        return
    print(text)
    print(f"wrote {out / f'{stem}.md'}")


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


# -- attention pieces shared by bench_kernels.py and bench_peers.py ------------------------------
def kernel_modules(root: str) -> tuple[ModuleType, ModuleType, ModuleType, ModuleType]:
    """kvcached from the checkout at ``root`` (a sweep's A/B imports another) and its paged_attention,
    attention_config and reference modules, by module path (the package re-exports a function named
    paged_attention). Call it before anything imports kvcached."""
    sys.path.insert(0, os.path.abspath(root))
    import kvcached

    names = ("paged_attention", "attention_config", "reference")
    return (kvcached, *(importlib.import_module(f"kvcached.kernels.{m}") for m in names))


def kv_cache(layout, num_blocks: int, layers: int, device: torch.device, dtype: torch.dtype = DT):
    """Layer 0 (per-layer) or the last layer (contiguous) of a real layout, filled with random bf16 (an fp8
    cache is left for the caller to fill: fp8 tensors have no random fill)."""
    from kvcached.layout import KVGeometry, KVSpec, allocate_plain, k_v_views

    spec = KVSpec(layers, num_blocks, BLOCK, KV_HEADS, HEAD, dtype)
    geom = KVGeometry(spec, layout, 2 << 20)
    bases = allocate_plain(geom, device)
    kc, vc = k_v_views(bases, geom, layers - 1)
    if dtype == DT:
        kc.normal_()
        vc.normal_()
    return bases, kc, vc


def fp8_quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` in fp8 with one per-tensor scale (amax over the format's largest value), as vLLM's fp8 KV cache and
    FA3's fp8 query: (values, float32 scale of shape [1]); ``values * scale`` is what the kernels read."""
    scale = (x.abs().amax().float() / torch.finfo(dtype).max).clamp(min=1e-12).reshape(1)
    return (x.float() / scale).to(dtype), scale


def mla_cache(layout, num_blocks: int, layers: int, device: torch.device):
    """Layer 0 (per-layer) or the last layer (contiguous) of an MLA latent cache (576 channels), random bf16."""
    from kvcached.layout import KVGeometry, KVSpec, allocate_plain, mla_view

    geom = KVGeometry(KVSpec(layers, num_blocks, BLOCK, 1, 576, DT, kv_factor=1), layout, 18 << 20)
    bases = allocate_plain(geom, device)
    cache = mla_view(bases, geom, layers - 1)
    cache.normal_()
    return bases, cache


def prefill_flops(q_lens: list[int], seq_lens: list[int], window: int = 0, short_max: int = 16) -> float:
    """Causal attention FLOPs of a batch's prefill rows (queries longer than ``short_max``; the decode rows move
    bytes, not FLOPs): query token j of n sees s - n + j + 1 keys, at most ``window`` of them."""
    if window:
        return sum(4 * Q_HEADS * HEAD * sum(min(p + 1, window) for p in range(s - n, s))
                   for n, s in zip(q_lens, seq_lens, strict=True) if n > short_max)
    return sum(4 * Q_HEADS * HEAD * n * (s - n + (n + 1) / 2)
               for n, s in zip(q_lens, seq_lens, strict=True) if n > short_max)


def case_lens(b: int, c: str) -> list[int]:
    """The sweeps' context lengths for ``B`` sequences of ``C`` keys: ``C`` = ``u`` draws them uniformly from
    256..16384 (fixed seed), the uneven batch of the kernel table."""
    gen = torch.Generator().manual_seed(1)
    return torch.randint(256, 16385, (b,), generator=gen).tolist() if c == "u" else [int(c)] * b


def sweep_batch(lens: list[int], n: int, bound: int, device: torch.device) -> tuple:
    """The sweeps' batch (``sweep_decode.py``, ``ab_power_cap.py``): ``n`` query tokens for each sequence of
    ``lens`` keys, separate K and V caches of random bf16 (seed 0) holding only the real keys, block tables from
    randperm padded with never-read columns up to ``bound`` keys (a graph's ``max_seq_len``): (query, K, V, table,
    lengths, query_start_loc)."""
    b, nb = len(lens), max(lens) // BLOCK + 1
    torch.manual_seed(0)
    kc = torch.randn(b * nb, BLOCK, KV_HEADS, HEAD, dtype=DT, device=device)
    vc = torch.randn(b * nb, BLOCK, KV_HEADS, HEAD, dtype=DT, device=device)
    table = torch.randperm(b * nb, device=device).to(torch.int32).view(b, nb)
    table = torch.nn.functional.pad(table, (0, bound // BLOCK + 1 - nb))
    qsl = torch.arange(b + 1, dtype=torch.int32, device=device) * n
    q = torch.randn(b * n, Q_HEADS, HEAD, dtype=DT, device=device)
    return q, kc, vc, table, torch.tensor(lens, dtype=torch.int32, device=device), qsl


def paged_batch(q_lens: list[int], seq_lens: list[int], seed: int, device: torch.device) -> tuple:
    """A batch over a per-layer cache filled with random bf16: (query, block table from randperm, lengths,
    query_start_loc, bases, K view, V view); the same values for the same seed in every process."""
    from kvcached.layout import Layout

    torch.manual_seed(seed)
    q = torch.randn(sum(q_lens), Q_HEADS, HEAD, dtype=DT, device=device)
    nb = -(-max(seq_lens) // BLOCK)
    table = torch.randperm(len(seq_lens) * nb, device=device).to(torch.int32).view(-1, nb)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    bases, kc, vc = kv_cache(Layout.PER_LAYER, table.numel(), 1, device)
    return q, table, lens, qsl, bases, kc, vc


def gathered_kv(kc: torch.Tensor, vc: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V of every row of ``table`` gathered from a paged cache into dense ``[B, KV heads, keys, head]``
    tensors, as dense SDPA takes them (keys: the table's blocks x the block size)."""
    b = table.shape[0]
    k = kc[table.long()].reshape(b, -1, *kc.shape[-2:]).transpose(1, 2).contiguous()
    v = vc[table.long()].reshape(b, -1, *vc.shape[-2:]).transpose(1, 2).contiguous()
    return k, v


def layers_for(layout, per_layer_bytes: float, mem_gb: float) -> int:
    from kvcached.layout import Layout

    if layout is Layout.PER_LAYER:
        return 1  # a layer's views are the same whatever the number of layers
    return max(2, min(8, int(mem_gb * GB // max(per_layer_bytes, 1))))


def close(got: torch.Tensor, want: torch.Tensor, what: str, atol: float = 2e-2, bad: str = "WRONG") -> str:
    """'ok <max error>' when got (any dtype) matches the float64 want, else '<bad> <max error>' (and noted)."""
    err = (got.double() - want).abs().max().item()
    ok = err <= atol + 2e-2 * want.abs().max().item()
    if not ok:
        FAILED_CHECKS.append(f"{what}: max error {err:.3g}")
    return f"{'ok' if ok else bad} {err:.1e}"


def err_text(exc: BaseException) -> str:
    if os.environ.get("KVCACHED_BENCH_TRACE"):
        traceback.print_exception(exc)
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def vllm_peers() -> dict:
    """vLLM's Triton unified attention and FA3 (from vLLM's CUDA build), when importable: imported only here,
    after every dense SDPA row (vLLM's import changes SDPA's timings, see FACTS.md). A peer that is not
    there is the exception that says why."""
    found: dict = {}
    try:
        from vllm.v1.attention.ops.triton_unified_attention import unified_attention

        found["vLLM Triton unified (peer)"] = unified_attention
    except Exception as exc:  # absent peers are rows that say so
        found["vLLM Triton unified (peer)"] = exc
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        found["FA3 paged (peer)"] = flash_attn_varlen_func
    except Exception as exc:
        found["FA3 paged (peer)"] = exc
    return found


def peer_call(name: str, peer, q, kc, vc, table, lens, qsl, max_q: int, max_k: int,
              scales: dict | None = None) -> Callable[[], torch.Tensor]:
    """A call of a vllm_peers() peer with our arguments (causal, scale 1/sqrt(D)); returns the output.

    ``scales`` (an fp8 cache): {"k", "v"} per-tensor scales and, for FA3, whose fp8 path takes an fp8 query too
    (vLLM quantizes the query for it), {"q8", "q"}: the fp8 query and its scale. Descales are per sequence and KV
    head, as vLLM's backends pass them."""
    def descale(key: str) -> torch.Tensor | None:
        return scales[key].expand(len(lens), kc.shape[2]) if scales else None

    if name.startswith("vLLM"):
        out = torch.empty_like(q)
        extra = {}
        if scales and "kv_quant_mode" in inspect.signature(peer).parameters:
            # releases with kv_quant_mode apply the per-tensor descales only in its FP8_PER_TENSOR mode (1); in
            # its default they cast the fp8 values unscaled
            from vllm.v1.kv_cache_interface import KVQuantMode

            extra["kv_quant_mode"] = KVQuantMode.FP8_PER_TENSOR
        return lambda: peer(
            q=q, k=kc, v=vc, out=out, cu_seqlens_q=qsl, max_seqlen_q=max_q, seqused_k=lens, max_seqlen_k=max_k,
            softmax_scale=HEAD**-0.5, causal=True, window_size=(-1, -1), block_table=table, softcap=0,
            q_descale=None, k_descale=descale("k"), v_descale=descale("v"), **extra) or out
    if scales:
        q8 = scales["q8"]
        return lambda: peer(q8, kc, vc, max_seqlen_q=max_q, cu_seqlens_q=qsl, max_seqlen_k=max_k, seqused_k=lens,
                            softmax_scale=HEAD**-0.5, causal=True, block_table=table, fa_version=3,
                            q_descale=descale("q"), k_descale=descale("k"), v_descale=descale("v"))
    return lambda: peer(q, kc, vc, max_seqlen_q=max_q, cu_seqlens_q=qsl, max_seqlen_k=max_k, seqused_k=lens,
                        softmax_scale=HEAD**-0.5, causal=True, block_table=table, fa_version=3)

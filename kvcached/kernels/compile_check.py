"""Compile the kernel variants the dispatchers can choose, ahead of time, for GPUs we may not have.

    python -m kvcached.kernels.compile_check --targets gfx942,gfx90a,gfx950,sm80,sm90          # default subsets
    python -m kvcached.kernels.compile_check --targets gfx942,gfx90a,gfx950,sm80,sm90 --full   # all

(The test job, scripts/dev.sh test, runs it twice: with the venv's Triton, ``--pairwise-on ""``; with Triton 3.6
from .venv-triton36 on its path, ``--targets gfx942``.)

Each kernel module exposes ``compile_variants(target) -> list[CompileVariant]``; this
collects them (write_kv, mla_decode, paged_attention and every attention_*.py), compiles
them for each target with ``triton.compile`` (no GPU needed: the Triton wheel carries
LLVM's AMDGPU backend and ptxas), prints one line per variant x target and exits 1 on
any failure. It must run in its own process without ``TRITON_INTERPRET``.

Which variants: on the ``--pairwise-on`` targets (default gfx942, the AMD GPU we have no
hardware for) a pairwise cover (see :func:`pairwise`: every two settings that some variant of a
kernel combines, such as the 64-row tile with head size 256 or bf16 queries with fp8 KV, appear
together in a compiled one); on the other targets a representative subset (see
:func:`representative`: every kernel, every pointer dtype, constexpr value and compile option of
each kernel at least once, about a fifth of the list); on the ``--full-on`` targets and with
``--full`` every variant, with ``--only`` the named ones. Every listed compile really runs: Triton's
compile cache goes to a fresh temporary folder unless ``--cache-dir`` names one (Triton
keys that cache by the kernel's source and its callees, the signature, constexprs,
options, target and Triton build, so a hit is an earlier compile of the same inputs).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import functools
import importlib
import itertools
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODULES = ("kvcached.kernels.write_kv", "kvcached.kernels.mla_decode", "kvcached.kernels.paged_attention")
# tests-only kernels, never chosen by a dispatcher
NOT_DISPATCHED = ("kvcached.kernels.dense_reference",)
_TARGET_RE = re.compile(r"^(sm(\d+)|gfx[0-9a-f]+)$")


@dataclass
class Result:
    name: str
    target: str
    ok: bool
    ms: float
    info: str
    error: str = ""


def gpu_target(name: str):
    from triton.backends.compiler import GPUTarget

    m = _TARGET_RE.match(name)
    if not m:
        raise ValueError(f"unknown target {name!r}; use sm80, sm90, sm100, gfx90a, gfx942, gfx950, gfx1100...")
    if m.group(2):
        return GPUTarget("cuda", int(m.group(2)), 32)
    # RDNA (gfx10xx/11xx/12xx) runs wave32; CDNA wave64
    return GPUTarget("hip", name, 32 if name.startswith(("gfx10", "gfx11", "gfx12")) else 64)


def default_modules() -> list[str]:
    here = Path(__file__).parent
    extra = sorted(f"kvcached.kernels.{p.stem}" for p in here.glob("attention_*.py"))
    return list(DEFAULT_MODULES) + extra


@functools.cache
def _variants(module: str, target: str) -> list:
    return list(importlib.import_module(module).compile_variants(target))


def _resources_cuda(cubin: bytes) -> str:
    tool = shutil.which("cuobjdump")
    if tool is None:
        try:
            import triton

            cand = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
            tool = str(cand) if cand.exists() else None
        except Exception:
            tool = None
    if tool is None:
        return "regs=?"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                                 timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return "regs=?"
    m = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)", out)
    if not m:
        return "regs=?"
    return f"regs={m.group(1)} stack={m.group(2)} local={m.group(4)}"


def _resources_hip(asm: str) -> str:
    def grab(*keys: str) -> str:
        for key in keys:
            m = re.search(rf"{re.escape(key)}\s*:?\s*(\d+)", asm)
            if m:
                return m.group(1)
        return "?"

    return (f"vgprs={grab('; NumVgprs:', '.vgpr_count:')} sgprs={grab('; NumSgprs:', '.sgpr_count:')} "
            f"spills={grab('.vgpr_spill_count:')} scratch={grab('; ScratchSize:')}")


def compile_variant(v, target: str):
    """``triton.compile`` of one variant for a target name, as the kernel runs (the compiled kernel: ``.asm``)."""
    import triton
    from triton.compiler import ASTSource

    fn = v.fn
    arg_names = list(fn.arg_names)
    # Mirror Triton's run-time specialisation of the common case: torch allocations are 16-byte
    # aligned and KV strides are multiples of 16 elements, and without these marks no load is
    # vectorised or pipelined (the compile would not be the one that runs). A kernel may name
    # other ints that are always multiples of 16 in ``divisible_by_16`` (e.g. head sizes).
    always16 = set(getattr(fn, "divisible_by_16", ()))
    attrs = {
        (arg_names.index(k),): [["tt.divisibility", 16]]
        for k, t in v.signature.items()
        if t.startswith("*") or ((k.startswith("stride_") or k in always16) and t in ("i32", "i64"))
    }
    src = ASTSource(fn=fn, signature=dict(v.signature), constexprs=dict(v.constexprs), attrs=attrs)
    opts = dict(v.options)
    if not target.startswith("gfx"):
        opts.pop("waves_per_eu", None)
    return triton.compile(src, target=gpu_target(target), options=opts)


def compile_one(module: str, index: int, target: str) -> Result:
    v = _variants(module, target)[index]
    name = f"{module.rsplit('.', 1)[-1]}:{v.name}"
    t0 = time.perf_counter()
    try:
        compiled = compile_variant(v, target)
        asm = compiled.asm
        info = _resources_hip(asm.get("amdgcn", "")) if target.startswith("gfx") else _resources_cuda(asm["cubin"])
        shared = getattr(compiled.metadata, "shared", None)
        if shared is not None:
            info += f" smem={shared}"
        return Result(name, target, True, (time.perf_counter() - t0) * 1e3, info)
    except Exception as exc:  # every failure is reported, none aborts the run
        msg = " ".join(str(exc).split())
        return Result(name, target, False, (time.perf_counter() - t0) * 1e3, "", f"{type(exc).__name__}: {msg}")


def _jit_functions(module) -> list:
    from triton.runtime.jit import JITFunction

    out = []
    for value in vars(module).values():
        fn = value
        while fn is not None and not isinstance(fn, JITFunction):
            fn = getattr(fn, "fn", None)  # autotuner / heuristics wrappers
        if isinstance(fn, JITFunction) and fn.fn.__module__ == module.__name__:
            out.append(fn)
    return out


def coverage_problems(modules: list, variant_fns: set[int]) -> list[str]:
    """Kernels defined in the modules that no compile_variants lists (helpers called by kernels are fine)."""
    fns = [f for m in modules for f in _jit_functions(m)]
    problems = []
    for f in fns:
        if id(f) in variant_fns:
            continue
        if any(re.search(rf"\b{re.escape(f.__name__)}\s*\(", g.src) for g in fns if g is not f):
            continue
        problems.append(f"{f.fn.__module__}.{f.__name__} is a Triton kernel that no compile_variants() lists")
    return problems


def _features(v) -> set[tuple]:
    fn = v.fn.__name__
    out: set[tuple] = {(fn,)}
    out.update((fn, "arg", k, t) for k, t in v.signature.items() if t != "constexpr")
    out.update((fn, "constexpr", k, repr(x)) for k, x in v.constexprs.items())
    out.update((fn, "option", k, repr(x)) for k, x in v.options.items())
    return out


def representative(variants: list) -> list[int]:
    """Indices (in list order) of a subset of ``variants`` in which every kernel, every argument type
    (each pointer's dtype), every constexpr value and every compile option value of each kernel
    appears at least once: greedy set cover, the earliest variant winning ties (deterministic).

    It catches what depends on one axis (a dtype the target lacks, a head size or block shape the
    backend refuses); combinations of axes are left to ``--full``.
    """
    return _greedy_cover([_features(v) for v in variants])


def _greedy_cover(covers: list[set]) -> list[int]:
    """Indices (sorted) of sets whose union is the union of all: greedy, the earliest winning ties."""
    need = set().union(*covers) if covers else set()
    chosen: list[int] = []
    while need:
        best = max(range(len(covers)), key=lambda i: (len(covers[i] & need), -i))
        chosen.append(best)
        need -= covers[best]
    return sorted(chosen)


def pairwise(variants: list) -> list[int]:
    """Indices (in list order) of a subset of ``variants`` in which every two features (a kernel, an argument's
    type, a constexpr value, a compile option value; see :func:`representative`) that some variant has together
    appear together in a chosen one: two-way combinatorial coverage, greedy, the earliest variant winning ties.

    Every single feature is covered too. It catches what depends on two axes at once (a tile that fits in
    shared memory at one head size but not at the next, a dtype conversion one kernel lowers and another does
    not); what needs three is left to ``--full``. On gfx942 it compiles 65 of the 458 variants (65 of 258 before
    every decode and prefill variant came twice, for V's strides, and the cover grew by none).
    """
    return pairwise_cover([_features(v) for v in variants])


def pairwise_cover(features: list[set]) -> list[int]:
    """Indices (sorted) of items, each given by its set of features, such that every two features that some item
    has together are both in a chosen item (and every single feature is): greedy, the earliest item winning ties.
    :func:`pairwise` for compile variants; ``tests/conftest.py`` for the test matrices marked ``pairwise``."""
    feats = [sorted(fs, key=repr) for fs in features]
    return _greedy_cover([{(f,) for f in fs} | set(itertools.combinations(fs, 2)) for fs in feats])


def _scope(target: str, full: bool, full_on: set[str], pairwise_on: set[str]) -> str:
    """``"every variant"``, ``"pairwise cover"`` or ``"representative subset"``: what a target gets."""
    if full or target in full_on:
        return "every variant"
    return "pairwise cover" if target in pairwise_on else "representative subset"


def scope_indices(variants: list, target: str, *, full: bool = False, full_on: set[str] = frozenset(),
                  pairwise_on: set[str] = frozenset({"gfx942"})) -> list[int]:
    """Which of a target's variants the check compiles: all (``full`` or a ``full_on`` target), a pairwise
    cover (a ``pairwise_on`` target), else a representative subset."""
    scope = _scope(target, full, full_on, pairwise_on)
    if scope == "every variant":
        return list(range(len(variants)))
    return pairwise(variants) if scope == "pairwise cover" else representative(variants)


def _matches(patterns: list[str], text: str) -> bool:
    return not patterns or any(p in text for p in patterns)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcached.kernels.compile_check", description=__doc__.split("\n")[0])
    ap.add_argument("--targets", default="gfx942,gfx90a,gfx950,sm80,sm90",
                    help="comma-separated: sm80, sm90, sm100, gfx90a, gfx942, gfx950, gfx1100...")
    ap.add_argument("--only", default="",
                    help="comma-separated substrings of 'module:variant' names to compile (e.g. write_kv, "
                         "mla_decode:mla_reduce, attn_decode[bf16); a module's own problems count only when a "
                         "pattern names it")
    ap.add_argument("--modules", default="", help="comma-separated extra modules exposing compile_variants(target)")
    ap.add_argument("--pairwise-on", default="gfx942",
                    help="comma-separated targets that get a pairwise cover (every two settings some variant "
                         "combines, compiled together; default: gfx942); the others get a representative subset")
    ap.add_argument("--full-on", default="",
                    help="comma-separated targets that get every variant (default: none)")
    ap.add_argument("--full", action="store_true", help="every variant on every target (the whole matrix)")
    ap.add_argument("--cache-dir", default="",
                    help="Triton compile cache to use and keep (a hit is an earlier compile of the same source, "
                         "signature, options, target and Triton); default: a fresh temporary one, so everything "
                         "listed is compiled now")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="compile processes (default: the number of CPUs)")
    args = ap.parse_args(argv)

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile_check: TRITON_INTERPRET is set; ahead-of-time compilation does not work inside the "
              "interpreter. Run it in its own process with TRITON_INTERPRET unset (env -u TRITON_INTERPRET ...).",
              file=sys.stderr)
        return 2
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    full_on = {t.strip() for t in args.full_on.split(",") if t.strip()}
    pairwise_on = {t.strip() for t in args.pairwise_on.split(",") if t.strip()}
    for t in [*targets, *full_on, *pairwise_on]:
        gpu_target(t)  # validates the name early
    patterns = [p.strip() for p in args.only.split(",") if p.strip()]
    extra = [m.strip() for m in args.modules.split(",") if m.strip()]
    module_names = [m for m in default_modules() if m not in NOT_DISPATCHED] + extra

    failures: list[str] = []
    loaded = []
    jobs: dict[str, list[tuple[str, int, str]]] = {t: [] for t in targets}  # per target: see the pools below
    per_target_listed = dict.fromkeys(targets, 0)  # variants each target has, compiled or not
    for mod_name in module_names:
        short = mod_name.rsplit(".", 1)[-1]
        # a pattern that names the module (e.g. "write_kv" or "write_kv[bf16") makes its problems count
        named = not patterns or any(short in p for p in patterns)
        try:
            module = importlib.import_module(mod_name)
        except Exception as exc:
            if named:
                failures.append(f"{mod_name}: cannot be imported: {type(exc).__name__}: {exc}")
            continue
        loaded.append(module)
        if not hasattr(module, "compile_variants"):
            if short.startswith("attention_"):
                continue  # paged_attention's helpers: their kernels must be listed there (coverage check below)
            if named:
                failures.append(f"{mod_name} has no compile_variants(target): every kernel module must list the "
                                "variants its dispatcher can choose (see kvcached/kernels/platform.py CompileVariant)")
            continue
        for target in targets:
            try:
                variants = _variants(mod_name, target)
            except Exception as exc:
                failures.append(f"{mod_name}.compile_variants({target!r}) raised {type(exc).__name__}: {exc}")
                continue
            per_target_listed[target] += len(variants)
            if patterns:
                picked = [i for i, v in enumerate(variants)
                          if any(p in f"{short}:{v.name}" or p == short for p in patterns)]
            else:
                picked = scope_indices(variants, target, full=args.full, full_on=full_on, pairwise_on=pairwise_on)
            jobs[target].extend((mod_name, i, target) for i in picked)

    if not patterns:
        listed = {id(v.fn) for m in loaded if hasattr(m, "compile_variants") for t in targets
                  for v in _variants(m.__name__, t)}
        failures += coverage_problems(loaded, listed)

    t0 = time.perf_counter()
    results: list[Result] = []
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="kvcached_compile_check_")
    saved_cache = os.environ.get("TRITON_CACHE_DIR")
    os.environ["TRITON_CACHE_DIR"] = cache_dir  # read by Triton at each compile; the workers inherit it
    try:
        # Each target in processes of its own: Triton 3.6's AMD backend keeps state from one target's compiles to
        # the next in a process (after gfx950 compiles, 42 of gfx942's bf16-query fp8 compiles failed an assertion
        # in FpToFpOpConversion on the H200 machine; gfx942 alone: 258 of 258 OK), and a user's process compiles
        # for its one GPU only.
        ctx = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
        for mine in (m for m in jobs.values() if m):
            with cf.ProcessPoolExecutor(max_workers=max(1, min(args.jobs, len(mine))), mp_context=ctx) as pool:
                for r in pool.map(compile_one, *zip(*mine, strict=True), chunksize=1):
                    results.append(r)
                    _print(r)
    finally:
        if saved_cache is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = saved_cache
        if not args.cache_dir:
            shutil.rmtree(cache_dir, ignore_errors=True)
    total = time.perf_counter() - t0
    bad = [r for r in results if not r.ok]
    for f in failures:
        print(f"FAIL  {f}")
    print("compile_check: per target, variants compiled of those listed, and compile seconds summed over the "
          "processes:")
    for t in targets:
        rs = [r for r in results if r.target == t]
        n = per_target_listed[t]
        if len(rs) == n:
            scope = "every variant"
        else:
            scope = "selected" if patterns else _scope(t, args.full, full_on, pairwise_on)
        print(f"  {t:<7} {len(rs):4d} of {n:4d} ({scope}) {sum(r.ms for r in rs) / 1e3:7.1f} s")
    import triton

    print(f"compile_check: {len(results) - len(bad)}/{len(results)} variant x target compiles OK in {total:.1f} s "
          f"({args.jobs} processes, Triton {triton.__version__}); {len(bad)} failed; {len(failures)} other problem(s).")
    if not any(jobs.values()) and not failures:
        print("compile_check: nothing matched; check --only/--modules.")
        return 1
    return 1 if bad or failures else 0


def _print(r: Result) -> None:
    status = "OK  " if r.ok else "FAIL"
    line = f"{status}  {r.target:<7} {r.ms:8.0f} ms  {r.name}  {r.info}"
    if not r.ok:
        line += f"\n      {r.error[:2000]}"
    print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())

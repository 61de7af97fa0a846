"""The ahead-of-time compile check, run in its own process (never inside the interpreter)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BROKEN = textwrap.dedent(
    """
    import triton
    import triton.language as tl

    from kvcached.kernels.platform import CompileVariant


    @triton.jit
    def fine_kernel(x_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(x_ptr + i, tl.load(x_ptr + i) * 2)


    @triton.jit
    def broken_kernel(x_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(x_ptr + i, tl.load(x_ptr + i) + not_defined_anywhere)


    def compile_variants(target):
        sig = {"x_ptr": "*fp32", "N": "constexpr"}
        return [CompileVariant("fine", fine_kernel, sig, {"N": 64}),
                CompileVariant("broken", broken_kernel, sig, {"N": 64})]
    """
)


def _run(args, tmp_path=None, interpret=False):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    paths = [str(ROOT)] + ([str(tmp_path)] if tmp_path else []) + [env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return subprocess.run([sys.executable, "-m", "kvcached.kernels.compile_check", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_write_kv_compiles_for_amd_and_nvidia():
    r = _run(["--targets", "gfx942,sm90", "--only", "write_kv[bf16->bf16,h8x128],write_kv[bf16->fp8"])
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("OK")]
    # bf16 and the target's fp8 (e4m3fnuz on gfx942, e4m3fn on sm90)
    assert any("gfx942" in ln and "fp8e4b8" in ln for ln in lines), r.stdout
    assert any("sm90" in ln and "fp8e4nv" in ln for ln in lines), r.stdout
    assert any("gfx942" in ln and "vgprs=" in ln for ln in lines), r.stdout
    assert "0 failed" in r.stdout


def test_broken_variant_fails_loudly(tmp_path):
    (tmp_path / "kvc_broken_kernels.py").write_text(BROKEN)
    r = _run(["--targets", "sm90,gfx942", "--only", "kvc_broken_kernels", "--modules", "kvc_broken_kernels"],
             tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    out = r.stdout
    assert out.count("OK    ") == 2 and out.count("FAIL  ") == 2, out
    assert "not_defined_anywhere" in out
    assert "2 failed" in out


def test_module_without_compile_variants_fails(tmp_path):
    (tmp_path / "kvc_no_variants.py").write_text("X = 1\n")
    r = _run(["--targets", "sm90", "--only", "kvc_no_variants", "--modules", "kvc_no_variants"], tmp_path)
    assert r.returncode == 1
    assert "has no compile_variants" in r.stdout


def test_refuses_to_run_in_the_interpreter():
    r = _run(["--targets", "sm90", "--only", "write_kv"], interpret=True)
    assert r.returncode == 2
    assert "TRITON_INTERPRET" in r.stderr


def test_attention_compiles_for_amd_and_nvidia():
    # the plain decode and the all-features prefill; the whole list is CI's own compile_check step
    only = "attn_decode[bf16-bf16-d128],attn_prefill[bf16-bf16-d128-features]"
    r = _run(["--targets", "gfx942,sm90", "--only", only])
    assert r.returncode == 0, r.stdout + r.stderr
    ok = [ln for ln in r.stdout.splitlines() if ln.startswith("OK")]
    assert len(ok) == 4, r.stdout
    assert any("gfx942" in ln and "attn_prefill" in ln and "vgprs=" in ln for ln in ok), r.stdout
    assert any("sm90" in ln and "attn_decode" in ln for ln in ok), r.stdout


def test_representative_subset_has_every_kernel_dtype_and_constexpr_value():
    # CI compiles this subset for gfx90a, gfx950, sm80 and sm90, a pairwise cover for gfx942 (--full: all)
    import importlib

    from kvcached.kernels.compile_check import DEFAULT_MODULES, representative

    for target in ("gfx90a", "gfx950", "sm80", "sm90"):
        for name in DEFAULT_MODULES:
            variants = importlib.import_module(name).compile_variants(target)
            picked = representative(variants)
            assert picked == sorted(set(picked)) and 0 < len(picked) < len(variants)
            assert representative(variants) == picked  # deterministic
            sub = [variants[i] for i in picked]
            for v in variants:
                k = v.fn.__name__
                for arg, t in v.signature.items():
                    if t.startswith("*"):
                        assert any(s.fn.__name__ == k and s.signature[arg] == t for s in sub), (target, k, arg, t)
                for name, value in v.constexprs.items():
                    assert any(s.fn.__name__ == k and s.constexprs.get(name) == value for s in sub), (target, k, name)
                for name, value in v.options.items():
                    assert any(s.fn.__name__ == k and s.options.get(name) == value for s in sub), (target, k, name)


def test_representative_subset_is_small():
    from kvcached.kernels.compile_check import representative
    from kvcached.kernels.platform import CompileVariant

    def kernel():
        pass

    variants = [CompileVariant(f"v{i}", kernel, {"x": f"*{dt}"}, {"N": n}) for i, (dt, n) in
                enumerate((dt, n) for dt in ("fp16", "bf16", "fp32") for n in (16, 32, 64, 128))]
    picked = representative(variants)
    assert len(picked) == 4  # 4 values of N, 3 dtypes: 4 variants cover both axes
    assert {variants[i].constexprs["N"] for i in picked} == {16, 32, 64, 128}
    assert {variants[i].signature["x"] for i in picked} == {"*fp16", "*bf16", "*fp32"}


def _toy_variants(**axes: tuple) -> list:
    from kvcached.kernels.platform import CompileVariant

    def kernel():
        pass

    names = list(axes)
    out = []
    for i, values in enumerate(itertools.product(*axes.values())):
        setting = dict(zip(names, values, strict=True))
        out.append(CompileVariant(f"v{i}", kernel, {"x": f"*{setting.pop('dt', 'fp32')}"}, setting))
    return out


def _uncovered_pairs(variants: list, picked: list[int]) -> list:
    from kvcached.kernels.compile_check import _features

    have = set()
    for i in picked:
        have |= set(itertools.combinations(sorted(_features(variants[i]), key=repr), 2))
    return [pair for v in variants for pair in itertools.combinations(sorted(_features(v), key=repr), 2)
            if pair not in have]


def test_pairwise_cover_compiles_every_two_settings_together():
    from kvcached.kernels.compile_check import pairwise, representative

    # two axes: one value each is what the representative subset needs; every pair needs all four
    two = _toy_variants(dt=("fp16", "bf16"), N=(16, 32))
    assert len(representative(two)) == 2 and _uncovered_pairs(two, representative(two))
    assert pairwise(two) == [0, 1, 2, 3] and not _uncovered_pairs(two, pairwise(two))
    # three axes of two values: the 12 pairs fit in fewer than the 8 combinations
    three = _toy_variants(dt=("fp16", "bf16"), N=(16, 32), M=(1, 2))
    picked = pairwise(three)
    assert 4 <= len(picked) < 8 and not _uncovered_pairs(three, picked)
    assert not _uncovered_pairs(three, list(range(8)))  # the checker itself: the full set covers all,
    assert all(_uncovered_pairs(two, [j for j in range(4) if j != i]) for i in range(4))  # each of 4 is needed


def test_pairwise_cover_of_the_real_kernels_on_gfx942():
    import importlib

    from kvcached.kernels.compile_check import DEFAULT_MODULES, pairwise, scope_indices

    total = chosen = 0
    for name in DEFAULT_MODULES:
        variants = importlib.import_module(name).compile_variants("gfx942")
        picked = pairwise(variants)
        assert picked == sorted(set(picked)) and pairwise(variants) == picked  # deterministic
        assert not _uncovered_pairs(variants, picked), name
        assert scope_indices(variants, "gfx942") == picked  # what CI compiles there
        assert scope_indices(variants, "gfx942", full=True) == list(range(len(variants)))
        assert scope_indices(variants, "gfx942", full_on={"gfx942"}) == list(range(len(variants)))
        total += len(variants)
        chosen += len(picked)
    assert chosen < total / 2, (chosen, total)


def _pid_compile(module: str, index: int, target: str):
    from kvcached.kernels.compile_check import Result

    return Result(f"{module}:{index}", target, True, 0.0, f"pid={os.getpid()}")


def test_each_target_compiles_in_processes_of_its_own(monkeypatch, capsys):
    """Triton 3.6 carries state from one target's compiles to another's in a process (gfx950 then gfx942:
    false failures), so no worker may compile for two targets."""
    from kvcached.kernels import compile_check

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(compile_check, "compile_one", _pid_compile)
    assert compile_check.main(["--targets", "gfx950,gfx942,sm90", "--only", "write_kv", "--jobs", "2"]) == 0
    pids: dict[str, set] = {}
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("OK"):
            target, pid = line.split()[1], line.split("pid=")[1]
            pids.setdefault(target, set()).add(pid)
    assert set(pids) == {"gfx950", "gfx942", "sm90"}
    assert not (pids["gfx950"] & pids["gfx942"]) and not (pids["gfx942"] & pids["sm90"])
    assert not (pids["gfx950"] & pids["sm90"]) and str(os.getpid()) not in set().union(*pids.values())

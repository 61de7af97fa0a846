"""Vendor facts the kernels need, and the record of a compilable kernel variant."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def speed_up_interpreter() -> bool:
    """Stop Triton's interpreter from re-patching ``triton.language`` at every ``@triton.jit`` helper call.

    Triton 3.9's interpreter patches the language module (every builtin wrapped, ``range``, the tensor class,
    reductions) when a kernel launches, and again at every call of a jit helper inside it, though the launch's
    patch is still in force: about a third of the time of our kernels in the interpreter (88 of the 241 s of a
    CPU vLLM engine run on our backend, cProfile; ``attn_tile`` is called once a key tile). Here a helper call
    whose language modules are already patched (their ``load`` is no longer a Triton builtin) gets an empty patch
    scope instead; every other call patches as before, and the launch still restores everything. A no-op (False)
    where Triton's interpreter lacks the functions this relies on.
    """
    try:
        import triton.language as tl
        from triton.runtime import interpreter as interp
    except ImportError:
        return False
    patch = getattr(interp, "_patch_lang", None)
    if getattr(patch, "kvcached_patch_once", False):
        return True  # in place already
    scope_cls = getattr(interp, "_LangPatchScope", None)
    is_builtin = getattr(tl.core, "is_builtin", None)
    if patch is None or scope_cls is None or is_builtin is None:
        return False
    langs_of: dict[Any, tuple[Any, ...]] = {}

    def patch_once(fn: Any) -> Any:
        langs = langs_of.get(fn)
        if langs is None:
            langs = langs_of[fn] = tuple(v for v in fn.__globals__.values() if v is tl or v is tl.core)
        if langs and not any(is_builtin(getattr(m, "load", None)) for m in langs):
            return scope_cls()  # patched by the launch (or an earlier helper call): nothing to do, nothing to undo
        return patch_once.__wrapped__(fn)

    patch_once.__wrapped__ = patch  # type: ignore[attr-defined]  # Triton's own (tests count its calls)
    patch_once.kvcached_patch_once = True  # type: ignore[attr-defined]
    interp._patch_lang = patch_once
    return True


def is_hip() -> bool:
    return bool(getattr(torch.version, "hip", None))


def fp8_kv_dtype() -> torch.dtype:
    """The fp8 KV-cache dtype of this vendor: e4m3fnuz on AMD (MI300), e4m3fn on NVIDIA."""
    return torch.float8_e4m3fnuz if is_hip() else torch.float8_e4m3fn


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2)


# Host-side twins of triton.cdiv / triton.next_power_of_2: those are constexpr functions in Triton >= 3.6, whose
# host calls unwrap every argument (3-4 us each on the H200 machine's CPU, three of them in every attention call).
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class CompileVariant:
    """One kernel specialisation a dispatcher can pick, compilable ahead of time.

    ``signature`` maps every non-constexpr argument to a Triton type string
    (``"*bf16"``, ``"i32"``, ``"fp32"``...); ``constexprs`` maps the constexpr
    arguments to values. ``options`` are compile options such as ``num_warps``,
    ``num_stages`` and, on HIP, ``waves_per_eu``.
    """

    name: str
    fn: Any
    signature: dict[str, str]
    constexprs: dict[str, Any]
    options: dict[str, Any] = field(default_factory=dict)


_dispatch_depth = getattr(torch._C, "_len_torch_dispatch_stack", None)


def direct_launch_ok(t: torch.Tensor) -> bool:
    """True when a plain eager call may launch its kernels without the custom op's dispatcher.

    Going through ``torch.ops`` costs hundreds of microseconds of host time per
    call on the H200 host (docs/attention_tuning.md), more than a
    decode step's GPU time. Under torch.compile, dispatch modes, tensor subclasses
    or meta tensors the op must be used, so that they see the call.
    """
    return (
        _dispatch_depth is not None
        and type(t) is torch.Tensor
        and not torch.compiler.is_compiling()
        and _dispatch_depth() == 0
        and t.device.type != "meta"
    )


@contextlib.contextmanager
def override_knobs(store: dict[str, Any], known: Iterable[str], what: str, knobs: dict[str, Any]) -> Iterator[None]:
    """Temporarily put ``knobs`` into a kernel family's override ``store`` (benchmarks, tests)."""
    known = set(known)
    unknown = sorted(set(knobs) - known)
    if unknown:
        raise ValueError(f"unknown {what} knob(s) {unknown}; known: {', '.join(sorted(known))}.")
    saved = dict(store)
    store.update(knobs)
    try:
        yield
    finally:
        store.clear()
        store.update(saved)

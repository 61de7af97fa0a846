"""Run code that launches Triton kernels on CPU tensors, compiling every launch for a GPU target instead of
running it (helper for the tests, not a test module).

A launch is specialised from its real arguments (dtypes, which pointers are 16-byte aligned, which integers
divide by 16, the constexprs the caller derives from shapes), exactly as the same call on a GPU would be, so a
kernel that cannot compile for the arguments an engine gives it fails here as it would on the device. Nothing
runs: outputs keep whatever the caller put in them. Triton's interpreter must be off in this process.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Compiled:
    """The launches compiled so far: the kernel's name and the signature it was specialised to."""
    launches: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    keys: set[tuple[str, str]] = field(default_factory=set)

    def names(self) -> set[str]:
        return {name for name, _ in self.launches}


class _Driver:
    """What Triton's launch path asks the active driver for, answered for a target with no device behind it."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def get_current_target(self) -> Any:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_benchmarker(self) -> Any:
        """An autotuner "times" each config by launching it, which compiles it here: every config the autotuner
        may pick is compiled, and all take the same time (its first config wins)."""

        def bench(fn: Any, quantiles: Any = None, **_: Any) -> Any:
            fn()
            return [1.0] * len(quantiles) if quantiles else 1.0

        return bench


@contextlib.contextmanager
def compile_only(target: str) -> Iterator[Compiled]:
    """Within the block every ``kernel[grid](...)`` compiles for ``target`` (sm90, gfx942...: the names of
    :func:`kvcached.kernels.compile_check.gpu_target`) and returns
    without launching; a kernel that fails to compile raises as it would at its first launch on that GPU."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compile_only needs Triton's compiler: run it in a process without TRITON_INTERPRET=1")
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from kvcached.kernels.compile_check import gpu_target

    done = Compiled()
    original, seen = JITFunction._do_compile, {}

    def compile_and_skip(self, key, signature, device, constexprs, options, attrs, warmup):
        seen.setdefault(id(self), self)
        if (name := (self.fn.__name__, str(key))) not in done.keys:
            _, _, tgt, _, _ = self.device_caches[device]
            self.compile(self.ASTSource(self, signature, constexprs, attrs), target=tgt, options=options.__dict__)
            done.keys.add(name)
            done.launches.append((self.fn.__name__, dict(signature)))
        return None  # Triton's run returns at once where nothing was compiled to launch

    previous = driver._active
    driver.set_active(_Driver(gpu_target(target)))
    JITFunction._do_compile = compile_and_skip
    try:
        yield done
    finally:
        JITFunction._do_compile = original
        driver.set_active(previous)
        for fn in seen.values():  # binders made for the target must not serve a later launch on a real device
            fn.device_caches.clear()

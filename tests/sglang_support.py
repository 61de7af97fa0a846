"""Importing SGLang's own KV classes for the CPU tests (helper, not a test module).

SGLang has no CPU engine on the package index (its CPU path needs sgl-kernel's CPU
build), but its pools, allocators and radix cache are Python and Triton and import
against torch's CPU build. One obstacle: ``sglang.srt.utils`` imports torchvision,
and the index's torchvision wheels are CUDA builds whose native ops cannot load
into a CPU torch, so ``import torchvision`` fails registering a fake kernel for
``torchvision::nms``. There, and only there, the two op schemas it registers
unconditionally are declared first (nothing here calls them).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import uuid
from typing import Any

_TORCHVISION_SCHEMAS: Any = None  # kept alive: a torch.library.Library drops its definitions when collected
SGLANG_MODULES = ("sglang.srt.mem_cache.kv_cache_configurator", "sglang.srt.mem_cache.radix_cache",
                  "sglang.srt.managers.scheduler_components.invariant_checker",
                  "sglang.kernels.ops.attention.decode_attention", "sglang.srt.layers.radix_attention",
                  "sglang.srt.layers.attention.attention_registry", "sglang.srt.model_executor.forward_batch_info")


def _import_torchvision() -> None:
    global _TORCHVISION_SCHEMAS
    try:
        import torchvision  # noqa: F401
        return
    except RuntimeError as exc:
        if "torchvision::nms" not in str(exc):
            raise
    import torch

    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold, float scale, int zero_point) -> Tensor")
    _TORCHVISION_SCHEMAS = lib
    import torchvision  # noqa: F401,F811


def sglang_missing() -> str | None:
    """None when SGLang's KV classes import here; otherwise why not (the tests' skip reason)."""
    if importlib.util.find_spec("sglang") is None:
        return "SGLang is not installed (docs/sglang.md: the CPU test environment)"
    from kvcached.errors import KVCachedConfigError
    from kvcached.integration.sglang.version import check_sglang_version, installed_sglang_version

    try:
        check_sglang_version(installed_sglang_version())
    except KVCachedConfigError as exc:  # the tests build that release's classes: another one is not under test
        return str(exc)
    try:
        if importlib.util.find_spec("torchvision") is not None:
            _import_torchvision()
        for name in SGLANG_MODULES:
            importlib.import_module(name)
    except Exception as exc:  # any import failure is the reason to skip, reported as is
        return f"SGLang's KV modules do not import here: {type(exc).__name__}: {exc}"
    return None


def exact_mapping_env(monkeypatch: Any, contiguous: bool, host_mb: int) -> None:
    """An engine's environment on the host backend in which a kvcached page is mapped exactly while it
    holds a handed-out block (no reserve, no prealloc), so tests can count mapped pages."""
    monkeypatch.setenv("KVCACHED_IPC_NAME", f"kvcached_test_{os.getpid()}_{uuid.uuid4().hex[:8]}")
    monkeypatch.setenv("KVCACHED_HOST_MEM_LIMIT_MB", str(host_mb))
    monkeypatch.setenv("KVCACHED_CONTIGUOUS_LAYOUT", "true" if contiguous else "false")
    for name, value in (("KVCACHED_MIN_RESERVED_PAGES", "0"), ("KVCACHED_MAX_RESERVED_PAGES", "0"),
                        ("KVCACHED_PAGE_PREALLOC_ENABLED", "false")):
        monkeypatch.setenv(name, value)

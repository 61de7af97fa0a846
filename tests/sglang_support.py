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
import inspect
import os
import sys
import uuid
from types import SimpleNamespace
from typing import Any
from unittest import mock

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


def mamba2_params(inter: int, heads: int, dim: int, state: int, layers: int, conv: Any = None) -> Any:
    """SGLang's ``Mamba2CacheParams`` of a model with ``layers`` Mamba2 layers (ids 0, 2, ...: attention between):
    one group, a 4-wide convolution, conv states in ``conv`` (default bf16, SGLang's), SSM states float32."""
    import torch
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape

    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=inter, n_groups=1, num_heads=heads,
                                    head_dim=dim, state_size=state, conv_kernel=4)
    return Mamba2CacheParams(shape=shape, layers=list(range(0, 2 * layers, 2)),
                             dtype=Mamba2StateDType(conv=conv or torch.bfloat16, temporal=torch.float32))


def hybrid_pool(params: Any, mamba_size: int = 24, extra_buffer: bool = False, lazy: bool = False) -> Any:
    """SGLang's ``HybridReqToTokenPool`` as its configurator builds it (kvcached's states where the hooks are in)."""
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

    return HybridReqToTokenPool(size=8, mamba_size=mamba_size, mamba_spec_state_size=8, max_context_len=64,
                                device="cpu", enable_memory_saver=False, cache_params=params,
                                mamba_layer_ids=params.layers, enable_mamba_extra_buffer=extra_buffer,
                                enable_mamba_extra_buffer_lazy=lazy)


def finish_request(cache: Any, req: Any, n: int) -> None:
    """``req``, its first ``n`` KV rows written, finishes as SGLang finishes it: its KV goes into the radix
    ``cache`` (which keeps what it can key and frees the rest) and its request slot is freed. SGLang's
    ``release_kv_cache`` hands 0.5.17 - 0.5.20's caches ``cache_finished_req`` (called here as it calls it); 0.5.21
    split that into ``insert_req``, ``free_kv_row``, ``unpin`` and ``on_release`` (0.5.22: ``checkpoint``,
    ``free_kv_row``, ``unlock``, ``on_release``), so there ``release_kv_cache`` itself runs, on the lengths SGLang's
    allocation records (``kv_committed_len``, ``kv_allocated_len``)."""
    if hasattr(cache, "cache_finished_req"):
        cache.cache_finished_req(req, kv_len_to_handle=n)
        cache.req_to_token_pool.free(req)
        return
    import sglang.srt.managers.schedule_batch as batch
    import sglang.srt.mem_cache.common as common

    req.kv.kv_committed_len = req.kv.kv_allocated_len = n
    if req.finished_reason is None:  # finished, as SGLang's release of it reads (0.5.22 asserts it for Mamba trees)
        req.finished_reason = batch.FINISH_LENGTH(length=n)
    # two reads of SGLang's published server configuration (not published outside an engine): no speculative
    # decoding, no stripping of thinking tokens (its defaults)
    spec, serving = SimpleNamespace(speculative_algorithm=None), SimpleNamespace(strip_thinking_cache=False)
    with (mock.patch.object(common, "get_spec", lambda: spec),
          mock.patch.object(common, "get_serving", lambda: serving),
          mock.patch.object(batch, "get_serving", lambda: serving)):
        # 0.5.22: the caller says whether the tree keeps the request's KV first (a finished request: it does)
        keep = {"checkpoint": True} if "checkpoint" in inspect.signature(common.release_kv_cache).parameters else {}
        common.release_kv_cache(req, cache, **keep)

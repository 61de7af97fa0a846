"""Every kind of bad input raises a clear exception and leaves live KV data and pool state intact."""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import re
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from kvcached import _vmm, kernels, kv_cache_manager, mem_info, vmm_ops
from kvcached.cli import utils as cli_utils
from kvcached.errors import KVCachedConfigError, KVCachedError, KVCachedStateError, KVCachePoolExhausted
from kvcached.integration.sglang import interfaces as sg
from kvcached.integration.vllm import interfaces as vi
from kvcached.kv_cache_manager import KVCacheManager
from kvcached.layout import KVGeometry, KVSpec, kv_cache_view

MiB = 1 << 20
LAYERS, HEADS, HEAD, BS = 2, 2, 64, 16
DTYPE = torch.float16
CELL = HEADS * HEAD * 2  # 256 B per token: 4 KiB blocks, 512 per page
PAGES = 4


@dataclass
class Ctx:
    mgr: KVCacheManager
    views: list[torch.Tensor]
    live: list[int]
    geom: KVGeometry
    raw: list[torch.Tensor]


def _stamp(ctx: Ctx) -> None:
    for b in ctx.live:
        for layer, v in enumerate(ctx.views):
            v[0, b].fill_(float(b % 1000) + layer)
            v[1, b].fill_(-float(b % 1000) - layer)


def _intact(ctx: Ctx) -> None:
    for b in ctx.live:
        for layer, v in enumerate(ctx.views):
            for kv, val in ((0, float(b % 1000) + layer), (1, -float(b % 1000) - layer)):
                t = v[kv, b]
                assert torch.equal(t, torch.full_like(t, val)), f"live block {b} changed"


@contextlib.contextmanager
def _case_env() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVCACHED_IPC_NAME", f"kvcached_test_{os.getpid()}_{uuid.uuid4().hex[:8]}")
        mp.setenv("KVCACHED_HOST_MEM_LIMIT_MB", "256")
        mp.setattr(kv_cache_manager, "KV_TENSOR_WAIT_TIMEOUT", 0.05)
        try:
            yield mp
        finally:
            vi.shutdown_kvcached()
            sg.shutdown_kvcached()
            if vmm_ops.is_initialized():
                vmm_ops.shutdown_kvcached()


@pytest.fixture
def env():
    with _case_env() as mp:
        yield mp


@pytest.fixture
def ctx(env: pytest.MonkeyPatch) -> Ctx:
    return _make_ctx()


def _make_ctx() -> Ctx:
    vmm_ops.init_kvcached("cpu", contiguous_layout=True)
    rt = vmm_ops.runtime()
    raw = vmm_ops.create_kv_tensors(PAGES * 2 * rt.page_size, 2, "cpu", LAYERS)
    geom = KVGeometry(KVSpec(LAYERS, PAGES * 512, BS, HEADS, HEAD, DTYPE), rt.layout, rt.page_size)
    views = [kv_cache_view(raw, geom, layer) for layer in range(LAYERS)]
    mgr = KVCacheManager(PAGES * 512, BS, CELL, LAYERS, reserve_null_block=True)
    live = mgr.alloc(700)
    assert live is not None
    assert mgr.try_to_reserve(10)
    c = Ctx(mgr, views, live, geom, raw)
    _stamp(c)
    return c


# -- bad inputs with a live pool -------------------------------------------
def _second_group(ctx: Ctx) -> None:
    vmm_ops.create_kv_tensors(2 * 2 * MiB, 2, "cpu", LAYERS, group_id=1)


def _with_env(name: str, value: str) -> Callable[[Ctx, pytest.MonkeyPatch], None]:
    def run(ctx: Ctx, mp: pytest.MonkeyPatch) -> None:
        _second_group(ctx)
        mp.setenv(name, value)
        KVCacheManager(512, BS, CELL, LAYERS, group_id=1)

    return run


LIVE_CASES: dict[str, tuple[Callable[[Ctx, pytest.MonkeyPatch], object], type[BaseException], str]] = {
    "free-double": (lambda c, mp: c.mgr.free([c.live[0], c.live[0]]), ValueError, "twice|double"),
    "free-unallocated": (lambda c, mp: c.mgr.free([PAGES * 512 - 1]), ValueError, "not allocated"),
    "free-out-of-range": (lambda c, mp: c.mgr.free([10**9]), ValueError, "out of range"),
    "free-negative": (lambda c, mp: c.mgr.free([-1]), ValueError, "out of range"),
    "free-not-ints": (lambda c, mp: c.mgr.free(["a"]), ValueError, "not an int"),
    "free-not-a-list": (lambda c, mp: c.mgr.free(5), ValueError, "list of ints"),
    "free-mixed-good-and-bad": (lambda c, mp: c.mgr.free([c.live[1], 10**9]), ValueError, "nothing was freed"),
    "free-null-block": (lambda c, mp: c.mgr.free([0]), ValueError, "null block"),
    "free-reserved-block": (lambda c, mp: c.mgr.free([c.mgr._reserved[0]]), ValueError, "free_reserved"),
    "free-iterator-null-block": (lambda c, mp: c.mgr.free(iter([c.live[0], 0])), ValueError, "null block"),
    "free-generator-reserved-block": (lambda c, mp: c.mgr.free(i for i in [c.live[0], c.mgr._reserved[0]]),
                                      ValueError, "free_reserved"),
    "free-unhashable-id": (lambda c, mp: c.mgr.free([c.live[0], [1]]), ValueError, r"ids\[1\] is not an int"),
    "free-bool-id": (lambda c, mp: c.mgr.free([c.live[0], True]), ValueError, r"ids\[1\] is not an int"),
    # bytes iterate as ints: b"\x01" would free block 1
    "free-bytes": (lambda c, mp: c.mgr.free(b"\x01"), ValueError, "got bytes.*not block ids"),
    "free-bytearray": (lambda c, mp: c.mgr.free(bytearray(b"\x01\x02")), ValueError, "got bytearray.*not block ids"),
    "free-memoryview": (lambda c, mp: c.mgr.free(memoryview(b"\x01")), ValueError, "got memoryview.*not block ids"),
    "alloc-bool": (lambda c, mp: c.mgr.alloc(True), TypeError, "int number of blocks"),
    "alloc-negative": (lambda c, mp: c.mgr.alloc(-1), ValueError, ">= 0"),
    "alloc-float": (lambda c, mp: c.mgr.alloc(1.5), TypeError, "int"),
    "over-allocation-raises-exhausted": (lambda c, mp: c.mgr.alloc_or_raise(PAGES * 512), KVCachePoolExhausted,
                                         "cannot provide"),
    "reserve-negative": (lambda c, mp: c.mgr.try_to_reserve(-3), ValueError, ">= 0"),
    "free-reserved-keep-negative": (lambda c, mp: c.mgr.free_reserved(keep=-1), ValueError, "keep must be an int"),
    "alloc-spare-negative": (lambda c, mp: c.mgr.alloc(1, spare_reserved=-1), ValueError, "spare_reserved"),
    "resize-zero": (lambda c, mp: c.mgr.resize(0), ValueError, "positive"),
    "set-limit-negative": (lambda c, mp: c.mgr.set_limit("ipc", -3), ValueError, "int >= 0 or None"),
    "set-limit-bool": (lambda c, mp: c.mgr.set_limit("ipc", True), ValueError, "int >= 0 or None"),
    "set-limit-no-source": (lambda c, mp: c.mgr.set_limit("", 3), ValueError, "non-empty name"),
    "resize-string": (lambda c, mp: c.mgr.resize("1G"), ValueError, "positive int"),
    "memory-limit-negative": (lambda c, mp: c.mgr.set_memory_limit(-1, revision=1), ValueError,
                              "limit_bytes must be an int number of bytes >= 0"),
    "memory-limit-revision-bool": (lambda c, mp: c.mgr.set_memory_limit(MiB, revision=True), ValueError,
                                   "revision must be an int"),
    "memory-limit-past-64-bits": (lambda c, mp: c.mgr.set_memory_limit(1 << 64, revision=1), ValueError,
                                  "too large"),
    "snapshot-integration-not-a-name": (lambda c, mp: c.mgr.observability_snapshot(integration=5), ValueError,
                                        "integration must be a non-empty name"),
    "snapshot-dict-integration-empty": (lambda c, mp: c.mgr.observability_snapshot_dict(integration=""), ValueError,
                                        "integration must be a non-empty name"),
    "mapped-size-bad-unit": (lambda c, mp: c.mgr.get_mapped_memory_size("tb"), ValueError, "unknown unit"),
    "manager-block-straddles-page": (lambda c, mp: KVCacheManager(100, 3, 1000, LAYERS, group_id=1),
                                     KVCachedConfigError, "straddle"),
    "manager-block-larger-than-page": (lambda c, mp: KVCacheManager(100, 4096, 1024, LAYERS, group_id=1),
                                       KVCachedConfigError, "straddle"),
    "manager-zero-blocks": (lambda c, mp: KVCacheManager(0, BS, CELL, LAYERS), KVCachedConfigError, "positive"),
    "manager-tensor-parallel": (lambda c, mp: KVCacheManager(10, BS, CELL, LAYERS, world_size=2),
                                KVCachedConfigError, "tensor parallel"),
    "manager-too-many-blocks": (lambda c, mp: KVCacheManager(PAGES * 512 + 1, BS, CELL, LAYERS),
                                KVCachedConfigError, "needs 5 pages"),
    "manager-layer-mismatch": (lambda c, mp: KVCacheManager(10, BS, CELL, LAYERS + 1), KVCachedConfigError,
                               "does not match"),
    "manager-second-on-group": (lambda c, mp: KVCacheManager(10, BS, CELL, LAYERS), KVCachedStateError,
                                "already has a live KVCacheManager"),
    "manager-before-kv-tensors": (lambda c, mp: KVCacheManager(10, BS, CELL, LAYERS, group_id=7).alloc(1),
                                  KVCachedStateError, "create_kv_tensors"),
    "kv-tensors-not-page-multiple": (lambda c, mp: vmm_ops.create_kv_tensors(3 * MiB, 2, "cpu", LAYERS, group_id=1),
                                     KVCachedConfigError, "whole pages"),
    "kv-tensors-group-exists": (lambda c, mp: vmm_ops.create_kv_tensors(4 * MiB, 2, "cpu", LAYERS),
                                KVCachedStateError, "already exist"),
    "kv-tensors-wrong-device": (lambda c, mp: vmm_ops.create_kv_tensors(4 * MiB, 2, "cuda:0", LAYERS, group_id=1),
                                KVCachedConfigError, "does not match the device"),
    "kv-tensors-three-buffers": (lambda c, mp: vmm_ops.create_kv_tensors(6 * MiB, 2, "cpu", LAYERS, 3, 1),
                                 KVCachedConfigError, "num_kv_buffers"),
    "kv-tensors-negative-size": (lambda c, mp: vmm_ops.create_kv_tensors(-4, 2, "cpu", LAYERS, group_id=1),
                                 KVCachedConfigError, "positive int"),
    "init-twice": (lambda c, mp: vmm_ops.init_kvcached("cpu"), KVCachedStateError, "already initialized"),
    "page-runs-not-a-backend": (lambda c, mp: vmm_ops.page_runs("cuda", "contiguous"), KVCachedConfigError,
                                "must be a kvcached Backend"),
    "fit-page-size-bool": (lambda c, mp: vmm_ops.fit_page_size(True), KVCachedConfigError,
                           "block_bytes must be a positive int"),
    "map-misaligned-offset": (lambda c, mp: vmm_ops.map_to_kv_tensors([12345]), ValueError, "multiple of the page"),
    "map-managed-group": (lambda c, mp: vmm_ops.map_to_kv_tensors([0]), KVCachedStateError, "managed by"),
    "unmap-out-of-range": (lambda c, mp: vmm_ops.unmap_from_kv_tensors([1 << 40]), ValueError, "beyond"),
    "view-unknown-style": (lambda c, mp: kv_cache_view(c.raw, c.geom, 0, "hnd"), ValueError, "unknown view style"),
    "view-wrong-base-dtype": (lambda c, mp: kv_cache_view([torch.zeros(10)], c.geom, 0), ValueError, "1-D uint8"),
    "vllm-mla-shape-block-mismatch": (lambda c, mp: (mp.setattr(vi, "_kvcached_initialized", True),
                                                     vi.alloc_kv_cache((10, 32, 64), 16, DTYPE, "cpu", 2,
                                                                       attention_type="MLA")),
                                      KVCachedConfigError, "MLA kv cache shape must be"),
    "vllm-unsupported-dtype": (lambda c, mp: KVSpec(2, 10, 16, 2, 64, torch.complex64), KVCachedConfigError,
                               "not supported"),
    "sglang-page-does-not-divide": (lambda c, mp: (mp.setattr(sg, "_kvcached_initialized", True),
                                                   sg.alloc_kv_cache((100, 3, 100), DTYPE, "cpu", 2, page_size=3)),
                                    KVCachedConfigError, "does not divide"),
    "sglang-page-size-bool": (lambda c, mp: (mp.setattr(sg, "_kvcached_initialized", True),
                                             sg.alloc_kv_cache((100, 2, 64), DTYPE, "cpu", 2, page_size=True)),
                              KVCachedConfigError, "page_size .* must be a positive int"),
    "sglang-shape-not-3d": (lambda c, mp: (mp.setattr(sg, "_kvcached_initialized", True),
                                           sg.alloc_kv_cache((100, 2), DTYPE, "cpu", 2)),
                            KVCachedConfigError, "num_tokens, heads, head_dim"),
    "vllm-attention-type": (lambda c, mp: (mp.setattr(vi, "_kvcached_initialized", True),
                                           vi.alloc_kv_cache((2, 10, 16, 2, 64), 16, DTYPE, "cpu", 2,
                                                             attention_type="LINEAR")),
                            KVCachedConfigError, "not supported"),
    "vllm-kv-layout-hnd": (lambda c, mp: (mp.setattr(vi, "_kvcached_initialized", True),
                                          vi.alloc_kv_cache((2, 10, 16, 2, 64), 16, DTYPE, "cpu", 2, kv_layout="HND")),
                           KVCachedConfigError, "NHD"),
    "vllm-bad-shape": (lambda c, mp: (mp.setattr(vi, "_kvcached_initialized", True),
                                      vi.alloc_kv_cache((3, 10, 16, 2, 64), 16, DTYPE, "cpu", 2)),
                       KVCachedConfigError, "neither"),
    "env-min-reserved-not-int": (_with_env("KVCACHED_MIN_RESERVED_PAGES", "abc"), KVCachedConfigError,
                                 "KVCACHED_MIN_RESERVED_PAGES='abc' is not an integer"),
    "env-min-above-max": (_with_env("KVCACHED_MIN_RESERVED_PAGES", "50"), KVCachedConfigError, "exceeds"),
    "env-utilization-above-one": (_with_env("KVCACHED_GPU_UTILIZATION", "2"), KVCachedConfigError,
                                  "KVCACHED_GPU_UTILIZATION"),
    "env-max-reserved-past-64-bits": (_with_env("KVCACHED_MAX_RESERVED_PAGES", str(2**70)), KVCachedConfigError,
                                      "KVCACHED_MAX_RESERVED_PAGES=.* must be at most"),
    "manager-num-kv-buffers-bool": (lambda c, mp: KVCacheManager(10, BS, CELL, LAYERS, num_kv_buffers=True, group_id=1),
                                    KVCachedConfigError, "num_kv_buffers must be 1 or 2, got True"),
    "manager-group-id-bool": (lambda c, mp: KVCacheManager(10, BS, CELL, LAYERS, group_id=True),
                              KVCachedConfigError, "group_id must be an int"),
    "manager-world-size-bool": (lambda c, mp: KVCacheManager(10, BS, CELL, LAYERS, world_size=True),
                                KVCachedConfigError, "world_size=True"),
    "kv-tensors-group-id-bool": (lambda c, mp: vmm_ops.create_kv_tensors(4 * MiB, 2, "cpu", LAYERS, group_id=True),
                                 KVCachedConfigError, "group_id must be an int"),
    "kv-tensors-buffers-bool": (lambda c, mp: vmm_ops.create_kv_tensors(4 * MiB, 2, "cpu", LAYERS, True, 1),
                                KVCachedConfigError, "num_kv_buffers"),
    "kv-spec-kv-factor-bool": (lambda c, mp: KVSpec(2, 10, 16, 2, 64, DTYPE, True), KVCachedConfigError,
                               "kv_factor must be 1 or 2"),
    "env-prealloc-not-bool": (_with_env("KVCACHED_PAGE_PREALLOC_ENABLED", "maybe"), KVCachedConfigError,
                              "not a boolean"),
    "kvctl-negative-limit": (lambda c, mp: cli_utils.update_kv_cache_limit(mem_info.publisher().name, -5),
                             ValueError, ">= 0"),
    "ipc-name-with-slash": (lambda c, mp: mem_info.read_segment("a/b"), ValueError, "is a path, not a name"),
    "ipc-base-engine-with-slash": (lambda c, mp: mem_info.default_ipc_base("v/LLM"), ValueError,
                                   "letters and digits"),
    "ipc-base-engine-not-str": (lambda c, mp: mem_info.default_ipc_base(5), ValueError, "letters and digits"),
    "kv-tensors-created-group-not-int": (lambda c, mp: vmm_ops.kv_tensors_created("0"), KVCachedConfigError,
                                         "group_id must be an int"),
    "page-geometry-zero-layers": (lambda c, mp: vmm_ops.page_geometry(0, 4, 2 * MiB, 2, c.geom.layout),
                                  KVCachedConfigError, "num_layers must be a positive int"),
    # the native objects under the manager, called directly
    "page-allocator-alloc-negative": (lambda c, mp: c.mgr.page_allocator.alloc_pages(-1), ValueError, "n >= 0"),
    "page-allocator-map-out-of-range": (lambda c, mp: c.mgr.page_allocator.map_pages([10**6]), ValueError,
                                        "out of range .* nothing was mapped"),
    "page-allocator-free-not-in-use": (lambda c, mp: c.mgr.page_allocator.free_pages([PAGES - 1]), ValueError,
                                       "not in use .* nothing was freed"),
    "page-allocator-limit-negative": (lambda c, mp: c.mgr.page_allocator.set_limit_pages(-1), ValueError, "n >= 0"),
    "page-allocator-lazy-reserve-negative": (lambda c, mp: c.mgr.page_allocator.set_lazy_reserve_ms(-1), ValueError,
                                             "ms >= 0"),
    "page-allocator-lazy-reserve-not-int": (lambda c, mp: c.mgr.page_allocator.set_lazy_reserve_ms(1.5), TypeError,
                                            "ms must be an int, got float"),
    "page-allocator-is-in-use-out-of-range": (lambda c, mp: c.mgr.page_allocator.is_in_use(10**6), ValueError,
                                              "out of range"),
    "page-allocator-bad-region": (lambda c, mp: vmm_ops.PageAllocator(vmm_ops.runtime().backend,
                                                                      vmm_ops.get_group(0).vtensors,
                                                                      [(5, 0, 2 * MiB)], 1),
                                  ValueError, "tensor index out of range"),
    "block-pool-alloc-negative": (lambda c, mp: c.mgr._pool.alloc(-1), ValueError, "n >= 0"),
    "block-pool-free-out-of-range": (lambda c, mp: c.mgr._pool.free([10**9]), ValueError,
                                     "out of range .* nothing was freed"),
    "block-pool-free-bytes": (lambda c, mp: c.mgr._pool.free(b"\x01"), ValueError, "got bytes.*not block ids"),
    "block-pool-free-keeping-pages-bytes": (lambda c, mp: c.mgr._pool.free_keeping_pages(b"\x01"), ValueError,
                                            "got bytes.*not block ids"),
    "block-pool-free-keeping-pages-twice": (lambda c, mp: c.mgr._pool.free_keeping_pages([c.live[0], c.live[0]]),
                                            ValueError, "appears twice in one call; nothing was freed"),
    "block-pool-free-keeping-pages-not-ints": (lambda c, mp: c.mgr._pool.free_keeping_pages([c.live[0], "a"]),
                                               ValueError, r"ids\[1\] is not an int"),
    "block-pool-cancel-pending-live-block": (lambda c, mp: c.mgr._pool.cancel_pending([c.live[0]]), ValueError,
                                             "is not pending; nothing was changed"),
    "block-pool-is-allocated-negative": (lambda c, mp: c.mgr._pool.is_allocated(-1), ValueError, "out of range"),
    "block-pool-zero-blocks": (lambda c, mp: vmm_ops.BlockPool(c.mgr.page_allocator, 512, 0), ValueError,
                               "num_blocks must be positive"),
    "backend-unknown-kind": (lambda c, mp: vmm_ops.Backend("tpu"), ValueError, "unknown backend 'tpu'"),
    "backend-negative-host-limit": (lambda c, mp: vmm_ops.runtime().backend.set_host_limit(-1), ValueError,
                                    "host limit must be >= 0"),
    "virtual-tensor-empty": (lambda c, mp: vmm_ops.VirtualTensor(vmm_ops.runtime().backend, 0, 2 * MiB),
                             ValueError, "not a positive multiple of its unit"),
}


@pytest.mark.parametrize("kind", list(LIVE_CASES))
def test_bad_input_with_live_pool(kind: str, ctx: Ctx, env: pytest.MonkeyPatch) -> None:
    call, exc_type, pattern = LIVE_CASES[kind]
    m = ctx.mgr
    before = (m.num_allocated_blocks(), m.available_size(), list(m._reserved), m.page_allocator.num_in_use)
    with pytest.raises(exc_type) as info, _recording(kind):
        call(ctx, env)
    message = str(info.value)
    assert re.search(pattern, message), f"unclear message for {kind}: {message!r}"
    assert len(message) > 15, f"message too terse: {message!r}"
    # live data and the pool's state are untouched, and the pool still works
    _intact(ctx)
    assert (m.num_allocated_blocks(), m.available_size(), list(m._reserved), m.page_allocator.num_in_use) == before
    got = m.alloc(3)
    assert got is not None and not set(got) & set(ctx.live)
    m.free(got)
    _intact(ctx)


@pytest.mark.parametrize("make", [iter, tuple, lambda ids: (i for i in ids), lambda ids: dict.fromkeys(ids)])
def test_free_takes_any_iterable_once(ctx: Ctx, make: Callable[[list[int]], object]) -> None:
    m = ctx.mgr
    gone, ctx.live = ctx.live[:5], ctx.live[5:]
    before = m.num_allocated_blocks()
    m.free(make(gone))  # checked against the null block and the reservations, then freed
    assert m.num_allocated_blocks() == before - 5
    assert not any(m._pool.is_allocated(i) for i in gone)
    _intact(ctx)
    m.free_reserved()
    with pytest.raises(TypeError, match="int number of blocks"):
        m.alloc(True)  # the native fast path (no reservation) refuses a bool too
    assert m.num_allocated_blocks() == before - 15


# -- bad inputs with no runtime (before init, after shutdown, bad init env) ------
def _after_shutdown(mp: pytest.MonkeyPatch) -> None:
    vmm_ops.init_kvcached("cpu")
    vmm_ops.create_kv_tensors(4 * MiB, 2, "cpu", LAYERS)
    m = KVCacheManager(512, BS, CELL, LAYERS)
    vmm_ops.shutdown_kvcached()
    m.alloc(1)


def _init_env(name: str, value: str) -> Callable[[pytest.MonkeyPatch], None]:
    def run(mp: pytest.MonkeyPatch) -> None:
        mp.setenv(name, value)
        vmm_ops.init_kvcached("cpu")

    return run


NO_RUNTIME_CASES: dict[str, tuple[Callable[[pytest.MonkeyPatch], object], type[BaseException], str]] = {
    "create-before-init": (lambda mp: vmm_ops.create_kv_tensors(4 * MiB, 2, "cpu", 2), KVCachedStateError,
                           "not initialized"),
    "shutdown-before-init": (lambda mp: vmm_ops.shutdown_kvcached(), KVCachedStateError, "not initialized"),
    "manager-before-init": (lambda mp: KVCacheManager(10, BS, CELL, 2), KVCachedStateError, "init_kvcached"),
    "vllm-alloc-before-init": (lambda mp: vi.alloc_kv_cache((2, 10, 16, 2, 64), 16, DTYPE, "cpu", 2),
                               KVCachedStateError, "init_kvcached"),
    "sglang-manager-before-init": (lambda mp: sg.get_kv_cache_manager(10, 1, 256, 2), KVCachedStateError,
                                   "init_kvcached"),
    "use-after-shutdown": (_after_shutdown, KVCachedStateError, "closed|shut down"),
    "init-unknown-device": (lambda mp: vmm_ops.init_kvcached("tpu:0"), KVCachedConfigError, "not understood"),
    "init-bad-device-index": (lambda mp: vmm_ops.init_kvcached("cuda:x"), KVCachedConfigError, "bad index"),
    "init-page-not-2mib": (lambda mp: vmm_ops.init_kvcached("cpu", page_size=3 * MiB), KVCachedConfigError,
                           "multiple of 2 MiB"),
    "env-backend-unknown": (_init_env("KVCACHED_BACKEND", "tpu"), KVCachedConfigError, "KVCACHED_BACKEND"),
    "env-page-size-odd": (_init_env("KVCACHED_PAGE_SIZE_MB", "3"), KVCachedConfigError, "KVCACHED_PAGE_SIZE_MB"),
    "env-page-size-text": (_init_env("KVCACHED_PAGE_SIZE_MB", "two"), KVCachedConfigError, "not an integer"),
    "env-layout-not-bool": (_init_env("KVCACHED_CONTIGUOUS_LAYOUT", "maybe"), KVCachedConfigError,
                            "KVCACHED_CONTIGUOUS_LAYOUT"),
    "env-host-limit-zero": (_init_env("KVCACHED_HOST_MEM_LIMIT_MB", "0"), KVCachedConfigError, "at least 1"),
    "env-host-limit-huge": (_init_env("KVCACHED_HOST_MEM_LIMIT_MB", str(2**50)), KVCachedConfigError,
                            "KVCACHED_HOST_MEM_LIMIT_MB=.* must be at most"),
    "env-page-size-huge": (_init_env("KVCACHED_PAGE_SIZE_MB", str(2**40)), KVCachedConfigError,
                           "KVCACHED_PAGE_SIZE_MB=.* must be at most 1024"),
    "env-log-level-unknown": (_init_env("KVCACHED_LOG_LEVEL", "loud"), KVCachedConfigError,
                              "KVCACHED_LOG_LEVEL='LOUD' is not one of"),
    "vllm-tensor-parallel": (lambda mp: vi.init_kvcached(world_size=2, device="cpu"), KVCachedConfigError,
                             "tensor parallel"),
}
if not getattr(torch.version, "hip", None):
    NO_RUNTIME_CASES["hip-backend-without-runtime-or-device"] = (
        _init_env("KVCACHED_BACKEND", "hip"), KVCachedError, "hip|HIP|libamdhip64|device")


@pytest.mark.parametrize("kind", list(NO_RUNTIME_CASES))
def test_bad_input_without_runtime(kind: str, env: pytest.MonkeyPatch) -> None:
    call, exc_type, pattern = NO_RUNTIME_CASES[kind]
    with pytest.raises(exc_type) as info, _recording(kind):
        call(env)
    assert re.search(pattern, str(info.value)), f"unclear message for {kind}: {info.value!r}"
    # nothing half-initialized is left behind: a correct init works now
    for var in ("KVCACHED_BACKEND", "KVCACHED_PAGE_SIZE_MB", "KVCACHED_CONTIGUOUS_LAYOUT",
                "KVCACHED_HOST_MEM_LIMIT_MB", "KVCACHED_LOG_LEVEL"):
        env.delenv(var, raising=False)
    if vmm_ops.is_initialized():
        vmm_ops.shutdown_kvcached()
    vmm_ops.init_kvcached("cpu")
    vmm_ops.create_kv_tensors(4 * MiB, 2, "cpu", LAYERS)
    m = KVCacheManager(512, BS, CELL, LAYERS)
    assert m.alloc(2) is not None


def test_bad_log_level_raises_where_the_logger_is_set_up(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcached.utils import get_kvcached_logger

    name = f"kvcached.test_{uuid.uuid4().hex[:8]}"  # a logger not yet set up, as at first import
    monkeypatch.setenv("KVCACHED_LOG_LEVEL", "loud")
    with pytest.raises(KVCachedConfigError, match="KVCACHED_LOG_LEVEL='LOUD' is not one of DEBUG"):
        get_kvcached_logger(name)
    monkeypatch.setenv("KVCACHED_LOG_LEVEL", "warning")
    assert get_kvcached_logger(name).level == logging.WARNING


# -- kernels: host checks, no runtime needed -----------------------------------
def _attention_args(query_dtype: torch.dtype) -> tuple[list[torch.Tensor], dict[str, int]]:
    cache = torch.zeros(8, 16, 2, 32, dtype=DTYPE)
    block_table = torch.zeros(1, 4, dtype=torch.int32)
    return ([torch.zeros(4, 2, 32, dtype=query_dtype), cache, cache, block_table, torch.tensor([4], dtype=torch.int32),
             torch.tensor([0, 4], dtype=torch.int32)], {"max_query_len": 4, "max_seq_len": 4})


KERNEL_CASES: dict[str, tuple[Callable[[], object], type[BaseException], str]] = {
    "paged-attention-fp32-query": (lambda: kernels.paged_attention(*_attention_args(torch.float32)[0],
                                                                   **_attention_args(torch.float32)[1]),
                                   ValueError, "query dtype torch.float32 is not supported"),
    "mla-decode-2d-query": (lambda: kernels.paged_mla_decode(torch.zeros(2, 576, dtype=DTYPE),
                                                             torch.zeros(8, 16, 576, dtype=DTYPE),
                                                             torch.zeros(1, 4, dtype=torch.int32),
                                                             torch.tensor([4], dtype=torch.int32), scale=1.0),
                            ValueError, r"query must be \[num_seqs, num_heads, head_size\]"),
    "write-kv-float-slots": (lambda: kernels.write_kv_cache(torch.zeros(4, 2, 32, dtype=DTYPE),
                                                            torch.zeros(4, 2, 32, dtype=DTYPE),
                                                            torch.zeros(8, 16, 2, 32, dtype=DTYPE),
                                                            torch.zeros(8, 16, 2, 32, dtype=DTYPE), torch.zeros(4)),
                             ValueError, "slot_mapping must be int32 or int64"),
}


@pytest.mark.parametrize("kind", list(KERNEL_CASES))
def test_bad_kernel_input(kind: str) -> None:
    call, exc_type, pattern = KERNEL_CASES[kind]
    with pytest.raises(exc_type) as info, _recording(kind):
        call()
    assert re.search(pattern, str(info.value)), f"unclear message for {kind}: {info.value!r}"


# -- every public entry point has a bad-input case ------------------------------
# The native classes vmm_ops exports, read from _vmm: vmm_ops.PageAllocator is a Python
# front that also takes the existing kvcached's constructor form (kvcached.compat).
_NATIVE = {name for name in vmm_ops.__all__ if isinstance(getattr(_vmm, name, None), type)
           and not issubclass(getattr(_vmm, name), BaseException)}
_CALLED: dict[str, set[Any]] = {}  # case -> the entry points it called directly


def _takes_arguments(fn: Callable[..., Any]) -> bool:
    return any(name != "self" for name in inspect.signature(fn).parameters)


def _native_methods(cls: type) -> list[str]:
    """Public methods of a native class that take an argument (read from pybind11's signature line)."""
    out = []
    for name, obj in vars(cls).items():
        if name.startswith("_") or isinstance(obj, property) or not callable(obj):
            continue
        m = re.match(r"\w+\((.*)\) ->", (obj.__doc__ or "").strip())
        if m and "," in m.group(1):  # more than self
            out.append(name)
    return out


def public_entry_points() -> dict[Any, str]:
    """Every public call of vmm_ops, KVCacheManager and kvcached.kernels that takes an argument.

    Keys are what the recorder sees: a Python function's code object; for the native classes
    vmm_ops exports, a method's builtin function and (class, "__init__") for the constructor.
    """
    points: dict[Any, str] = {}
    for name in vmm_ops.__all__:
        obj = getattr(vmm_ops, name)
        if inspect.isfunction(obj) and _takes_arguments(obj):
            points[obj.__code__] = f"vmm_ops.{name}"
        elif name in _NATIVE:
            obj = getattr(_vmm, name)
            points[(name, "__init__")] = f"vmm_ops.{name}(...)"
            points.update({vars(obj)[m].__func__: f"vmm_ops.{name}.{m}" for m in _native_methods(obj)})
    for name, obj in vars(KVCacheManager).items():
        if (name == "__init__" or not name.startswith("_")) and inspect.isfunction(obj) and _takes_arguments(obj):
            points[obj.__code__] = f"KVCacheManager.{name}"
    for name in kernels.__all__:
        fn = inspect.unwrap(getattr(kernels, name))
        if _takes_arguments(fn):
            points[fn.__code__] = f"kernels.{name}"
    return points


def _recording_init(self: Any, *args: Any, **kwargs: Any) -> None:
    type(self).__recorded__.__init__(self, *args, **kwargs)


@contextlib.contextmanager
def _recording(kind: str) -> Iterator[None]:
    """Record in _CALLED[kind] each entry point called straight from this file (a case's own calls,
    not what those calls use inside)."""
    called: set[Any] = set()
    here = __file__

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_back is not None and frame.f_back.f_code.co_filename == here:
            if frame.f_code is _recording_init.__code__:
                called.add((type(frame.f_locals["self"]).__recorded__.__name__, "__init__"))
            else:
                called.add(frame.f_code)
        elif event == "c_call" and frame.f_code.co_filename == here:
            called.add(arg)  # a native method is reported as its builtin function

    # A native constructor runs no Python frame: subclasses whose __init__ does stand in while recording.
    with pytest.MonkeyPatch.context() as mp:
        for name in _NATIVE:
            base = getattr(_vmm, name)
            sub = type(name, (base,), {"__init__": _recording_init, "__recorded__": base})
            mp.setattr(vmm_ops, name, sub)
            mp.setattr(_vmm, name, sub)
        old = sys.getprofile()
        sys.setprofile(profile)
        try:
            yield
        finally:
            sys.setprofile(old)
            _CALLED[kind] = _CALLED.get(kind, set()) | called


def _run_unrecorded_cases() -> None:
    """Run (once) every case no test of this session has run yet, recording its calls."""
    for kind, (call, _, _) in LIVE_CASES.items():
        if kind not in _CALLED:
            with _case_env() as mp, contextlib.suppress(Exception):
                c = _make_ctx()
                with _recording(kind):
                    call(c, mp)
    for kind, (call, _, _) in NO_RUNTIME_CASES.items():
        if kind not in _CALLED:
            with _case_env() as mp, contextlib.suppress(Exception), _recording(kind):
                call(mp)
    for kind, (call, _, _) in KERNEL_CASES.items():
        if kind not in _CALLED:
            with contextlib.suppress(Exception), _recording(kind):
                call()


def _uncovered() -> list[str]:
    _run_unrecorded_cases()
    covered = set().union(*_CALLED.values())
    return sorted(label for key, label in public_entry_points().items() if key not in covered)


def test_every_public_entry_point_has_a_bad_input_case() -> None:
    # the introspection finds what it should (else this test would pass by finding nothing)
    labels = set(public_entry_points().values())
    for must in ("vmm_ops.create_kv_tensors", "vmm_ops.BlockPool.alloc", "vmm_ops.PageAllocator(...)",
                 "KVCacheManager.free", "KVCacheManager.__init__", "kernels.paged_attention"):
        assert must in labels, f"{must} not found among {sorted(labels)}"
    assert "KVCacheManager.available_size" not in labels  # takes no argument: no bad input
    missing = _uncovered()
    assert not missing, (f"public entry points no bad-input case calls: {missing}; add a case to LIVE_CASES, "
                         "NO_RUNTIME_CASES or KERNEL_CASES in tests/test_bad_inputs.py")


def test_a_new_public_call_without_a_case_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    def new_api(x: int) -> int:
        return x

    def new_method(self: KVCacheManager, x: int) -> int:
        return x

    def new_kernel(x: torch.Tensor) -> torch.Tensor:
        return x

    monkeypatch.setattr(vmm_ops, "new_api", new_api, raising=False)
    monkeypatch.setattr(vmm_ops, "__all__", [*vmm_ops.__all__, "new_api"])
    monkeypatch.setattr(KVCacheManager, "new_method", new_method, raising=False)
    monkeypatch.setattr(kernels, "new_kernel", new_kernel, raising=False)
    monkeypatch.setattr(kernels, "__all__", [*kernels.__all__, "new_kernel"])
    assert {"vmm_ops.new_api", "KVCacheManager.new_method", "kernels.new_kernel"} <= set(_uncovered())

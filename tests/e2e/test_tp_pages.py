"""Tensor parallelism's parts without an engine: the null backend, the scheduler's page changes, a
worker's mapping (``kvcached.integration.vllm.tp``); the engine test is in test_vllm_e2e.py."""

from __future__ import annotations

import os
import time
from collections import Counter

import pytest

from kvcached import _vmm, vmm_ops
from kvcached.errors import KVCachedConfigError
from kvcached.integration.vllm import interfaces, kv_alloc, tp
from kvcached.kv_cache_manager import KVCacheManager

MiB = 1 << 20


def test_null_backend_keeps_books_without_memory() -> None:
    b = _vmm.Backend("null", 0, 8 * MiB)
    assert (b.kind, b.granularity, b.mem_info()) == ("null", 2 * MiB, (8 * MiB, 8 * MiB))
    with pytest.raises(ValueError, match="'cuda', 'hip', 'host' or 'null'"):
        _vmm.Backend("nul", 0, 8 * MiB)


def test_null_runtime_needs_a_budget_and_holds_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_IPC_NAME", f"kvcached_e2e_null_{os.getpid()}")
    with pytest.raises(KVCachedConfigError, match="null_budget"):
        vmm_ops.init_kvcached("null", contiguous_layout=True)
    monkeypatch.setenv("KVCACHED_GPU_UTILIZATION", "1.0")
    group = 2 * 2 * 2 * MiB  # 2 layers x K and V x one 2 MiB page
    # four pages' worth, less the zero page that backs unmapped space (kept, as on every backend)
    vmm_ops.init_kvcached("null", contiguous_layout=True, null_budget=4 * group)
    try:
        vmm_ops.create_kv_tensors(8 * 2 * 2 * MiB, 2, "null", 2)
        m = KVCacheManager(8 * 512, 16, 256, 2)  # 512 blocks per page
        assert m.page_allocator.num_reserved == 0  # no reserve: it would only take the workers' budget
        assert m.page_allocator.max_run_pages == 1  # page by page, like the workers that hold the memory
        held = m.alloc(3 * 512)
        assert held is not None and m.alloc(1) is None  # the budget is three pages
        assert m.usage().used == 3 * group and m.usage().device == "tp"  # kvctl's DEVICE column
        m.free(held)
        assert m.alloc(512) is not None
    finally:
        vmm_ops.shutdown_kvcached()


def test_page_changes_send_net_changes_only() -> None:
    changes, counts = tp.PageChanges(), Counter({0: 1})
    for page in (1, 2):
        counts[page] += 1
        changes.touch(page)
    assert changes.take(counts) == ([1, 2], []) and not changes.pending()
    counts[2] -= 1
    changes.touch(2)
    counts[2] += 1  # given back and taken again before the step went out: the workers keep it mapped
    changes.touch(2)
    counts[1] -= 1
    changes.touch(1)
    assert changes.take(counts) == ([], [1])
    assert changes.take(counts) == ([], [])


class _Event:
    """Stands in for the CUDA event a worker records before an unmap (tp.record_event)."""

    done = False

    def query(self) -> bool:
        return _Event.done

    def synchronize(self) -> None:
        _Event.done = True


def test_worker_unmaps_after_queued_work_and_keeps_pages_handed_out_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_IPC_NAME", f"kvcached_e2e_tpw_{os.getpid()}")
    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "0")
    monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", "0")
    interfaces.init_kvcached(device="cpu", contiguous_layout=True)
    try:
        kv_alloc._place(64 * 32, 16, 4096, 2, 1, "cpu")  # 64 KiB pages: 32 blocks per 2 MiB page
        pages = tp.WorkerPages(kv_alloc.pool_info())
        assert pages.state() == {"in_use": 1, "peak": 1, "pending": 0}  # the null block's page
        pages.apply([1, 2, 3], [])
        assert pages.state()["in_use"] == 4
        # on a GPU an unmap waits for the rank's queued work (an event); a page handed out again is kept
        pages.asynchronous = True
        monkeypatch.setattr(tp, "record_event", lambda device: _Event())
        _Event.done = False
        pages.apply([], [2, 3])
        assert pages.state() == {"in_use": 4, "peak": 4, "pending": 2}
        pages.apply([3], [])
        assert pages.state() == {"in_use": 4, "peak": 4, "pending": 1}
        _Event.done = True
        pages.apply([], [])
        assert pages.state() == {"in_use": 3, "peak": 4, "pending": 0}
        assert not pages.alloc.is_in_use(2) and pages.alloc.is_in_use(3)
        _Event.done = False
        pages.apply([], [1], wait=True)  # an idle engine's flush waits for the event instead
        assert pages.state() == {"in_use": 2, "peak": 4, "pending": 0}
        # pages 1..3 came in one batch, yet each freed page leaves (the prealloc thread unmaps it):
        # page by page, as the scheduler counts
        assert pages.alloc.max_run_pages == 1
        end = time.monotonic() + 5
        while pages.alloc.mapped_bytes > 2 * pages.alloc.page_bytes and time.monotonic() < end:
            time.sleep(0.01)
        assert pages.alloc.runs() == [(0, 1, 1), (3, 1, 1)]
    finally:
        tp.reset_worker()
        interfaces.shutdown_kvcached()
        kv_alloc.reset()


def test_scheduler_takes_the_workers_page_size_and_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its environment may say otherwise: a block must sit in the same page number here and on the ranks."""
    monkeypatch.setenv("KVCACHED_IPC_NAME", f"kvcached_e2e_tps_{os.getpid()}")
    monkeypatch.setenv("KVCACHED_PAGE_SIZE_MB", "8")
    monkeypatch.setenv("KVCACHED_CONTIGUOUS_LAYOUT", "true")
    info = kv_alloc.PoolInfo(1024, 16, 4096, 2, 0, 1, world_size=2, rank_bytes=1 << 30, layout="per_layer",
                             page_size=2 * MiB)
    try:
        m = tp.scheduler_manager(info, 1024)
        rt = vmm_ops.runtime()
        assert (rt.page_size, rt.layout.value, rt.choice.kind) == (2 * MiB, "per_layer", "null")
        assert m.blocks_per_page == 2 * MiB // (16 * 4096)
        m.close()
    finally:
        interfaces.shutdown_kvcached()

"""The existing kvcached's public names over our core (kvcached/compat.py), on the host backend.

Covers every call the existing kvcached's tests/test_kvcache_manager.py and
tests/test_paged_allocator_aliasing.py make on the manager and its page allocator,
and the existing kvcached's ``vmm_ops.PageAllocator(num_layers, mem_size_per_layer, ...)``.
"""

from __future__ import annotations

import os
import threading
import time
import uuid

import pytest
import torch

from kvcached import _vmm, vmm_ops
from kvcached.compat import Page, PageAllocatorView
from kvcached.errors import KVCachedConfigError, KVCachedStateError
from kvcached.integration.vllm import interfaces as vllm_if
from kvcached.kv_cache_manager import KVCacheManager

MiB = 1 << 20
LAYERS, BS, CELL = 4, 16, 1024  # block = 16 KiB: 128 blocks per 2 MiB page
BPP = (2 * MiB) // (BS * CELL)
PAGES = 16


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("KVCACHED_IPC_NAME", f"kvcached_test_{os.getpid()}_{uuid.uuid4().hex[:8]}")
    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "2")
    monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", "4")
    yield monkeypatch
    if vmm_ops.is_initialized():
        vmm_ops.shutdown_kvcached()


def _runtime(contiguous: bool = True) -> None:
    vmm_ops.init_kvcached("cpu", contiguous_layout=contiguous)
    vmm_ops.create_kv_tensors(PAGES * 2 * vmm_ops.runtime().page_size, 2, "cpu", LAYERS)


@pytest.fixture
def manager(env, eventually):
    _runtime()
    m = KVCacheManager(PAGES * BPP, BS, CELL, LAYERS, world_size=1)
    assert eventually(lambda: m.page_allocator.get_num_reserved_pages() > 0, timeout=5.0)
    return m


# -- KVCacheManager ------------------------------------------------------------
def test_manager_attributes(manager: KVCacheManager) -> None:
    rt = vmm_ops.runtime()
    assert manager.page_size == rt.page_size == 2 * MiB
    assert manager.mem_size == PAGES * BPP * BS * CELL  # bytes of one layer's K (or V)
    assert isinstance(manager._post_init_done, threading.Event) and manager._post_init_done.is_set()
    manager._wait_post_init()  # returns at once once bound


def test_post_init_event_set_on_first_call(env) -> None:
    vmm_ops.init_kvcached("cpu", contiguous_layout=True)
    m = KVCacheManager(PAGES * BPP, BS, CELL, LAYERS)  # before the KV tensors exist
    assert not m._post_init_done.is_set()
    vmm_ops.create_kv_tensors(PAGES * 2 * vmm_ops.runtime().page_size, 2, "cpu", LAYERS)
    m._wait_post_init()
    assert m._post_init_done.is_set()


def test_post_init_times_out_without_tensors(env) -> None:
    vmm_ops.init_kvcached("cpu", contiguous_layout=True)
    m = KVCacheManager(PAGES * BPP, BS, CELL, LAYERS)
    env.setattr("kvcached.kv_cache_manager.KV_TENSOR_WAIT_TIMEOUT", 0.05)
    with pytest.raises(KVCachedStateError, match="not created"):
        m._wait_post_init()
    assert not m._post_init_done.is_set()


def test_basic_alloc_free_with_prealloc_stopped(manager: KVCacheManager) -> None:
    manager._wait_post_init()
    manager.page_allocator.stop_prealloc_thread()
    assert not manager.page_allocator.prealloc_running
    before = manager.available_size()
    got = manager.alloc(2 * BPP)
    assert got is not None and len(got) == 2 * BPP
    assert manager.available_size() + 2 * BPP == before
    manager.free(got)
    assert manager.available_size() == before


def test_over_allocation_fails(manager: KVCacheManager) -> None:
    assert manager.alloc(manager.available_size() + 1) is None


def test_trim_empties_the_reserve(manager: KVCacheManager) -> None:
    pa = manager.page_allocator
    assert pa.get_num_reserved_pages() > 0
    manager.trim()
    assert pa.get_num_reserved_pages() == 0
    time.sleep(0.3)
    assert pa.get_num_reserved_pages() == 0  # the thread does not refill until pages are taken
    pa.trim()  # the allocator's own trim does the same
    assert pa.get_num_reserved_pages() == 0


def test_reserve_and_free_reserved_blocks(manager: KVCacheManager) -> None:
    assert manager.reserved_blocks == []
    base = manager._get_num_alloced_blocks()
    assert manager.try_to_reserve(512)
    held = manager.reserved_blocks
    assert len(held) == 512 and manager._get_num_alloced_blocks() == base + 512
    held.clear()  # a copy: the manager's own list is untouched
    assert len(manager.reserved_blocks) == 512
    got = manager.alloc(10)  # handed out from the reserved blocks first
    assert len(manager.reserved_blocks) == 502 and manager._get_num_alloced_blocks() == base + 512
    manager.free(got)
    manager.free_reserved()
    assert manager.reserved_blocks == [] and manager._get_num_alloced_blocks() == base


def test_alloced_blocks_count_the_null_block(env) -> None:
    _runtime()
    m = KVCacheManager(PAGES * BPP, BS, CELL, LAYERS, reserve_null_block=True)
    assert m._get_num_alloced_blocks() == 1


# -- page_allocator: the existing kvcached's queries ----------------------------
def test_page_counts(manager: KVCacheManager) -> None:
    pa = manager.page_allocator
    assert isinstance(pa, PageAllocatorView) and pa is manager.page_allocator
    assert pa.get_num_total_pages() == PAGES
    assert pa.get_num_inuse_pages() == 0 and pa.get_num_free_pages() == PAGES
    reserved = pa.get_num_reserved_pages()
    assert 2 <= reserved <= 4
    got = manager.alloc(BPP + 1)  # two pages
    assert pa.get_num_inuse_pages() == 2
    assert pa.get_num_free_pages() == PAGES - 2  # the reserve counts as free
    assert pa.get_page_state() == {"total_pages": PAGES, "free_pages": PAGES - 2, "inuse_pages": 2,
                                   "reserved_pages": pa.get_num_reserved_pages()}
    assert pa.get_page_id(got[-1], BS * CELL) == got[-1] // BPP
    assert 0 <= pa.get_avail_physical_pages() <= PAGES - 2
    manager.free(got)
    assert pa.get_num_inuse_pages() == 0


def test_view_forwards_native_attributes(manager: KVCacheManager) -> None:
    pa = manager.page_allocator
    native = pa.native
    assert isinstance(native, _vmm.PageAllocator)
    assert pa.num_in_use == native.num_in_use and pa.limit_pages == native.limit_pages == PAGES
    assert pa.num_reserved == native.num_reserved and pa.mapped_bytes == native.mapped_bytes
    assert pa.set_limit_pages(PAGES) is True
    with pytest.raises(AttributeError):
        pa.no_such_attribute  # noqa: B018


def test_prealloc_thread_stop_and_restart(manager: KVCacheManager, eventually) -> None:
    pa = manager.page_allocator
    pa.stop_prealloc_thread()
    pa.stop_prealloc_thread()  # twice is fine
    pa.trim()
    got = manager.alloc(1)
    time.sleep(0.3)
    assert pa.get_num_reserved_pages() == 0  # nothing refills
    pa.start_prealloc_thread()
    pa.start_prealloc_thread()  # a no-op while it runs
    assert pa.prealloc_running
    assert eventually(lambda: pa.get_num_reserved_pages() >= 2, timeout=5.0)
    manager.free(got)


def test_start_prealloc_thread_is_a_no_op_when_disabled(env) -> None:
    env.setenv("KVCACHED_PAGE_PREALLOC_ENABLED", "false")
    _runtime()
    m = KVCacheManager(PAGES * BPP, BS, CELL, LAYERS)
    m.page_allocator.start_prealloc_thread()
    assert not m.page_allocator.prealloc_running


def test_prealloc_start_stop_race(manager: KVCacheManager) -> None:
    pa = manager.page_allocator
    errors: list[BaseException] = []

    def churn(start: bool) -> None:
        try:
            for _ in range(200):
                pa.start_prealloc_thread() if start else pa.stop_prealloc_thread()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=churn, args=(i % 2 == 0,)) for i in range(4)]
    for t in threads:
        t.start()
    for _ in range(50):
        got = manager.alloc(BPP)
        manager.free(got)
    for t in threads:
        t.join()
    assert errors == []
    manager.close()
    assert vmm_ops.get_group(0).allocator is None


def test_resize_in_bytes_per_layer(manager: KVCacheManager) -> None:
    pa = manager.page_allocator
    page = manager.page_size
    got = manager.alloc(3 * BPP)  # 3 pages in use
    assert pa.resize(2 * page) is False  # below what is in use: nothing changes
    assert pa.get_num_total_pages() == PAGES
    assert pa.resize(8 * page + 1) is True  # whole pages, rounded down
    assert pa.get_num_total_pages() == 8 and pa.get_num_free_pages() == 5
    assert manager.available_size() <= 5 * BPP
    assert pa.resize(PAGES * page) is True
    assert pa.get_num_total_pages() == PAGES
    assert pa.resize(4 * PAGES * page) is True  # never above the manager's own pages
    assert pa.get_num_total_pages() == PAGES
    with pytest.raises(ValueError, match="positive int"):
        pa.resize(0)
    manager.free(got)


def test_page_allocator_after_close(manager: KVCacheManager) -> None:
    manager.close()
    with pytest.raises(KVCachedStateError, match="closed"):
        manager.page_allocator  # noqa: B018


# -- vmm_ops.PageAllocator in the existing kvcached's form ------------------------
def _standalone(**kw):
    args = dict(num_layers=LAYERS, mem_size_per_layer=8 * 2 * MiB, page_size=2 * MiB, world_size=1, pp_rank=0,
                async_sched=False, contiguous_layout=True, enable_page_prealloc=False, num_kv_buffers=2,
                group_id=0, ipc_name="")
    args.update(kw)
    return vmm_ops.PageAllocator(**args)


def test_both_constructor_forms(env) -> None:
    _runtime()
    group = vmm_ops.get_group(0)
    native = vmm_ops.PageAllocator(vmm_ops.runtime().backend, group.vtensors, group.regions, 2)
    assert type(native) is _vmm.PageAllocator and isinstance(native, vmm_ops.PageAllocator)
    native.close()
    pa = _standalone()
    assert isinstance(pa, vmm_ops.StandalonePageAllocator) and isinstance(pa, vmm_ops.PageAllocator)
    pa.close()
    positional = vmm_ops.PageAllocator(LAYERS, 8 * 2 * MiB, 2 * MiB, 1, 0, False, True, False, 2, 0, "")
    assert positional.get_num_total_pages() == 8
    positional.close()


def test_standalone_pages_are_mapped(env) -> None:
    _runtime()
    raw = vmm_ops.get_group(0).tensors[0]
    pa = _standalone()
    assert (pa.get_num_total_pages(), pa.get_num_free_pages(), pa.get_num_inuse_pages()) == (8, 8, 0)
    page = pa.alloc_page()
    assert isinstance(page, Page) and page.page_size == 2 * MiB
    assert pa.get_num_inuse_pages() == 1 and pa.get_num_free_pages() == 7
    assert pa.native.is_in_use(page.page_id)
    page.init(BS * CELL)
    assert (page.start_block, page.end_block) == (page.page_id * BPP, (page.page_id + 1) * BPP)
    blocks = page.alloc(3)
    assert blocks == [page.page_id * BPP + i for i in range(3)] and page.num_free_blocks() == BPP - 3
    page.free_batch(blocks[1:])
    page.free(blocks[0])
    assert page.empty() and not page.full()
    with pytest.raises(ValueError, match="already free"):
        page.free(blocks[0])
    # the page is real memory: a write to it stays (unmapped pages alias the zero page)
    off = page.page_id * 2 * MiB
    raw[off:off + 4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert raw[off:off + 4].tolist() == [1, 2, 3, 4]
    others = [pa.alloc_page() for _ in range(7)]
    with pytest.raises(ValueError, match="No free pages"):
        pa.alloc_page()
    pa.free_page(page.page_id)
    pa.free_pages([p.page_id for p in others])
    assert pa.get_num_inuse_pages() == 0 and pa.get_num_free_pages() == 8
    assert pa.get_num_reserved_pages() <= 4
    with pytest.raises(ValueError, match="not in use"):
        pa.free_page(page.page_id)
    pa.trim()
    assert pa.get_num_reserved_pages() == 0


def test_standalone_resize_and_prealloc(env, eventually) -> None:
    _runtime()
    pa = _standalone(enable_page_prealloc=True)
    pages = [pa.alloc_page() for _ in range(3)]
    assert pa.resize(2 * 2 * MiB) is False and pa.get_num_total_pages() == 8
    assert pa.resize(4 * 2 * MiB) is True and pa.get_num_total_pages() == 4 and pa.get_num_free_pages() == 1
    assert pa.resize(PAGES * 2 * MiB) is True and pa.get_num_total_pages() == PAGES  # up to the KV tensors
    assert pa.resize((PAGES + 1) * 2 * MiB) is False
    pa.start_prealloc_thread()
    assert eventually(lambda: pa.get_num_reserved_pages() >= 2, timeout=5.0)
    pa.stop_prealloc_thread()
    pa.free_pages([p.page_id for p in pages])
    pa.close()
    assert vmm_ops.get_group(0).allocator is None
    KVCacheManager(PAGES * BPP, BS, CELL, LAYERS).alloc(1)  # the group is free for a manager again


def test_standalone_group_is_exclusive(env) -> None:
    _runtime()
    m = KVCacheManager(PAGES * BPP, BS, CELL, LAYERS)
    m.alloc(1)
    with pytest.raises(KVCachedStateError, match="live KVCacheManager"):
        _standalone()


@pytest.mark.parametrize("kw, match", [
    ({"world_size": 2}, "world_size"),
    ({"page_size": 4 * MiB}, "page size"),
    ({"contiguous_layout": False}, "contiguous_layout"),
    ({"num_layers": LAYERS + 1}, "does not match"),
    ({"num_kv_buffers": 1}, "does not match"),
    ({"mem_size_per_layer": MiB}, "less than one"),
    ({"mem_size_per_layer": (PAGES + 1) * 2 * MiB}, "hold"),
    ({"mem_size_per_layer": 0}, "positive int"),
    ({"num_layers": True}, "positive int"),
    ({"pp_rank": -1}, "pp_rank"),
    ({"ipc_name": 3}, "ipc_name"),
])
def test_standalone_bad_inputs(env, kw, match) -> None:
    _runtime()
    with pytest.raises(KVCachedConfigError, match=match):
        _standalone(**kw)


def test_standalone_needs_tensors(env) -> None:
    vmm_ops.init_kvcached("cpu", contiguous_layout=True)
    with pytest.raises(KVCachedStateError, match="no KV tensors"):
        _standalone()


def test_page_bad_inputs() -> None:
    p = Page(3, 2 * MiB)
    with pytest.raises(KVCachedStateError, match="not initialised"):
        p.alloc(1)
    with pytest.raises(ValueError, match="does not fit"):
        p.init(4 * MiB)
    p.init(MiB)
    assert Page.get_num_blocks(2 * MiB, MiB) == 2 and Page.get_block_range(3, 2 * MiB, MiB) == (6, 8)
    with pytest.raises(ValueError, match="does not hold"):
        p.free(0)
    assert p.alloc(5) == [6, 7] and p.full()
    with pytest.raises(ValueError, match="already full"):
        p.alloc(1)


# -- the vLLM-interface flow of the existing kvcached's manager test -----------------
def test_vllm_interface_flow(env, eventually) -> None:
    env.setenv("KVCACHED_CONTIGUOUS_LAYOUT", "true")
    vllm_if.init_kvcached(tp_rank=0, world_size=1, is_worker=True, async_sched=False, device="cpu")
    try:
        vllm_if.alloc_kv_cache(kvcache_shape=(2, 4096, BS, 8, 64), block_size=BS, dtype=torch.float16,
                               device="cpu", num_layers=LAYERS)
        assert vmm_ops.kv_tensors_created()
        m = KVCacheManager(num_blocks=4096, block_size=BS, cell_size=1024, num_layers=LAYERS, world_size=1)
        assert eventually(lambda: m.page_allocator.get_num_reserved_pages() > 0, timeout=5.0)
        m._wait_post_init()
        m.page_allocator.stop_prealloc_thread()
        before = m.available_size()
        got = m.alloc(256)
        assert len(got) == 256 and m.available_size() + 256 == before
        m.free(got)
        assert m.available_size() == before
        m.trim()
        assert m.page_allocator.get_num_reserved_pages() == 0
    finally:
        vllm_if.shutdown_kvcached()

"""Deferred freeing: blocks freed while device work may read them return only after that work.

The device's events are replaced by ones the test completes by hand, so the logic runs
on the host backend; tests/gpu/test_async_unmap_gpu.py shows the hazard on a real GPU.
"""

from __future__ import annotations

import threading
import time

import pytest

from kvcached import deferred_free, vmm_ops
from kvcached.kv_cache_manager import KVCacheManager


class FakeEvent:
    """Completes when the test says so; ``synchronize`` blocks until then, as a device event does."""

    def __init__(self) -> None:
        self.flag = threading.Event()
        self.waited = False

    @property
    def done(self) -> bool:
        return self.flag.is_set()

    @done.setter
    def done(self, value: bool) -> None:
        if value:
            self.flag.set()

    def query(self) -> bool:
        return self.flag.is_set()

    def synchronize(self) -> None:
        self.waited = True
        self.flag.wait()


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[FakeEvent]:
    made: list[FakeEvent] = []

    def record(device: object) -> FakeEvent:
        made.append(FakeEvent())
        return made[-1]

    monkeypatch.setattr(deferred_free, "record_event", record)
    return made


@pytest.fixture
def manager(monkeypatch: pytest.MonkeyPatch, events: list[FakeEvent]):
    monkeypatch.setenv("KVCACHED_PAGE_PREALLOC_ENABLED", "false")
    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "0")
    monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", "0")
    monkeypatch.setenv("KVCACHED_HOST_MEM_LIMIT_MB", "64")
    vmm_ops.init_kvcached("cpu", contiguous_layout=True)
    # one layer, K and V, blocks of 16 tokens x 4 KiB: 32 blocks per 2 MiB page
    vmm_ops.create_kv_tensors(4 * (2 << 20), 1, "cpu", num_layers=1)
    mgr = KVCacheManager(num_blocks=64, block_size=16, cell_size=4096, num_layers=1, deferred_free=True)
    yield mgr
    for e in events:  # the "device" finishes everything, so close() does not wait forever
        e.done = True
    mgr.close()
    vmm_ops.shutdown_kvcached()


def _until(cond, timeout: float = 2.0) -> bool:
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.005)
    return cond()


def test_freed_blocks_wait_for_their_event(manager: KVCacheManager, events: list[FakeEvent]) -> None:
    blocks = manager.alloc(32)  # one whole page
    assert manager.get_mapped_memory_size() == 2 * (2 << 20)
    manager.free(blocks)
    assert manager.pending_free_blocks == 32
    assert manager.num_allocated_blocks() == 32
    # the device may still read them: the page stays mapped, however often the pool is asked
    assert manager.available_size() == 32
    time.sleep(0.05)
    assert manager.get_mapped_memory_size() == 2 * (2 << 20)
    events[0].done = True
    assert manager.available_size() == 64
    assert manager.pending_free_blocks == 0
    assert manager.get_mapped_memory_size() == 0


def test_an_idle_pool_gives_memory_back_once_the_device_is_done(manager: KVCacheManager,
                                                                 events: list[FakeEvent]) -> None:
    manager.free(manager.alloc(32))
    events[0].done = True  # no further pool call: the waiter thread releases them
    assert _until(lambda: manager.pending_free_blocks == 0)
    assert _until(lambda: manager.get_mapped_memory_size() == 0)


def test_batches_release_in_order_and_alloc_drains(manager: KVCacheManager, events: list[FakeEvent]) -> None:
    a, b = manager.alloc(8), manager.alloc(8)
    manager.free(a)
    manager.free(b)
    events[1].done = True  # a later event alone: the queue keeps launch order
    assert manager.pending_free_blocks == 16
    events[0].done = True
    got = manager.alloc(60)
    assert got is not None and manager.pending_free_blocks == 0


def test_double_free_of_a_pending_block_is_refused(manager: KVCacheManager, events: list[FakeEvent]) -> None:
    blocks = manager.alloc(4)
    manager.free(blocks[:2])
    with pytest.raises(ValueError, match="double free"):
        manager.free(blocks[1:3])
    with pytest.raises(ValueError, match="appears twice"):
        manager.free([blocks[2], blocks[2]])
    assert manager.pending_free_blocks == 2  # the refused calls freed nothing


def test_close_waits_for_the_device(manager: KVCacheManager, events: list[FakeEvent]) -> None:
    manager.free(manager.alloc(4))
    threading.Timer(0.2, events[0].flag.set).start()
    t0 = time.monotonic()
    manager.close()
    assert events[0].waited and time.monotonic() - t0 >= 0.15


def test_host_backend_frees_at_once_by_default(monkeypatch: pytest.MonkeyPatch, events: list[FakeEvent]) -> None:
    monkeypatch.setenv("KVCACHED_HOST_MEM_LIMIT_MB", "64")
    vmm_ops.init_kvcached("cpu", contiguous_layout=True)
    try:
        vmm_ops.create_kv_tensors(4 * (2 << 20), 1, "cpu", num_layers=1)
        mgr = KVCacheManager(num_blocks=64, block_size=16, cell_size=4096, num_layers=1)
        mgr.free(mgr.alloc(4))
        assert mgr.pending_free_blocks == 0 and not events
        mgr.close()
    finally:
        vmm_ops.shutdown_kvcached()

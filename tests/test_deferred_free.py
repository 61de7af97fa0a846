"""Deferred freeing: blocks freed while device work may read them return only after that work.

The device's events are replaced by ones the test completes by hand, so the logic runs
on the host backend; tests/gpu/test_async_unmap_gpu.py shows the hazard on a real GPU.
"""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
    a, b = manager.alloc(32), manager.alloc(32)  # a page each: each free empties one, so both wait
    manager.free(a)
    manager.free(b)
    events[1].done = True  # a later event alone: the queue keeps launch order
    assert manager.pending_free_blocks == 64
    events[0].done = True
    got = manager.alloc(60)
    assert got is not None and manager.pending_free_blocks == 0


def test_double_free_of_a_pending_block_is_refused(manager: KVCacheManager, events: list[FakeEvent]) -> None:
    blocks = manager.alloc(34)  # page 0 full, blocks 32 and 33 on page 1
    manager.free(blocks[32:])  # empties page 1: pending
    assert manager.pending_free_blocks == 2
    with pytest.raises(ValueError, match="double free"):
        manager.free([blocks[31], blocks[33]])
    with pytest.raises(ValueError, match="appears twice"):
        manager.free([blocks[31], blocks[31]])
    assert manager.pending_free_blocks == 2  # the refused calls freed nothing
    assert manager.num_allocated_blocks() == 34 and len(events) == 1


def test_close_waits_for_the_device(manager: KVCacheManager, events: list[FakeEvent]) -> None:
    manager.free(manager.alloc(4))
    threading.Timer(0.2, events[0].flag.set).start()
    t0 = time.monotonic()
    manager.close()
    assert events[0].waited and time.monotonic() - t0 >= 0.15


def test_clear_frees_once_the_device_is_done(manager: KVCacheManager, events: list[FakeEvent]) -> None:
    # an engine's reset (SGLang's flush_cache) with its last batch maybe still queued: no page is unmapped
    # under it, and the pool is empty when clear() returns
    manager.alloc(40)  # page 0 full, 8 blocks on page 1
    assert manager.try_to_reserve(2)
    threading.Timer(0.2, lambda: [e.flag.set() for e in events]).start()
    t0 = time.monotonic()
    manager.clear()
    assert len(events) == 1 and events[0].waited and time.monotonic() - t0 >= 0.15
    assert manager.num_allocated_blocks() == 0 and manager.pending_free_blocks == 0
    assert manager.num_reserved_blocks == 0 and manager.get_mapped_memory_size() == 0


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


def test_deferred_free_asked_for_on_the_host_backend_frees(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host work is synchronous, so a deferred free there has nothing to wait for (it raised a torch
    error for a CUDA event and left the blocks allocated for good)."""
    monkeypatch.setenv("KVCACHED_HOST_MEM_LIMIT_MB", "64")
    monkeypatch.setenv("KVCACHED_PAGE_PREALLOC_ENABLED", "false")
    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "0")
    monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", "0")
    vmm_ops.init_kvcached("cpu", contiguous_layout=True)
    try:
        vmm_ops.create_kv_tensors(4 * (2 << 20), 1, "cpu", num_layers=1)
        mgr = KVCacheManager(num_blocks=64, block_size=16, cell_size=4096, num_layers=1, deferred_free=True)
        mgr.free(mgr.alloc(40))  # two pages: both empty now
        assert mgr.pending_free_blocks == 0 and mgr.num_allocated_blocks() == 0
        assert mgr.page_allocator.num_in_use == 0
        mgr.close()
    finally:
        vmm_ops.shutdown_kvcached()


# -- only a free that could unmap a page waits ----------------------------------------
def test_a_free_that_leaves_its_page_in_use_is_immediate(manager: KVCacheManager, events: list[FakeEvent]) -> None:
    a, b = manager.alloc(1), manager.alloc(1)  # both on page 0
    manager.free(b)  # a keeps the page mapped: nothing to wait for
    assert not events and manager.pending_free_blocks == 0
    assert manager.num_allocated_blocks() == 1 and manager.available_size() == 63
    assert manager.alloc(1) == b  # back at once, reused first
    manager.free(b)
    manager.free(a)  # empties page 0: waits for the device
    assert len(events) == 1 and manager.pending_free_blocks == 1
    time.sleep(0.05)
    assert manager.get_mapped_memory_size() == 2 * (2 << 20)  # not unmapped before its event
    events[0].done = True
    assert _until(lambda: manager.pending_free_blocks == 0)
    assert manager.get_mapped_memory_size() == 0


def test_one_call_defers_only_the_blocks_that_empty_a_page(manager: KVCacheManager,
                                                          events: list[FakeEvent]) -> None:
    blocks = manager.alloc(34)  # page 0 full, blocks 32 and 33 on page 1
    manager.free([blocks[33], blocks[5], blocks[32], blocks[6]])
    assert len(events) == 1 and manager.pending_free_blocks == 2  # page 1's two blocks
    assert manager.num_allocated_blocks() == 32
    assert manager.get_mapped_memory_size() == 2 * 2 * (2 << 20)  # page 1 waits for the device
    events[0].done = True
    assert manager.available_size() == 34 and manager.pending_free_blocks == 0
    assert manager.get_mapped_memory_size() == 2 * (2 << 20)


def test_a_pending_block_does_not_keep_its_page_for_later_frees(manager: KVCacheManager,
                                                                 events: list[FakeEvent]) -> None:
    # x's event covers only the work before x's free; y, on the same page, is read by work
    # launched after it. Were y freed at once because x still holds the page, x's release
    # would unmap the page under that work.
    x = manager.alloc(1)
    manager.free(x)
    y = manager.alloc(1)
    assert y[0] // 32 == x[0] // 32  # the page stays held, so y lands on it
    manager.free(y)
    assert len(events) == 2 and manager.pending_free_blocks == 2
    events[0].done = True
    assert _until(lambda: manager.pending_free_blocks == 1)
    time.sleep(0.05)
    assert manager.get_mapped_memory_size() == 2 * (2 << 20)  # y's readers may still run
    events[1].done = True
    assert _until(lambda: manager.get_mapped_memory_size() == 0)


def test_a_held_block_given_back_waits_for_the_work_on_its_page(manager: KVCacheManager,
                                                                events: list[FakeEvent]) -> None:
    # A block held by try_to_reserve keeps its page, so a running request's block freed beside it returns at
    # once while the device may still read it (a batch in flight). Giving the held block back then empties
    # the page: that release, not only a free(), must wait for the work launched so far.
    a = manager.alloc(31)
    assert manager.try_to_reserve(1)  # the page's last block: held for an admission
    manager.free(a)
    assert not events and manager.pending_free_blocks == 0  # the held block keeps the page
    manager.free_reserved()  # the admission did not happen
    assert len(events) == 1 and manager.pending_free_blocks == 1
    time.sleep(0.05)
    assert manager.get_mapped_memory_size() == 2 * (2 << 20)  # not unmapped under a's readers
    events[0].done = True
    assert _until(lambda: manager.get_mapped_memory_size() == 0)
    assert manager.pending_free_blocks == 0 and manager.num_allocated_blocks() == 0


def test_a_held_block_whose_release_cannot_wait_stays_held(manager: KVCacheManager, events: list[FakeEvent],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    a = manager.alloc(30)
    assert manager.try_to_reserve(2)
    assert {b // 32 for b in manager.reserved_blocks} == {0}  # beside a, on page 0
    manager.free(a)
    assert manager.num_allocated_blocks() == 2  # the held blocks kept the page: a went back at once

    def broken(device: object) -> FakeEvent:
        raise RuntimeError("device lost")

    monkeypatch.setattr(deferred_free, "record_event", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        manager.free_reserved()  # the held blocks empty page 0: they cannot go back without an event
    assert manager.num_reserved_blocks == 2 and manager.num_allocated_blocks() == 2
    assert manager.get_mapped_memory_size() == 2 * (2 << 20)
    monkeypatch.undo()
    monkeypatch.setattr(deferred_free, "record_event", lambda device: events.append(FakeEvent()) or events[-1])
    manager.free_reserved()  # given back once the device works
    assert manager.num_reserved_blocks == 0 and manager.pending_free_blocks == 2


def test_a_failed_event_leaves_the_waiting_blocks_allocated(manager: KVCacheManager, events: list[FakeEvent],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = manager.alloc(34)

    def broken(device: object) -> FakeEvent:
        raise RuntimeError("device lost")

    monkeypatch.setattr(deferred_free, "record_event", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        manager.free(blocks[30:])  # 30 and 31 keep nothing back: page 0 stays in use; 32 and 33 empty page 1
    assert manager.pending_free_blocks == 0
    assert manager.num_allocated_blocks() == 32
    assert all(manager._pool.is_allocated(b) for b in blocks[32:])
    assert not any(manager._pool.is_allocated(b) for b in blocks[30:32])
    monkeypatch.undo()
    monkeypatch.setattr(deferred_free, "record_event", lambda device: events.append(FakeEvent()) or events[-1])
    manager.free(blocks[32:])  # freeable again once the device works
    assert len(events) == 1 and manager.pending_free_blocks == 2


def test_a_stopped_waiter_says_why_and_the_pool_still_drains(manager: KVCacheManager, monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    made: list[FakeEvent] = []

    class Unwaitable(FakeEvent):
        def synchronize(self) -> None:
            raise RuntimeError("device lost while waiting")

    monkeypatch.setattr(deferred_free, "record_event", lambda device: made.append(Unwaitable()) or made[-1])
    manager.free(manager.alloc(32))
    assert _until(lambda: manager._deferred.error is not None)
    assert "device lost while waiting" in repr(manager._deferred.error)
    assert _until(lambda: "deferred-free thread stopped" in caplog.text)  # said, not swallowed
    assert manager.pending_free_blocks == 32  # nothing released under work that may still run
    made[0].done = True
    assert manager.available_size() == 64  # the pool's own calls release what has completed
    assert manager.get_mapped_memory_size() == 0


@pytest.mark.parametrize("bad, match", [
    ([10**9], "out of range"), ([-1], "out of range"), (["a"], "double free"), ([True], "double free"),
    ([40], "double free"), (5, "list of ints"),
])
def test_bad_ids_free_nothing_with_deferral(manager: KVCacheManager, events: list[FakeEvent], bad: object,
                                            match: str) -> None:
    blocks = manager.alloc(34)
    ids = [blocks[0], blocks[33], *bad] if isinstance(bad, list) else bad
    with pytest.raises(ValueError, match=match):
        manager.free(ids)
    assert manager.num_allocated_blocks() == 34 and manager.pending_free_blocks == 0 and not events


class StampedEvent(FakeEvent):
    """A fake event that knows how many frees the engine had issued when it was recorded."""

    def __init__(self, stamp: int) -> None:
        super().__init__()
        self.stamp = stamp


_OPS = st.one_of(st.tuples(st.just("alloc"), st.integers(1, 3)),
                 st.tuples(st.just("free"), st.lists(st.integers(0, 10**6), min_size=1, max_size=4)),
                 st.tuples(st.just("device"), st.integers(0, 3)))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_OPS, max_size=50))
def test_no_page_is_unmapped_before_the_work_on_its_blocks(ops: list[tuple[str, object]]) -> None:
    """The safety rule, whichever frees are immediate: a page goes back only once the device has
    run the work launched before the last free of each of its blocks (stamps: frees issued)."""
    made: list[StampedEvent] = []
    clock = 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(deferred_free, "record_event", lambda device: made.append(StampedEvent(clock)) or made[-1])
        for name, value in (("KVCACHED_PAGE_PREALLOC_ENABLED", "false"), ("KVCACHED_MIN_RESERVED_PAGES", "0"),
                            ("KVCACHED_MAX_RESERVED_PAGES", "0"), ("KVCACHED_HOST_MEM_LIMIT_MB", "64")):
            mp.setenv(name, value)
        vmm_ops.init_kvcached("cpu", contiguous_layout=True)
        try:
            vmm_ops.create_kv_tensors(4 * (2 << 20), 1, "cpu", num_layers=1)
            # blocks of 16 tokens x 32 KiB: 4 per page, so pages empty and fill often
            m = KVCacheManager(num_blocks=8, block_size=16, cell_size=32768, num_layers=1, deferred_free=True)
            pa, bpp = m.page_allocator, m.blocks_per_page
            live: list[int] = []
            last_free: dict[int, int] = {}
            done = 0  # the device ran everything launched before this many frees

            def check() -> None:
                for block, stamp in last_free.items():
                    assert pa.is_in_use(block // bpp) or stamp <= done, f"page of block {block} unmapped too early"

            for op, arg in ops:
                if op == "alloc":
                    got = m.alloc(arg)
                    live += got or []
                elif op == "free" and live:
                    ids = list(dict.fromkeys(live[k % len(live)] for k in arg))
                    clock += 1
                    m.free(ids)
                    live = [b for b in live if b not in ids]
                    last_free.update(dict.fromkeys(ids, clock))
                elif op == "device":
                    for e in [e for e in made if not e.done][:arg]:  # in launch order
                        done = max(done, e.stamp)
                        e.done = True
                    m.available_size()  # releases what completed now (the waiter thread may be later)
                check()
            clock += 1
            m.free(live)
            last_free.update(dict.fromkeys(live, clock))
            for e in made:
                done = max(done, e.stamp)
                e.done = True
            assert _until(lambda: m.pending_free_blocks == 0)
            assert m.get_mapped_memory_size() == 0 and m.num_allocated_blocks() == 0
        finally:
            for e in made:
                e.done = True
            vmm_ops.shutdown_kvcached()


def test_threads_free_at_once_and_deferred_without_losing_a_block(manager: KVCacheManager,
                                                                   events: list[FakeEvent]) -> None:
    held: set[int] = set()
    lock = threading.Lock()
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        import random

        rng = random.Random(seed)
        mine: list[int] = []
        try:
            for _ in range(400):
                if mine and rng.random() < 0.5:
                    gone = [mine.pop(rng.randrange(len(mine))) for _ in range(rng.randint(1, len(mine)))]
                    with lock:
                        held.difference_update(gone)
                    manager.free(gone)
                else:
                    got = manager.alloc(rng.randint(1, 4)) or []
                    with lock:
                        assert not held & set(got), "a block handed out twice"
                        held.update(got)
                    mine += got
                for e in events[:]:  # the device keeps up
                    e.done = True
            with lock:
                held.difference_update(mine)
            manager.free(mine)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for e in events:
        e.done = True
    assert _until(lambda: manager.pending_free_blocks == 0)
    assert manager.num_allocated_blocks() == 0 and manager.get_mapped_memory_size() == 0

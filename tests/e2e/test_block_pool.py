"""``KVCachedBlockPool`` on its own (no engine): memory follows blocks, misses never raise, cache is bounded.

Geometry: 2 layers, vLLM pages of 16 tokens x 4 KiB = 64 KiB, so one 2 MiB kvcached
page holds 32 blocks and one page index is 2 layers x 2 MiB. Block 0 is vLLM's null
block, so page 0 is mapped from the start.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvcached.integration.vllm import interfaces, kv_alloc

BLOCK, CELL, LAYERS = 16, 4096, 2
BPP = (2 << 20) // (BLOCK * CELL)


def _make_pool(monkeypatch: pytest.MonkeyPatch, max_cached_tokens: int = -1, reserve: tuple[int, int] = (0, 0)):
    from kvcached.integration.vllm.block_pool import KVCachedBlockPool

    monkeypatch.setenv("KVCACHED_HOST_MEM_LIMIT_MB", "64")
    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", str(reserve[0]))
    monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", str(reserve[1]))
    monkeypatch.setenv("KVCACHED_MAX_CACHED_TOKENS", str(max_cached_tokens))
    monkeypatch.setenv("KVCACHED_IPC_NAME", f"kvcached_e2e_pool_unit_{os.getpid()}")  # runs at once never collide
    interfaces.init_kvcached(device="cpu", contiguous_layout=True)
    _, meta = interfaces.alloc_kv_cache((8, BLOCK, CELL), BLOCK, torch.uint8, "cpu", LAYERS, attention_type="MLA",
                                        return_meta=True)
    n = meta["num_blocks_per_layer"]
    kv_alloc._pool_info = kv_alloc.PoolInfo(n, BLOCK, CELL, LAYERS)
    return KVCachedBlockPool(num_gpu_blocks=n, enable_caching=True, hash_block_size=BLOCK)


@pytest.fixture
def make_pool(monkeypatch: pytest.MonkeyPatch):
    pools = []

    def make(**kw):
        pools.append(_make_pool(monkeypatch, **kw))
        return pools[-1]

    yield make
    for p in pools:
        p.close()
    interfaces.shutdown_kvcached()
    kv_alloc.reset()


def _pages(pool) -> int:
    return int(pool.kv.page_allocator.num_in_use)


def _cache(pool, blocks) -> None:
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    for b in blocks:
        pool._insert_block_hash(make_block_hash_with_group_id(b.block_id.to_bytes(32, "little"), 0), b, None)


def test_memory_follows_blocks(make_pool) -> None:
    pool = make_pool()
    assert _pages(pool) == 1  # the null block's page
    blocks = pool.get_new_blocks(BPP + 8)  # 31 fill page 0, the rest open page 1
    assert len({b.block_id for b in blocks}) == BPP + 8 and 0 not in {b.block_id for b in blocks}
    assert all(b.ref_cnt == 1 for b in blocks)
    assert _pages(pool) == 2
    pool.free_blocks(blocks)  # no hash: given back to kvcached at once
    assert _pages(pool) == 1
    assert pool.free_block_queue.num_free_blocks == 0


def test_shortfall_is_a_scheduling_miss(make_pool) -> None:
    pool = make_pool()
    assert pool.kv.resize(2 * (2 << 20)) is True  # cap at 2 pages: 63 blocks besides the null block
    held = pool.get_new_blocks(60)
    pool.begin_allocation()
    pool.expect(10)
    assert pool.get_num_free_blocks() < 10  # allocate_slots then returns None: the request waits
    pool.end_allocation()
    pool.begin_allocation()
    pool.expect(3)
    assert pool.get_num_free_blocks() >= 3
    got = pool.get_new_blocks(3)  # what the check promised is there
    pool.end_allocation()
    assert len(got) == 3
    pool.free_blocks(held + got)
    assert _pages(pool) == 1


def test_full_pool_recycles_cached_blocks(make_pool) -> None:
    pool = make_pool()
    assert pool.kv.resize(2 * (2 << 20)) is True  # 63 usable blocks
    live = pool.get_new_blocks(50)
    cached = pool.get_new_blocks(13)
    _cache(pool, cached)
    pool.free_blocks(cached)  # kvcached is now full: 50 live + 13 cached
    assert pool.kv.available_size() == 0
    pool.begin_allocation()
    pool.expect(5)
    assert pool.get_num_free_blocks() >= 5  # the cached blocks count as free, as in vLLM
    got = pool.get_new_blocks(5)  # the 5 least recently used cached blocks, their hashes dropped
    pool.end_allocation()
    assert [b.block_id for b in got] == [b.block_id for b in cached[:5]]
    assert all(b.ref_cnt == 1 and b.block_hash is None for b in got)
    assert pool.free_block_queue.num_free_blocks == 8
    pool.expect(9)
    assert pool.get_num_free_blocks() < 9
    pool.free_blocks(live + got)


def test_cached_blocks_stay_mapped_and_are_reused(make_pool) -> None:
    pool = make_pool()
    blocks = pool.get_new_blocks(4)
    _cache(pool, blocks)
    pool.free_blocks(blocks)
    assert pool.free_block_queue.num_free_blocks == 4 and pool.kv.num_allocated_blocks() == 5
    hit = pool.get_cached_block(_hash_of(blocks[0]), [0])
    assert hit == [blocks[0]]
    pool.touch(hit)  # a prefix hit takes the block back out of the evictable queue
    assert blocks[0].ref_cnt == 1 and pool.free_block_queue.num_free_blocks == 3
    pool.free_blocks(hit)
    assert pool.free_block_queue.num_free_blocks == 4


def _hash_of(block):
    from vllm.v1.core.kv_cache_utils import get_block_hash

    return get_block_hash(block.block_hash)


def test_cache_is_bounded_by_max_cached_tokens(make_pool) -> None:
    pool = make_pool(max_cached_tokens=3 * BLOCK)
    blocks = pool.get_new_blocks(10)
    _cache(pool, blocks)
    pool.free_blocks(blocks)
    assert pool.free_block_queue.num_free_blocks <= 3
    assert pool.kv.num_allocated_blocks() == 1 + pool.free_block_queue.num_free_blocks
    evicted = [b for b in blocks if b.block_hash is None]
    assert len(evicted) >= 7  # evicted blocks lost their hash: no stale prefix hit


def test_a_cache_bound_below_one_block_keeps_one_block(make_pool) -> None:
    pool = make_pool(max_cached_tokens=BLOCK // 2)  # a positive bound: the prefix cache stays on
    assert pool.max_cached_blocks == 1
    for _ in range(3):
        block = pool.get_new_blocks(1)
        _cache(pool, block)
        pool.free_blocks(block)
        assert pool.free_block_queue.num_free_blocks == 1  # kept for a prefix hit (was evicted at once)


def test_eviction_takes_whole_pages_first(make_pool) -> None:
    pool = make_pool()
    first = pool.get_new_blocks(BPP - 1)  # the rest of page 0
    page1 = pool.get_new_blocks(BPP)
    page2 = pool.get_new_blocks(4)
    assert {b.block_id // BPP for b in page1} == {1} and {b.block_id // BPP for b in page2} == {2}
    # cache page 2's blocks first (least recently used), then all of page 1
    _cache(pool, page2[:2] + page1)
    pool.free_blocks(page2[:2])
    pool.free_blocks(page1)
    assert _pages(pool) == 3
    pool._evict(1)  # one block asked for: the whole free page goes, not page 2's older blocks
    assert _pages(pool) == 2
    assert all(b.block_hash is None for b in page1) and all(b.block_hash is not None for b in page2[:2])
    pool.free_blocks(first + page2[2:])


def test_reset_prefix_cache_gives_memory_back(make_pool) -> None:
    pool = make_pool()
    blocks = pool.get_new_blocks(BPP + 1)
    _cache(pool, blocks)
    pool.free_blocks(blocks)
    assert _pages(pool) == 2
    assert pool.reset_prefix_cache() is True
    assert _pages(pool) == 1 and pool.free_block_queue.num_free_blocks == 0


def test_pool_needs_kvcached_allocation(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcached.errors import KVCachedStateError
    from kvcached.integration.vllm.block_pool import KVCachedBlockPool

    kv_alloc.reset()
    with pytest.raises(KVCachedStateError, match="no worker placed the KV cache"):
        KVCachedBlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=16)



def _squeeze_device(pool) -> int:
    """Another engine took the rest of the device: the shared host budget now has nothing free."""
    backend = pool.kv._runtime.backend
    free, total = backend.mem_info()
    backend.set_host_limit(total - free)
    return total


def test_cache_yields_when_the_device_is_full(make_pool, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcached.integration.vllm import block_pool as bp

    pool = make_pool()
    blocks = pool.get_new_blocks(BPP + 1)  # pages 0 and 1
    _cache(pool, blocks)
    pool.free_blocks(blocks)
    pool.shrink_to_limit()  # a step with room on the device: the cache stays
    assert pool.free_block_queue.num_free_blocks == BPP + 1 and _pages(pool) == 2
    total = _squeeze_device(pool)
    try:
        monkeypatch.setattr(bp, "PRESSURE_CHECK_S", 0.0)  # the step above read the device a moment ago
        pool.shrink_to_limit()  # the next step: the device is full, so the cache goes, whole pages with it
        assert pool.free_block_queue.num_free_blocks == 0 and _pages(pool) == 1
        assert pool.pressure_evictions == BPP + 1
        assert all(b.block_hash is None for b in blocks)  # no stale prefix hit later
    finally:
        pool.kv._runtime.backend.set_host_limit(total)


def test_cache_yields_beside_a_full_reserve(make_pool, monkeypatch: pytest.MonkeyPatch) -> None:
    # Engines run with a prealloc reserve, which an idle one keeps full: what this pool could still obtain
    # (its reserve counted in) never looked short, so on the H200 idle engines' caches never yielded
    # (docs/coserving.md). The device's free memory says whether another engine is short.
    from test_native_host import wait_for

    from kvcached.integration.vllm import block_pool as bp

    pool = make_pool(reserve=(2, 4))
    blocks = pool.get_new_blocks(BPP + 1)
    _cache(pool, blocks)
    pool.free_blocks(blocks)
    alloc = pool.kv.page_allocator
    assert wait_for(lambda: alloc.num_reserved >= 2)
    total = _squeeze_device(pool)
    try:
        monkeypatch.setattr(bp, "PRESSURE_CHECK_S", 0.0)
        assert alloc.obtainable_pages() >= alloc.min_reserved  # the old test, which said "not tight"
        pool.shrink_to_limit()
        assert pool.free_block_queue.num_free_blocks == 0 and pool.pressure_evictions == BPP + 1
        assert wait_for(lambda: _pages(pool) == 1 and alloc.num_reserved == 0)  # the reserve went back too
    finally:
        pool.kv._runtime.backend.set_host_limit(total)


def test_idle_engine_gives_its_cache_back_without_a_step(make_pool) -> None:
    import time

    pool = make_pool()
    blocks = pool.get_new_blocks(BPP + 1)
    _cache(pool, blocks)
    pool.free_blocks(blocks)
    assert pool._relief is not None and pool._relief.is_alive()
    total = _squeeze_device(pool)
    try:
        with pool.lock:  # a scheduler call in progress: the thread must leave the cache alone
            time.sleep(0.6)
            assert pool.free_block_queue.num_free_blocks == BPP + 1
        deadline = time.monotonic() + 3
        while pool.free_block_queue.num_free_blocks and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pool.free_block_queue.num_free_blocks == 0 and _pages(pool) == 1  # no step was needed
    finally:
        pool.kv._runtime.backend.set_host_limit(total)
    pool.close()
    assert not pool._relief.is_alive()


def test_relief_thread_ends_quietly_when_kvcached_closes_first(make_pool, caplog) -> None:
    """At interpreter exit kvcached's own exit handler may close the KV cache before vLLM shuts its scheduler
    down: the pool's thread then stops, without a warning about a device it can no longer read."""
    import logging
    import time

    from kvcached.utils import get_kvcached_logger

    pool = make_pool()
    blocks = pool.get_new_blocks(BPP + 1)
    _cache(pool, blocks)
    pool.free_blocks(blocks)  # cached: the thread reads the device at every pass
    assert pool._relief is not None and pool._relief.is_alive()
    logger = get_kvcached_logger()
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger=logger.name):
            pool.kv.close()
            deadline = time.monotonic() + 3
            while pool._relief.is_alive() and time.monotonic() < deadline:
                time.sleep(0.02)
        assert not pool._relief.is_alive()
        assert not [r for r in caplog.records if "cache-relief" in r.getMessage()], caplog.text
    finally:
        logger.removeHandler(caplog.handler)


def test_scheduler_calls_hold_the_pool_lock(make_pool) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvcached.integration.vllm import patches

    names = ("schedule", "update_from_output", "finish_requests", "reset_prefix_cache")
    assert all(hasattr(Scheduler, n) for n in names)  # what patches wraps exists in this vLLM
    pool = make_pool()

    class FakeScheduler:  # wrapped the way patches wraps vLLM's (not applied here: it would patch this process)
        kv_cache_manager = type("M", (), {"block_pool": pool})()

        def schedule(self) -> bool:
            return pool.lock._is_owned()

    patches._under_pool_lock(FakeScheduler, "schedule")
    assert FakeScheduler().schedule() is True
    assert not pool.lock._is_owned()


def test_a_step_that_frees_many_requests_bounds_the_cache_once(make_pool, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcached.integration.vllm import patches

    pool = make_pool(max_cached_tokens=3 * BLOCK)
    requests = [pool.get_new_blocks(4) for _ in range(5)]
    for blocks in requests:
        _cache(pool, blocks)
    scans = []
    evict = pool._evict
    monkeypatch.setattr(pool, "_evict", lambda want: scans.append(want) or evict(want))

    class FakeScheduler:  # update_from_output wrapped as patches wraps vLLM's
        kv_cache_manager = type("M", (), {"block_pool": pool})()

        def update_from_output(self) -> int:
            for blocks in requests:  # every request of the step finished
                pool.free_blocks(blocks)
            return pool.free_block_queue.num_free_blocks

    patches._under_pool_lock(FakeScheduler, "update_from_output", batch_frees=True)
    assert FakeScheduler().update_from_output() == 20  # all cached while the call runs ...
    assert scans == [17]  # ... then one eviction down to the bound, not one per request
    assert pool.free_block_queue.num_free_blocks == 3
    assert pool.kv.num_allocated_blocks() == 1 + 3
    blocks = pool.get_new_blocks(2)  # outside a batch a free bounds the cache at once, as before
    _cache(pool, blocks)
    pool.free_blocks(blocks)
    assert pool.free_block_queue.num_free_blocks == 3 and len(scans) == 2


def test_eviction_walks_the_cache_only_as_far_as_it_needs(make_pool, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcached.integration.vllm import block_pool

    pool = make_pool()
    first = pool.get_new_blocks(BPP - 1)  # the rest of page 0 (the null block's page: never whole)
    pages = [pool.get_new_blocks(BPP) for _ in range(3)]  # pages 1, 2 and 3
    for blocks in pages:
        _cache(pool, blocks)
        pool.free_blocks(blocks)
    walked = []
    walk = block_pool._lru_order

    def counted(queue):
        for b in walk(queue):
            walked.append(b.block_id)
            yield b

    monkeypatch.setattr(block_pool, "_lru_order", counted)
    assert pool._evict(1) == BPP  # the oldest whole page, found once its last block was seen
    assert walked == [b.block_id for b in pages[0]]
    assert all(b.block_hash is None for b in pages[0]) and all(b.block_hash is not None for b in pages[1])
    assert _pages(pool) == 3
    pool.free_blocks(first)

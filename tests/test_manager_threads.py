"""KVCacheManager with the default async_sched=False used from several threads at once.

The native BlockPool has its own mutex; what these tests hit is the Python-level state
around it: blocks held by try_to_reserve() and the first bind to the KV tensors.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import uuid

import pytest

from kvcached import vmm_ops
from kvcached.kv_cache_manager import KVCacheManager

LAYERS, BS, CELL = 2, 64, 512  # 32 KiB blocks: 64 per 2 MiB page
BLOCKS = 64 * 64


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("KVCACHED_IPC_NAME", f"kvcached_test_{os.getpid()}_{uuid.uuid4().hex[:8]}")
    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "0")
    monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", "0")
    vmm_ops.init_kvcached("cpu", contiguous_layout=True)
    # Switch threads as often as possible: a race in a few bytecodes shows up in a few rounds.
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield vmm_ops.runtime()
    finally:
        sys.setswitchinterval(old)
        if vmm_ops.is_initialized():
            vmm_ops.shutdown_kvcached()


def _create_tensors(rt) -> None:
    pages = BLOCKS // (rt.page_size // (BS * CELL))
    vmm_ops.create_kv_tensors(pages * 2 * rt.page_size, 2, "cpu", LAYERS)


def _run_together(fns) -> list:
    """Run each fn in its own thread, started together; their results, or the first error raised."""
    barrier = threading.Barrier(len(fns))
    results: list = [None] * len(fns)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait()
            results[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def test_concurrent_allocs_share_reserved_blocks_correctly(runtime) -> None:
    _create_tensors(runtime)
    m = KVCacheManager(BLOCKS, BS, CELL, LAYERS)
    bad = []
    for rnd in range(80):
        assert m.try_to_reserve(3)
        a, b = _run_together([lambda: m.alloc(1503), lambda: m.alloc(1503)])
        assert a is not None and b is not None
        ids = a + b
        if len(a) != 1503 or len(b) != 1503 or len(set(ids)) != len(ids) or m._reserved:
            bad.append((rnd, len(a), len(b), len(ids) - len(set(ids)), len(m._reserved)))
        m.free_reserved()
        m.clear()
        assert m.num_allocated_blocks() == 0
    assert not bad, f"{len(bad)} of 80 rounds went wrong (round, len a, len b, duplicates, left reserved): {bad[:5]}"


def test_mixed_calls_from_threads_keep_the_books(runtime) -> None:
    _create_tensors(runtime)
    m = KVCacheManager(BLOCKS, BS, CELL, LAYERS, reserve_null_block=True)
    held: list[list[int]] = [[] for _ in range(4)]

    def work(k: int):
        def run() -> None:
            mine = held[k]
            for i in range(400):
                n = 1 + (i * 37 + k) % 150
                got = m.alloc(n)
                if got is not None:
                    assert len(got) == n, f"alloc({n}) returned {len(got)} blocks"
                    mine.extend(got)
                if i % 3 == 0:
                    m.try_to_reserve(1 + i % 5)
                if i % 11 == 0:
                    m.free_reserved()
                if len(mine) > 400:
                    m.free(mine[:300])
                    del mine[:300]
        return run

    _run_together([work(k) for k in range(4)])
    everything = [i for mine in held for i in mine]
    assert len(everything) == len(set(everything)), "two threads were handed the same block"
    assert 0 not in everything, "the null block was handed out"
    assert not set(everything) & set(m._reserved), "a block is both handed out and held in reserve"
    assert m.num_allocated_blocks() == len(everything) + len(m._reserved) + 1
    m.free_reserved()
    for mine in held:
        m.free(mine)
    assert m.num_allocated_blocks() == 1


@pytest.mark.parametrize("null_block", [False, True])
def test_first_calls_from_two_threads_bind_once(runtime, null_block: bool) -> None:
    # Created before the KV tensors: the first alloc of each thread waits for them, then binds.
    for rnd in range(20):
        m = KVCacheManager(BLOCKS, BS, CELL, LAYERS, group_id=rnd, reserve_null_block=null_block)
        timer = threading.Timer(0.02, vmm_ops.create_kv_tensors,
                                args=(BLOCKS // 64 * 2 * runtime.page_size, 2, "cpu", LAYERS),
                                kwargs={"group_id": rnd})
        timer.start()
        try:
            got = _run_together([functools.partial(m.alloc, 1)] * 4)
        finally:
            timer.join()
        ids = [i for g in got for i in g]
        assert len(set(ids)) == 4, f"round {rnd}: {got}"
        if null_block:
            assert 0 not in ids, f"round {rnd}: the null block was handed out: {got}"
        m.close()

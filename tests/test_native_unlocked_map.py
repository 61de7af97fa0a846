"""The prealloc thread maps outside the allocator's lock: while the driver works (on an H200 under load ~100 us
a call, so ~10 ms for a per-layer page group of 64 regions) a serving step still takes reserved pages and
returns freed ones; an allocation that needs more than the reserve waits for the thread's pages instead of
mapping others beside them; trim and close still leave nothing mapped. The host backend is slowed to 0.1 s
a map call (``Backend._set_map_delay_us``) so that the thread's map takes ~0.4 s (4 regions)."""

from __future__ import annotations

import time

import pytest
from test_native_host import wait_for
from test_native_runs import Pool

vmm = pytest.importorskip("kvcached._vmm")

pytestmark = pytest.mark.usefixtures("own_host_budget")

DELAY_S = 0.1


@pytest.fixture
def slow_pool():
    with Pool(pages=32, min_reserved=4, max_reserved=8, prealloc=True) as pool:
        assert len(pool.geom.regions()) == 4
        assert wait_for(lambda: pool.pa.num_reserved >= 4)
        pool.pa.set_lazy_reserve_ms(50)
        pool.b._set_map_delay_us(int(DELAY_S * 1e6))
        yield pool
        pool.b._set_map_delay_us(0)


def test_the_delay_is_a_host_hook() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        vmm.Backend("host")._set_map_delay_us(-1)


def _start_refill(pool: Pool) -> list[int]:
    """Takes pages below the reserve's minimum and returns once the thread is inside its map."""
    physical = pool.b.physical_bytes()
    got = pool.pa.alloc_pages(pool.pa.num_reserved - 2)
    # the thread creates the run's memory first (no delay), then maps it region by region (the delay)
    assert wait_for(lambda: pool.b.physical_bytes() > physical)
    mapped = sum(n for _, n, _ in pool.pa.runs())
    assert pool.pa.num_reserved == 2 and mapped == len(got) + 2  # the refill has not landed yet
    return got


def test_a_step_does_not_wait_for_the_threads_map(slow_pool: Pool) -> None:
    pool = slow_pool
    held = _start_refill(pool)
    for p in held:
        pool.mark(p, p)
    t0 = time.monotonic()
    step = pool.pa.alloc_pages(2)  # the reserve has them: no driver call, and the lock is free
    pool.pa.free_pages(step)
    took = time.monotonic() - t0
    assert took < 2 * DELAY_S, f"the step waited {took:.3f} s for the thread's map (4 calls of {DELAY_S} s)"
    assert wait_for(lambda: pool.pa.num_reserved >= 8, timeout=10)
    assert pool.pa.num_in_use == len(held)
    assert all(pool.marks(p, p) for p in held)  # live pages kept their bytes through the refill


def test_an_allocation_beyond_the_reserve_waits_for_the_threads_pages(slow_pool: Pool) -> None:
    pool = slow_pool
    held = _start_refill(pool)
    before = pool.pa.pages_mapped_total
    got = pool.pa.alloc_pages(5)  # more than the 2 reserved: the 6 being mapped serve it, nothing inline
    assert len(got) == 5 and not set(got) & set(held)
    assert pool.pa.pages_mapped_total - before == 6  # the thread's run alone
    assert pool.pa.num_in_use == len(held) + 5
    for p in got:
        pool.mark(p, 7)
        assert pool.marks(p, 7)


def test_trim_during_the_threads_map(slow_pool: Pool) -> None:
    pool = slow_pool
    held = _start_refill(pool)
    pool.pa.trim()  # waits for the thread's pages, then unmaps them with the rest of the reserve
    # what stays mapped is the runs that hold a page in use (a run is unmapped whole)
    assert set(held) <= pool.mapped_pages() and all(live > 0 for *_, live in pool.pa.runs())
    assert pool.mapped_pages().isdisjoint(range(4, 10))  # the thread's run came and went


def test_close_during_the_threads_map(slow_pool: Pool) -> None:
    pool = slow_pool
    _start_refill(pool)
    pool.pa.close()  # stops the thread (its map finishes first), then unmaps everything
    assert pool.pa.runs() == []
    with pytest.raises(RuntimeError, match="closed"):
        pool.pa.alloc_pages(1)

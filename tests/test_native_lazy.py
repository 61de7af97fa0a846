"""The lazy reserve (``PageAllocator.set_lazy_reserve_ms``), what serving engines run with: the step rarely waits
on the driver (refills and inline maps come as whole runs; freed pages stay mapped while the load was that high
within the window) and memory still goes back once the load has stayed down for the window."""

from __future__ import annotations

import time

import pytest
from test_native_host import wait_for
from test_native_runs import Pool

vmm = pytest.importorskip("kvcached._vmm")

pytestmark = pytest.mark.usefixtures("own_host_budget")


def _runs(pool: Pool) -> list[tuple[int, int, int]]:
    return [tuple(r) for r in pool.pa.runs()]


def test_off_by_default_and_checked() -> None:
    with Pool(pages=16, min_reserved=1, max_reserved=4, prealloc=True) as pool:
        assert pool.pa.lazy_reserve_ms == 0
        assert wait_for(lambda: pool.pa.num_reserved == 1)  # without it: refilled to the minimum, page by page
        with pytest.raises(ValueError, match="ms >= 0"):
            pool.pa.set_lazy_reserve_ms(-1)
        with pytest.raises(TypeError):
            pool.pa.set_lazy_reserve_ms("5")


def test_refill_goes_to_the_upper_bound_in_one_run() -> None:
    with Pool(pages=16, min_reserved=2, max_reserved=6, prealloc=True) as pool:
        assert wait_for(lambda: pool.pa.num_reserved == 2)  # filled to the minimum before the lazy reserve
        pool.pa.set_lazy_reserve_ms(50)
        assert pool.pa.alloc_pages(2) == [0, 1]  # below the minimum again
        assert wait_for(lambda: pool.pa.num_reserved == 6)
        assert _runs(pool) == [(0, 2, 2), (2, 6, 0)]  # one allocation: one set of driver calls per region


def test_inline_map_fills_the_reserve_in_the_same_run() -> None:
    with Pool(pages=16, min_reserved=0, max_reserved=4, prealloc=True) as pool:
        pool.pa.set_lazy_reserve_ms(50)
        got = pool.pa.alloc_pages(3)  # nothing reserved: mapped inline, with 4 more for the reserve
        assert got == [0, 1, 2]
        assert pool.pa.num_in_use == 3 and pool.pa.num_reserved == 4
        assert _runs(pool) == [(0, 7, 3)]
        assert pool.pa.alloc_pages(4) == [3, 4, 5, 6]  # from the reserve: no driver call
        assert _runs(pool) == [(0, 7, 7)]


def test_inline_extra_respects_the_limit() -> None:
    with Pool(pages=16, min_reserved=0, max_reserved=8, prealloc=True) as pool:
        pool.pa.set_lazy_reserve_ms(50)
        pool.pa.set_limit_pages(5)
        assert pool.pa.alloc_pages(3) == [0, 1, 2]
        assert pool.pa.num_in_use + pool.pa.num_reserved <= 5


def test_freed_pages_stay_mapped_for_the_window_then_go() -> None:
    with Pool(pages=16, min_reserved=0, max_reserved=1, prealloc=True) as pool:
        pool.pa.set_lazy_reserve_ms(600)
        pages = pool.pa.alloc_pages(8)
        pool.pa.free_pages(pages)
        time.sleep(0.3)
        # within the window: the load reached 8 pages, so they stay mapped (a next burst maps nothing)
        assert pool.pa.num_in_use == 0 and pool.pa.num_reserved >= 8
        assert pool.pa.alloc_pages(8) == pages  # the same pages, still mapped
        pool.pa.free_pages(pages)
        t0 = time.monotonic()
        # the load stays at 0: within the window plus the thread's period the reserve falls to its bound
        assert wait_for(lambda: pool.pa.num_reserved <= 1, timeout=3.0)
        took = time.monotonic() - t0
        assert 0.5 <= took <= 1.5, took


def test_without_the_window_freed_pages_go_at_once() -> None:
    with Pool(pages=16, min_reserved=0, max_reserved=1, prealloc=True) as pool:
        pages = pool.pa.alloc_pages(8)
        pool.pa.free_pages(pages)
        assert wait_for(lambda: pool.pa.num_reserved <= 1, timeout=1.0)


def test_trim_and_a_lower_limit_ignore_the_window() -> None:
    with Pool(pages=16, min_reserved=0, max_reserved=1, prealloc=True) as pool:
        pool.pa.set_lazy_reserve_ms(60_000)
        pages = pool.pa.alloc_pages(6)
        pool.pa.free_pages(pages[2:])
        pool.pa.set_limit_pages(3)  # a kvctl limit applies now, whatever the window holds
        assert pool.pa.num_in_use + pool.pa.num_reserved <= 3 or all(live for *_, live in pool.pa.runs())
        pool.pa.free_pages(pages[:2])
        pool.pa.trim()  # trim's promise is memory back now
        assert pool.pa.num_reserved == 0 and pool.pa.runs() == []


def _squeeze(pool: Pool, leave_pages: int = 0) -> None:
    """Another process took the device's memory but ``leave_pages`` pages' worth."""
    free, total = pool.b.mem_info()
    pool.b.set_host_limit(total - free + leave_pages * pool.pa.page_bytes)
    pool.pa.refresh_mem_info()


def test_a_full_device_takes_the_window_and_the_reserve_back() -> None:
    # Several engines on one device: pages mapped ahead of need must go to the engine whose requests wait
    # (on the H200 the window and the reserve of idle engines kept them: docs/coserving.md). Page by page,
    # as the contiguous layout maps: a run keeps all its pages while one is in use.
    with Pool(pages=16, min_reserved=0, max_reserved=4, prealloc=True, max_run_pages=1) as pool:
        pool.pa.set_lazy_reserve_ms(60_000)
        pages = pool.pa.alloc_pages(6)  # mapped inline with 4 more for the reserve
        pool.pa.free_pages(pages[1:])
        time.sleep(0.3)
        assert pool.pa.num_reserved == 9 and not pool.pa.device_tight()  # the window keeps them mapped
        _squeeze(pool)
        assert pool.pa.device_tight()
        assert wait_for(lambda: pool.pa.num_reserved == 0)  # not max_reserved: nothing stays ahead of need
        assert pool.pa.num_in_use == 1 and pool.mapped_pages() == {pages[0]}
        # what went back made room (9 pages free, the bound is 5): pages freed now stay for the window again
        assert wait_for(lambda: pool.pa.refresh_mem_info() or not pool.pa.device_tight())
        pool.pa.free_pages([pages[0]])
        time.sleep(0.3)
        assert pool.pa.num_reserved == 1


def test_the_refill_leaves_the_device_room() -> None:
    # Refilling into the device's last max_reserved + 1 pages would make it tight and the next pass unmap
    # them again, every 250 ms: the refill stops short of that.
    with Pool(pages=16, min_reserved=2, max_reserved=4, prealloc=True) as pool:
        assert wait_for(lambda: pool.pa.num_reserved == 2)
        _squeeze(pool, leave_pages=4 + 1 + 1)  # the bound's 5 pages and one more
        assert pool.pa.alloc_pages(2) == [0, 1]  # from the reserve: the thread refills
        assert wait_for(lambda: pool.pa.num_reserved == 1)
        time.sleep(0.6)
        assert pool.pa.num_reserved == 1 and not pool.pa.device_tight()

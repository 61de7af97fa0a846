"""Which page a request's blocks come from (issue 35, item 3): the lowest partly used page that holds
all of them, else the lowest pages in turn; one block takes the lowest partly used page. A request's
blocks then share one page where one can hold them, instead of smearing over small holes (the
existing kvcached's regression case), and live blocks stay packed low (benchmarks/results/page_choice_host.md:
best fit held more pages). Pages of 64 blocks (16 tokens x 2 KiB); holes are made by freeing blocks.
"""

from __future__ import annotations

import pytest

from kvcached import vmm_ops
from kvcached.kv_cache_manager import KVCacheManager

BPP = 64


@pytest.fixture
def holes(exact_pool_env: str):
    """``make({page: free blocks})`` -> a manager whose pages 0..N-1 are held with those holes."""
    vmm_ops.init_kvcached("cpu", contiguous_layout=True)
    vmm_ops.create_kv_tensors(16 * 2 * (2 << 20), 2, "cpu", 1)
    mgr = KVCacheManager(16 * BPP, 16, 2048, 1)

    def make(free: dict[int, int]) -> KVCacheManager:
        pages = max(free) + 1
        blocks = mgr.alloc(pages * BPP)
        assert blocks == list(range(pages * BPP))
        mgr.free([p * BPP + i for p, n in free.items() for i in range(BPP - n, BPP)])
        for p in range(pages):  # pages without a hole are given back whole
            if p not in free:
                mgr.free(list(range(p * BPP, (p + 1) * BPP)))
        return mgr

    yield make
    vmm_ops.shutdown_kvcached()


def _pages(ids: list[int]) -> set[int]:
    return {i // BPP for i in ids}


def test_the_lowest_page_that_holds_the_request_gives_it(holes) -> None:
    m = holes({0: 5, 1: 40, 2: 20})
    assert _pages(m.alloc(10)) == {1}  # page 0's 5 would split the request; page 1 is the lowest that fits
    assert _pages(m.alloc(5)) == {0}
    assert _pages(m.alloc(1)) == {1}  # one block: the lowest partly used page (page 0 is full now)


def test_a_run_lands_on_one_page_instead_of_the_small_holes(holes) -> None:
    m = holes({0: 2, 1: 3, 2: 2, 3: 1, 4: 40, 5: 2})
    got = m.alloc(40)
    assert len(got) == 40 and _pages(got) == {4}  # lowest-first walked pages 0-3 and 5 first
    assert _pages(m.alloc(2)) == {0}


def test_a_request_no_page_holds_takes_the_lowest_pages_in_turn(holes) -> None:
    m = holes({0: 10, 1: 30, 2: 20})
    got = m.alloc(55)
    assert len(set(got)) == 55 and _pages(got) == {0, 1, 2}
    # page 0's 10, then page 1's 30 (none holds the 45 left), then 15 of page 2's 20 (the lowest that holds them)
    assert _pages(got[:10]) == {0} and _pages(got[10:40]) == {1} and _pages(got[40:]) == {2}


def test_fresh_pages_are_taken_only_when_the_held_ones_fall_short(holes) -> None:
    m = holes({0: 3})
    held = m.page_allocator.num_in_use
    assert _pages(m.alloc(3)) == {0} and m.page_allocator.num_in_use == held
    got = m.alloc(BPP + 1)  # a whole new page and one more block
    assert len(got) == BPP + 1 and m.page_allocator.num_in_use == held + 2

"""Best-fit block selection (issue 35, item 3): a request's blocks come from the fullest page
that holds them all, else the emptiest page first, so few pages stay held by a few blocks.

Pages of 64 blocks (16 tokens x 2 KiB); holes are made by freeing blocks of whole pages.
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


def test_the_tightest_page_that_holds_the_request_gives_it(holes) -> None:
    m = holes({0: 40, 1: 5, 2: 20})
    assert _pages(m.alloc(10)) == {2}  # 20 free is the tightest fit; page 0's 40 would leave a big hole
    assert _pages(m.alloc(5)) == {1}  # an exact fit wins
    assert _pages(m.alloc(1)) == {2}  # page 2 has 10 left, page 0 40: the fuller page


def test_a_run_lands_on_one_page_instead_of_the_small_holes(holes) -> None:
    m = holes({0: 2, 1: 3, 2: 2, 3: 1, 4: 40, 5: 2})
    got = m.alloc(40)
    assert len(got) == 40 and _pages(got) == {4}  # lowest-first walked pages 0-3 and 5 first


def test_a_request_no_page_holds_takes_the_biggest_bite_first(holes) -> None:
    m = holes({0: 10, 1: 30, 2: 20})
    got = m.alloc(55)
    assert len(set(got)) == 55 and _pages(got) == {0, 1, 2}
    assert _pages(got[:30]) == {1} and _pages(got[30:50]) == {2} and _pages(got[50:]) == {0}


def test_fresh_pages_are_taken_only_when_the_held_ones_fall_short(holes) -> None:
    m = holes({0: 3})
    held = m.page_allocator.num_in_use
    assert _pages(m.alloc(3)) == {0} and m.page_allocator.num_in_use == held
    got = m.alloc(BPP + 1)  # a whole new page and one more block
    assert len(got) == BPP + 1 and m.page_allocator.num_in_use == held + 2

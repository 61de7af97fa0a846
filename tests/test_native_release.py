"""Deferred release: a shrink unmaps (addresses back on the zero page) before it returns and
leaves the release of the physical handles to a background thread of the backend. Memory
waiting for release still counts as held; a create that runs out of memory flushes it and
tries again; trim, close and interpreter exit release it before they return.

The host backend takes the same path as the GPU ones. ``Backend._pause_releases(True)``
keeps the thread off the queue, so what is pending does not depend on thread timing."""

from __future__ import annotations

import gc
import multiprocessing
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

vmm = pytest.importorskip("kvcached._vmm")

MiB = 1 << 20
U = 2 * MiB

pytestmark = pytest.mark.usefixtures("own_host_budget")


def build(limit_mb: int = 64, pages: int = 8, max_reserved: int = 0, max_run_pages: int = 0):
    b = vmm.Backend("host", host_limit_bytes=limit_mb * MiB)
    vt = vmm.VirtualTensor(b, pages * U, U)
    pa = vmm.PageAllocator(b, [vt], [(0, 0, U)], pages, 0, max_reserved, False, max_run_pages=max_run_pages)
    return b, vt, pa


def released_calls(pa) -> tuple[int, int]:
    ph = pa.phase_times()
    return ph.get("release.background", (0, 0))[1], ph.get("release.flushed", (0, 0))[1]


def test_free_queues_the_release_and_the_thread_does_it_without_further_calls(eventually):
    b, vt, pa = build()
    base = b.physical_bytes()  # the zero page
    pa.alloc_pages(3)  # one run: one allocation
    pa.reset_phase_times()
    b._pause_releases(True)
    pa.free_pages([0, 1, 2])
    ph = pa.phase_times()
    assert ph["unmap.release_deferred"][1] == 1 and "unmap.release" not in ph
    assert pa.num_in_use == 0 and pa.mapped_bytes == 0 and pa.runs() == []  # unmapped at once
    assert b.pending_release_bytes() == 3 * U  # released not yet: still held, as the driver sees it
    assert b.physical_bytes() == base + 3 * U and b.mem_info()[0] == 64 * MiB - base - 3 * U
    b._pause_releases(False)
    # No call of ours releases it now: only reads until the thread has done it.
    assert eventually(lambda: b.pending_release_bytes() == 0 and b.physical_bytes() == base)
    assert b.mem_info()[0] == 64 * MiB - base
    assert released_calls(pa) == (1, 0)
    assert pa.phase_times()["release.background"][0] >= 0
    pa.close()


def test_the_thread_also_releases_unpaused(eventually):
    b, vt, pa = build()
    base = b.physical_bytes()
    for _ in range(20):
        pa.free_pages(pa.alloc_pages(2))
    assert eventually(lambda: b.physical_bytes() == base and b.pending_release_bytes() == 0)
    bg, flushed = released_calls(pa)
    assert bg + flushed == 20  # each handle released exactly once, wherever
    pa.close()


def test_grow_right_after_shrink_under_a_tight_budget_drains_the_pending_releases():
    # zero page + 4 pages: the whole budget
    b, vt, pa = build(limit_mb=10, pages=8)
    assert len(pa.alloc_pages(4)) == 4
    b._pause_releases(True)
    pa.free_pages([0, 1, 2, 3])
    assert b.pending_release_bytes() == 4 * U and b.mem_info()[0] == 0
    pa.reset_phase_times()
    assert pa.alloc_pages(4) == [0, 1, 2, 3]  # no sleep: the failed create flushed and tried again
    ph = pa.phase_times()
    assert ph["map.drain"][1] == 1 and released_calls(pa) == (0, 1)
    assert b.pending_release_bytes() == 0
    with pytest.raises(vmm.OutOfMemoryError, match="host budget"):  # really out of memory still fails
        pa.alloc_pages(1)
    assert pa.num_in_use == 4
    pa.close()


def test_the_out_of_memory_flush_reaches_other_backends_of_the_process():
    # two Backend objects on one host budget draw on the same memory
    a, vta, pa_a = build(limit_mb=12, pages=4)
    b = vmm.Backend("host", host_limit_bytes=12 * MiB)
    assert b.shm_name == a.shm_name
    vtb = vmm.VirtualTensor(b, 4 * U, U)  # zero pages: 4 MiB; 8 MiB left
    pa_b = vmm.PageAllocator(b, [vtb], [(0, 0, U)], 4, 0, 0, False)
    pa_a.alloc_pages(4)
    a._pause_releases(True)
    pa_a.free_pages([0, 1, 2, 3])
    assert a.pending_release_bytes() == 8 * MiB and b.mem_info()[0] == 0
    assert len(pa_b.alloc_pages(4)) == 4
    assert a.pending_release_bytes() == 0
    pa_b.close()
    pa_a.close()


def test_trim_returns_with_the_memory_released():
    b, vt, pa = build(max_reserved=8)
    base = b.physical_bytes()
    pa.alloc_pages(2)
    pa.alloc_pages(2)  # two runs
    b._pause_releases(True)
    pa.free_pages([0, 1])  # kept as reserved (max_reserved)
    pa.set_limit_pages(2)  # run [0..1] unmapped: its release is queued
    assert pa.runs() == [(2, 2, 2)] and b.pending_release_bytes() == 2 * U
    pa.free_pages([2, 3])
    pa.trim()  # run [2..3] too; trim does not return before both are released
    assert pa.runs() == [] and b.pending_release_bytes() == 0 and b.physical_bytes() == base
    assert b.mem_info()[0] == 64 * MiB - base
    assert released_calls(pa) == (0, 2)
    pa.close()


def test_close_and_destruction_release_what_is_pending():
    b, vt, pa = build()
    pa.alloc_pages(5)
    b._pause_releases(True)
    pa.free_pages([0, 1, 2, 3, 4])
    pa.alloc_pages(2)
    assert b.pending_release_bytes() == 5 * U
    pa.close()  # unmaps the live run, releases it and the pending one
    assert b.pending_release_bytes() == 0 and b.physical_bytes() == U  # the zero page
    del pa, vt
    gc.collect()
    assert b.physical_bytes() == 0 and b.mem_info() == (64 * MiB, 64 * MiB)  # the budget is whole again

    b2, vt2, pa2 = build()
    pa2.free_pages(pa2.alloc_pages(3))
    b2._pause_releases(True)
    pa2.alloc_pages(1)
    pa2.free_pages([0])
    del pa2  # never closed: the destructor closes
    gc.collect()
    assert b2.pending_release_bytes() == 0 and b2.physical_bytes() == U


def test_interpreter_exit_flushes_and_stops_the_releaser():
    code = """
from kvcached import _vmm
b = _vmm.Backend("host", host_limit_bytes=64 << 20)
vt = _vmm.VirtualTensor(b, 16 << 20, 2 << 20)
pa = _vmm.PageAllocator(b, [vt], [(0, 0, 2 << 20)], 8, 0, 0, False)
b._pause_releases(True)
pa.free_pages(pa.alloc_pages(3))
assert b.pending_release_bytes() == 6 << 20
_vmm._stop_all_threads()  # what the atexit hook runs
assert b.pending_release_bytes() == 0 and b.physical_bytes() == 2 << 20
pa.reset_phase_times()
pa.free_pages(pa.alloc_pages(2))  # from now on released inline, before the call returns
ph = pa.phase_times()
assert ph["unmap.release"][1] == 1 and "unmap.release_deferred" not in ph, ph
assert b.physical_bytes() == 2 << 20
pa.alloc_pages(1)
b._pause_releases(True)
print("ok", flush=True)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


_ALLOC = st.tuples(st.just("alloc"), st.integers(1, 4))
_FREE = st.tuples(st.just("free"), st.integers(0, 2**8))
OPS = st.one_of(  # allocations and frees twice as often: shrink then grow is the case at stake
    _ALLOC, _FREE, _ALLOC, _FREE,
    st.tuples(st.just("pause"), st.booleans()),
    st.tuples(st.just("trim"), st.just(0)),
    st.tuples(st.just("limit"), st.integers(0, 9)),
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cap=st.sampled_from([0, 1, 2]), paused=st.booleans(), ops=st.lists(OPS, min_size=8, max_size=40))
def test_pending_releases_never_cost_an_allocation(cap, paused, ops):
    """Under a budget of exactly 4 pages an allocation succeeds whenever the memory it needs
    is mapped by nobody, whether or not its release is still pending."""
    pages, fit = 8, 4
    b, vt, pa = build(limit_mb=2 + 2 * fit, pages=pages, max_run_pages=cap)
    b._pause_releases(paused)  # paused: every release waits for a flush (an allocation's, or trim's)
    base = b.physical_bytes()
    live: set[int] = set()
    limit = pages
    for op, arg in ops:
        if op == "alloc":
            fresh = max(0, arg - pa.num_reserved)  # reserved pages (of pinned runs) are taken first
            mapped = pa.num_in_use + pa.num_reserved
            if len(live) + arg > min(limit, pages) or mapped + fresh > fit:
                with pytest.raises(vmm.OutOfMemoryError):
                    pa.alloc_pages(arg)
            else:
                live.update(pa.alloc_pages(arg))
        elif op == "free" and live:
            ids = [p for i, p in enumerate(sorted(live)) if arg >> (i % 8) & 1] or [min(live)]
            pa.free_pages(ids)
            live.difference_update(ids)
        elif op == "pause":
            b._pause_releases(arg)
        elif op == "trim":
            pa.trim()
            assert b.pending_release_bytes() == 0 and b.physical_bytes() == base + pa.mapped_bytes
        elif op == "limit":
            limit = arg
            pa.set_limit_pages(limit)
        assert pa.num_in_use == len(live)
        pending = b.pending_release_bytes()  # read first: it and physical_bytes only shrink meanwhile
        assert 0 <= b.physical_bytes() - (base + pa.mapped_bytes) <= pending
        assert pa.obtainable_pages() <= (b.mem_info()[0] + pending) // U + pa.num_reserved
    pa.close()
    assert b.pending_release_bytes() == 0 and b.physical_bytes() == base


def _forked_child(b, conn) -> None:
    mine = vmm.Backend("host", 0, 0)  # the child's own memory (an inherited host backend shares the parent's memfd)
    vt = vmm.VirtualTensor(mine, 4 * U, U)
    pa = vmm.PageAllocator(mine, [vt], [(0, 0, U)], 4, 0, 0, False)
    pa.free_pages(pa.alloc_pages(2))  # starts a releaser thread of the child's own
    mine.flush_releases()
    conn.send((b.pending_release_bytes(), mine.pending_release_bytes(), mine.physical_bytes()))
    pa.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_fork_with_pending_releases(eventually):
    b, vt, pa = build()
    pa.free_pages(pa.alloc_pages(1))  # the releaser thread runs
    assert eventually(lambda: b.pending_release_bytes() == 0)
    b._pause_releases(True)
    pa.free_pages(pa.alloc_pages(3))
    assert b.pending_release_bytes() == 3 * U
    ctx = multiprocessing.get_context("fork")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_forked_child, args=(b, theirs))
    child.start()
    try:
        # the child forgot the parent's queue (those handles are the parent's to release) and
        # released its own; the fork itself flushed the parent's queue first
        assert ours.recv() == (0, 0, U)
    finally:
        child.join(timeout=30)
    assert child.exitcode == 0
    assert b.pending_release_bytes() == 0 and b.physical_bytes() == U
    b._pause_releases(False)
    pa.free_pages(pa.alloc_pages(2))
    assert eventually(lambda: b.pending_release_bytes() == 0 and b.physical_bytes() == U)
    pa.close()

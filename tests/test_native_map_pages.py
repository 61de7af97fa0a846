"""PageAllocator.map_pages(ids): map exactly the pages asked for (kvcached's explicit
map_to_kv_tensors), all-or-nothing, on the host backend."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

from kvcached.layout import KVGeometry, KVSpec, Layout

vmm = pytest.importorskip("kvcached._vmm")

MiB = 1 << 20
U = 2 * MiB


pytestmark = pytest.mark.usefixtures("own_host_budget")


def per_layer(limit_mb=256, num_layers=2, num_pages=8, max_reserved=0, max_run_pages=0):
    b = vmm.Backend("host", host_limit_bytes=limit_mb * MiB)
    geom = KVGeometry(KVSpec(num_layers, num_pages, 1, 1, U, torch.uint8, 2), Layout.PER_LAYER, U)
    vts = [vmm.VirtualTensor(b, geom.tensor_bytes, geom.unit_bytes) for _ in range(geom.num_tensors)]
    pa = vmm.PageAllocator(b, vts, geom.regions(), geom.num_pages, 0, max_reserved, False,
                           max_run_pages=max_run_pages)
    return b, vts, pa, [torch.from_dlpack(vt.to_dlpack()) for vt in vts]


def page_of(view: torch.Tensor, kv: int, p: int, num_pages: int = 8) -> torch.Tensor:
    base = (kv * num_pages + p) * U
    return view[base : base + U]


def test_maps_exactly_the_given_pages():
    b, vts, pa, views = per_layer()
    pa.map_pages([5, 2])
    assert pa.num_in_use == 2 and pa.num_reserved == 0
    assert [pa.is_in_use(p) for p in range(8)] == [p in (2, 5) for p in range(8)]
    assert b.physical_bytes() == U + 2 * 4 * U  # zero page + 2 pages x (2 layers x K, V)
    for layer, v in enumerate(views):
        for kv in (0, 1):
            page_of(v, kv, 2).fill_(10 + 2 * layer + kv)
            page_of(v, kv, 5).fill_(20 + 2 * layer + kv)
    for layer, v in enumerate(views):
        for kv in (0, 1):  # real memory: no aliasing between pages, layers or K/V
            assert int(page_of(v, kv, 2).min()) == int(page_of(v, kv, 2).max()) == 10 + 2 * layer + kv
            assert int(page_of(v, kv, 5).min()) == 20 + 2 * layer + kv
            assert int(page_of(v, kv, 3).count_nonzero()) == 0
    pa.map_pages([])  # nothing to do
    assert pa.alloc_pages(1) == [0]  # alloc_pages still takes the lowest free page
    pa.free_pages([2])
    assert int(page_of(views[1], 1, 2).count_nonzero()) == 0  # unmapped: zero page again
    assert int(page_of(views[1], 1, 5).min()) == 23


def test_bad_ids_change_nothing():
    b, vts, pa, views = per_layer()
    pa.map_pages([1])
    phys = b.physical_bytes()
    for bad, match in (([8], "out of range"), ([-1], "out of range"), ([1], "already in use"),
                       ([3, 3], "twice"), ([0, 1], "already in use"), ([2, 9], "out of range"),
                       (["a"], "not an int"), (7, "list of ints")):
        with pytest.raises(ValueError, match=match):
            pa.map_pages(bad)
        assert pa.num_in_use == 1 and b.physical_bytes() == phys
        assert not pa.is_in_use(0) and not pa.is_in_use(2) and not pa.is_in_use(3)
    pa.close()
    with pytest.raises(Exception, match="closed"):
        pa.map_pages([0])


def test_reserved_pages_are_taken_as_they_are():
    b, vts, pa, views = per_layer(max_reserved=4)
    pa.free_pages(pa.alloc_pages(3))  # pages 0-2 stay mapped as reserved
    page_of(views[0], 0, 1).fill_(9)  # writes to a reserved page land in its memory
    assert pa.num_reserved == 3
    phys = b.physical_bytes()
    pa.map_pages([1, 6])
    assert pa.num_reserved == 2 and pa.num_in_use == 2
    assert b.physical_bytes() == phys + 4 * U  # only page 6 was new
    assert int(page_of(views[0], 0, 1).min()) == 9


def test_out_of_memory_rolls_back_and_keeps_live_data():
    b, vts, pa, views = per_layer(limit_mb=2 + 3 * 8)  # zero page + 3 pages of 8 MiB
    pa.map_pages([0, 1])
    page_of(views[0], 1, 1).fill_(5)
    phys = b.physical_bytes()
    with pytest.raises(vmm.OutOfMemoryError, match="host budget"):
        pa.map_pages([4, 6])  # the first fits, the second does not
    assert b.physical_bytes() == phys and pa.num_in_use == 2
    assert not pa.is_in_use(4) and int(page_of(views[1], 0, 4).count_nonzero()) == 0
    assert int(page_of(views[0], 1, 1).min()) == 5
    pa.map_pages([6])
    assert pa.set_limit_pages(3)
    with pytest.raises(vmm.OutOfMemoryError, match="limit"):
        pa.map_pages([7])
    assert pa.num_in_use == 3


def test_gil_released_while_mapping():
    # one page per run keeps the native work of a call at 768 mappings (runs would make it 32)
    b, vts, pa, views = per_layer(limit_mb=4096, num_layers=16, num_pages=24, max_run_pages=1)
    # Each host map sleeps 100 us inside the native call, so a call lasts ~77 ms: long enough that
    # the spinner is scheduled even on a loaded 2-core CI machine if, and only if, the GIL is free
    # (CI of 44ed479 saw [0, 0, 0, 0, 0] with undelayed ~1 ms calls).
    b._set_map_delay_us(100)
    ticks = 0
    stop = threading.Event()

    def spin():
        nonlocal ticks
        while not stop.is_set():
            ticks += 1

    # A long switch interval means a call that holds the GIL never lets the spinner in (the main
    # thread is not asked to drop it between reading `before` and the call), so any progress
    # during a call is the call's own doing.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.2)
    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        time.sleep(0.05)
        turns = []
        for _ in range(3):  # 24 pages x 32 regions: 768 mappings of native work
            before = ticks
            pa.map_pages(list(range(24)))
            turns.append(ticks - before)
            pa.free_pages(list(range(24)))
    finally:
        stop.set()
        spinner.join(timeout=5)
        sys.setswitchinterval(interval)
        b._set_map_delay_us(0)
    assert max(turns) > 1000, f"a Python thread ran only {turns} loop turns while map_pages ran: the GIL was held"

"""Zero backing in chunks (VirtualTensor(..., zero_chunk=...)) on the host backend.

A chunked tensor backs unbacked memory with fewer, larger zero mappings; mapping a page
splits the chunk around it and unmapping gives the range back. Reads of unbacked memory
stay zero, live data survives every split, failures roll back.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvcached.layout import KVGeometry, KVSpec, Layout

vmm = pytest.importorskip("kvcached._vmm")

MiB = 1 << 20
U = 2 * MiB


pytestmark = pytest.mark.usefixtures("own_host_budget")


def host(limit_mb: int = 512) -> vmm.Backend:
    return vmm.Backend("host", host_limit_bytes=limit_mb * MiB)


def view(vt) -> torch.Tensor:
    return torch.from_dlpack(vt.to_dlpack())


@pytest.mark.parametrize("chunk", [3 * U, U // 2, 6 * U])
def test_bad_zero_chunk(chunk):
    with pytest.raises(ValueError, match="power of two"):
        vmm.VirtualTensor(host(), 32 * MiB, U, chunk)


def test_chunked_tensor_uses_few_mappings_and_reads_zero():
    b = host()
    vt = vmm.VirtualTensor(b, 64 * MiB + 6 * MiB, U, 16 * MiB)
    assert vt.zero_chunk == 16 * MiB
    # four 16 MiB chunks, then the 6 MiB tail as 4 + 2
    assert vt.num_zero_mappings == 6
    assert b.physical_bytes() == (2 + 4 + 8 + 16) * MiB  # one zero allocation per size
    assert int(view(vt).sum()) == 0
    plain = vmm.VirtualTensor(b, 8 * MiB, U)
    assert plain.zero_chunk == U and plain.num_zero_mappings == 4
    # a chunk larger than the tensor is capped at the tensor
    small = vmm.VirtualTensor(b, 4 * MiB, U, 64 * MiB)
    assert small.zero_chunk == 4 * MiB and small.num_zero_mappings == 1
    del vt, plain, small
    assert b.physical_bytes() == 0


def test_unbacked_writes_alias_at_equal_chunk_offsets():
    b = host()
    vt = vmm.VirtualTensor(b, 32 * MiB, U, 8 * MiB)
    x = view(vt)
    x[3 * U + 5] = 9  # unit 3 of chunk 0
    assert int(x[8 * MiB + 3 * U + 5]) == 9  # unit 3 of chunk 1: the same zero memory
    assert int(x[U + 5]) == 0  # another unit of the same chunk: other memory
    x[3 * U + 5] = 0


def test_split_and_regrow_keeps_data_and_zeros():
    b = host()
    pages = 24
    vt = vmm.VirtualTensor(b, pages * U, U, 16 * MiB)
    # one page per run, so a page freed between two in use is unmapped (a hole)
    pa = vmm.PageAllocator(b, [vt], [(0, 0, U)], pages, 0, 0, False, max_run_pages=1)
    x = view(vt)
    got = pa.alloc_pages(3)  # pages 0..2 split the first 16 MiB chunk
    assert got == [0, 1, 2]
    for p in got:
        x[p * U : (p + 1) * U] = p + 1
    assert int(x[3 * U :].sum()) == 0
    maps_after_split = vt.num_zero_mappings
    assert maps_after_split == 2 + 2  # units 3..7 of the first chunk as 4 + 1, two untouched chunks
    pa.free_pages([1])  # a hole in the middle goes back to zero
    assert int(x[U : 2 * U].sum()) == 0
    assert int(x[0]) == 1 and int(x[2 * U]) == 3
    again = pa.alloc_pages(1)
    assert again == [1] and int(x[U : 2 * U].sum()) == 0  # fresh memory
    pa.free_pages([0, 1, 2])
    assert int(x.sum()) == 0
    pa.close()
    del pa, x, vt
    assert b.physical_bytes() == 0


def test_failed_map_rolls_back_to_zero():
    pages = 16
    b = host(30 + 4)  # zero allocations (2+4+8+16 MiB) + 2 pages
    vt = vmm.VirtualTensor(b, pages * U, U, 16 * MiB)
    pa = vmm.PageAllocator(b, [vt], [(0, 0, U)], pages, 0, 0, False)
    x = view(vt)
    assert pa.alloc_pages(1) == [0]
    x[:U] = 7
    maps = vt.num_zero_mappings
    with pytest.raises(vmm.OutOfMemoryError):
        pa.alloc_pages(2)
    assert pa.num_in_use == 1 and int(x[:U].float().mean()) == 7
    assert int(x[U:].sum()) == 0
    assert vt.num_zero_mappings == maps
    assert pa.alloc_pages(1) == [1]
    pa.close()


@pytest.mark.parametrize("seed", [0, 1])
def test_per_layer_random_churn_against_model(seed):
    rng = random.Random(seed)
    spec = KVSpec(num_layers=2, num_blocks=24 * 512, block_size=16, num_kv_heads=2, head_size=64,
                  dtype=torch.float16)
    geom = KVGeometry(spec, Layout.PER_LAYER, U)
    b = host(1024)
    vts = [vmm.VirtualTensor(b, geom.tensor_bytes, geom.unit_bytes, 8 * MiB) for _ in range(geom.num_tensors)]
    plain_maps = geom.tensor_bytes // geom.unit_bytes
    assert all(v.num_zero_mappings < plain_maps // 3 for v in vts)
    pa = vmm.PageAllocator(b, vts, geom.regions(), geom.num_pages, 0, 0, False)
    bases = [view(v) for v in vts]
    live: dict[int, int] = {}
    marked: set[int] = set()  # mapped pages holding their marks (a freed page keeps them while its run is mapped)
    bpp = geom.blocks_per_page

    def mark(p: int, val: int) -> None:
        for layer in range(spec.num_layers):
            for kv in range(2):
                for blk in (p * bpp, p * bpp + bpp - 1):
                    t, off = geom.block_byte_offset(layer, kv, blk)
                    bases[t][off] = (val + layer * 2 + kv) % 251

    for step in range(60):
        if live and rng.random() < 0.45:
            drop = rng.sample(sorted(live), rng.randint(1, min(4, len(live))))
            pa.free_pages(drop)
            for p in drop:
                del live[p]
        else:
            n = rng.randint(1, 5)
            if len(live) + n > geom.num_pages:
                continue
            for p in pa.alloc_pages(n):
                live[p] = rng.randint(1, 200)
                mark(p, live[p])
                marked.add(p)
        mapped = {p for first, n, _ in pa.runs() for p in range(first, first + n)}
        assert set(live) <= mapped
        marked &= mapped  # unmapped runs read zero again
        for p, val in live.items():
            for layer in range(spec.num_layers):
                t, off = geom.block_byte_offset(layer, 1, p * bpp + bpp - 1)
                assert int(bases[t][off]) == (val + layer * 2 + 1) % 251
        if step % 5 == 4:  # the marks are the only nonzero bytes: everything else reads zero
            assert sum(int(torch.count_nonzero(x)) for x in bases) == 8 * len(marked)
    pa.close()
    assert all(int(torch.count_nonzero(x)) == 0 for x in bases)
    bases.clear()
    del pa, vts
    assert b.physical_bytes() == 0


def test_phase_times_count_the_steps():
    b = host()
    vt = vmm.VirtualTensor(b, 16 * U, U, 8 * U)
    pa = vmm.PageAllocator(b, [vt], [(0, 0, U)], 16, 0, 0, False)
    pa.free_pages(pa.alloc_pages(3))
    b.flush_releases()
    ph = pa.phase_times()
    assert ph["map.create"][1] == 1  # pages mapped together: one allocation (run), one mapping
    assert ph["map.map"][1] == 1 and ph["map.take_zero"][1] == 1 and ph["map.set_access"][1] == 1
    assert ph["unmap.unmap"][1] == 1 and ph["unmap.set_access"][1] == 1
    assert ph["unmap.give_zero"][1] == 1 and ph["unmap.release_deferred"][1] == 1
    # released after the call returned: by the backend's thread or by the flush
    assert ph.get("release.background", (0, 0))[1] + ph.get("release.flushed", (0, 0))[1] == 1
    assert all(us >= 0 for us, _ in ph.values())
    pa.reset_phase_times()
    assert pa.phase_times() == {}
    pa.close()


def test_bench_breakdown_on_host():
    bench = pytest.importorskip("kvcached._vmm_bench", reason="built only with KVCACHED_BUILD_BENCH=1")
    with pytest.raises(ValueError, match="num_units"):
        bench.bench_breakdown(host(), 8, U)
    r = bench.bench_breakdown(host(), 32, U)
    assert len(r["same.map"]) == 32 and len(r["dist.create"]) == 32
    assert r["partial_map_ok"] == [1.0]  # host maps a prefix of an allocation; CUDA refuses (801)
    assert not any(k.endswith(".failed") and k != "split.failed" for k in r)  # split needs 1024 units

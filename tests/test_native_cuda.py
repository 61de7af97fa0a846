"""The CUDA (or, on a ROCm build of torch, HIP) backend of kvcached._vmm.

Without a GPU only the clean-failure test runs; the rest carry ``@pytest.mark.gpu``.
"""

from __future__ import annotations

import ctypes.util
import gc

import pytest
import torch

from kvcached import errors

vmm = pytest.importorskip("kvcached._vmm")

MiB = 1 << 20
GPU_KIND = "hip" if getattr(torch.version, "hip", None) else "cuda"


def test_cuda_backend_without_driver_fails_cleanly():
    if torch.cuda.is_available() and GPU_KIND == "cuda":
        pytest.skip("a CUDA GPU is present")
    with pytest.raises((vmm.LibraryNotFoundError, vmm.NoDeviceError)) as info:
        vmm.Backend("cuda")
    msg = str(info.value)
    assert isinstance(info.value, errors.KVCachedError)
    if ctypes.util.find_library("cuda") is None:
        assert isinstance(info.value, vmm.LibraryNotFoundError)
        assert "libcuda.so.1" in msg and "host" in msg


# -- on a GPU ----------------------------------------------------------------------
@pytest.fixture
def backend():
    return vmm.Backend(GPU_KIND, torch.cuda.current_device())


def gpu_view(vt) -> torch.Tensor:
    t = torch.from_dlpack(vt.to_dlpack())
    assert t.is_cuda and t.data_ptr() == vt.ptr
    return t


@pytest.mark.gpu
def test_gpu_backend_basics(backend):
    assert backend.granularity > 0 and (2 * MiB) % backend.granularity == 0
    free, total = backend.mem_info()
    assert 0 < free <= total
    assert backend.dlpack_device() == ((10 if GPU_KIND == "hip" else 2), torch.cuda.current_device())
    with pytest.raises(ValueError, match="granularity"):
        vmm.VirtualTensor(backend, 8 * MiB, 4096)
    with pytest.raises(ValueError):
        backend.set_host_limit(1 << 30)


@pytest.mark.gpu
def test_gpu_mapping_semantics(backend):
    u = 2 * MiB
    vt = vmm.VirtualTensor(backend, 8 * u, u)
    pa = vmm.PageAllocator(backend, [vt], [(0, 0, u)], 8, 0, 0, False)
    x = gpu_view(vt)
    assert int(x.sum()) == 0  # unbacked memory is the zeroed zero page
    assert pa.alloc_pages(2) == [0, 1]
    x[:u] = 1
    x[u : 2 * u] = 2
    x[2 * u : 3 * u] = 3  # zero page: aliases every unbacked unit
    torch.cuda.synchronize()
    assert int(x[7 * u + 5]) == 3
    assert int(x[5]) == 1 and int(x[u + 5]) == 2
    x[2 * u : 3 * u] = 0
    assert pa.runs() == [(0, 2, 2)]  # mapped together: one run
    pa.free_pages([0])
    torch.cuda.synchronize()
    assert int(x[5]) == 1 and int(x[u + 5]) == 2  # page 1 keeps the run (and page 0) mapped
    pa.free_pages([1])
    pa.map_pages([1])  # a run of its own
    x[u : 2 * u] = 2
    torch.cuda.synchronize()
    assert int(x[5]) == 0 and int(x[u + 5]) == 2  # page 0 is the zero page again
    pa.close()
    torch.cuda.synchronize()
    assert int(x[u + 5]) == 0


@pytest.mark.gpu
def test_gpu_tensor_outlives_python_object(backend):
    vt = vmm.VirtualTensor(backend, 16 * MiB, 2 * MiB)
    x = gpu_view(vt)
    del vt
    gc.collect()
    x.fill_(0)
    x[3] = 4
    torch.cuda.synchronize()
    assert int(x[2 * MiB + 3]) == 4
    x.zero_()
    del x
    gc.collect()


@pytest.mark.gpu
def test_gpu_memory_falls_and_rises(backend):
    unit = 64 * MiB
    pages = 8
    vt = vmm.VirtualTensor(backend, pages * unit, unit)
    pa = vmm.PageAllocator(backend, [vt], [(0, 0, unit)], pages, 0, pages, False)

    def free_mb() -> float:
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0] / MiB

    f0 = free_mb()
    got = pa.alloc_pages(pages)
    f1 = free_mb()
    assert f0 - f1 >= 0.9 * pages * unit / MiB
    pa.free_pages(got)  # kept as reserved pages (max_reserved = pages)
    assert pa.num_reserved == pages
    assert free_mb() <= f1 + 64
    pa.trim()
    f2 = free_mb()
    assert f2 - f1 >= 0.9 * pages * unit / MiB
    assert backend.physical_bytes() == unit  # only the zero page left
    pa.close()


@pytest.mark.gpu
def test_gpu_zero_page_aliasing_beyond_l2(backend):
    # 256 MiB of unbacked writes (larger than any L2) all land on one 2 MiB zero page.
    unit = 2 * MiB
    vt = vmm.VirtualTensor(backend, 512 * MiB, unit)
    pa = vmm.PageAllocator(backend, [vt], [(0, 0, unit)], 256, 0, 0, False)
    x = gpu_view(vt)
    pa.alloc_pages(1)  # page 0 is real memory
    x[:unit] = 9
    for k in range(128):  # one kernel per unit, in stream order: the last write wins everywhere
        x[(1 + k) * unit : (2 + k) * unit].fill_(k + 1)
    torch.cuda.synchronize()
    for u in (1, 77, 128, 255):
        part = x[u * unit : (u + 1) * unit]
        assert int(part.min()) == 128 == int(part.max())
    assert int(x[:unit].min()) == 9 == int(x[:unit].max())  # the real page is untouched
    x[unit : 2 * unit] = 0
    pa.close()


@pytest.mark.gpu
def test_gpu_per_layer_pool_and_blocks(backend):
    from kvcached.layout import KVGeometry, KVSpec, Layout

    spec = KVSpec(num_layers=4, num_blocks=512, block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    geom = KVGeometry(spec, Layout.PER_LAYER, 2 * MiB)
    vts = [vmm.VirtualTensor(backend, geom.tensor_bytes, geom.unit_bytes) for _ in range(geom.num_tensors)]
    pa = vmm.PageAllocator(backend, vts, geom.regions(), geom.num_pages, 1, 2, True)
    pool = vmm.BlockPool(pa, geom.blocks_per_page, geom.num_blocks)
    bases = [gpu_view(v) for v in vts]
    ids = pool.alloc(3 * geom.blocks_per_page)
    assert ids is not None and pa.num_in_use == 3
    for layer in range(spec.num_layers):
        for kv in range(2):
            t, off = geom.block_byte_offset(layer, kv, ids[-1])
            bases[t][off : off + 16] = layer * 2 + kv + 1
    torch.cuda.synchronize()
    for layer in range(spec.num_layers):
        for kv in range(2):
            t, off = geom.block_byte_offset(layer, kv, ids[-1])
            assert int(bases[t][off]) == layer * 2 + kv + 1
    pool.free(ids)
    assert pool.num_allocated() == 0
    pa.close()


@pytest.mark.gpu
def test_gpu_bench_driver_calls(backend):
    bench = pytest.importorskip("kvcached._vmm_bench", reason="built only with KVCACHED_BUILD_BENCH=1")
    r = bench.bench_driver_calls(backend, 8, 2 * MiB)
    assert len(r["create"]) == 8 and len(r["set_access"]) == 8


@pytest.mark.gpu
def test_gpu_zero_chunks_split_and_regrow(backend):
    pages = 40
    vt = vmm.VirtualTensor(backend, pages * 2 * MiB, 2 * MiB, 16 * MiB)
    assert vt.num_zero_mappings == 5
    # one page per run, so a page freed between two in use is unmapped (a hole)
    pa = vmm.PageAllocator(backend, [vt], [(0, 0, 2 * MiB)], pages, 0, 0, False, max_run_pages=1)
    x = gpu_view(vt)
    assert pa.alloc_pages(3) == [0, 1, 2]
    for p in range(3):
        x[p * 2 * MiB : (p + 1) * 2 * MiB] = p + 1
    pa.free_pages([1])
    torch.cuda.synchronize()
    assert int(x[2 * MiB : 4 * MiB].sum()) == 0 and int(x[6 * MiB :].sum()) == 0
    assert int(x[0]) == 1 and int(x[4 * MiB]) == 3
    assert pa.alloc_pages(1) == [1]
    pa.free_pages([0, 1, 2])
    assert int(x.sum()) == 0
    pa.close()


@pytest.mark.gpu
@pytest.mark.parametrize("zero_chunk", [0, 16 * MiB])
def test_gpu_runs_keep_data_and_release_whole(backend, zero_chunk):
    from kvcached.layout import KVGeometry, KVSpec, Layout

    spec = KVSpec(num_layers=4, num_blocks=16 * 512, block_size=16, num_kv_heads=2, head_size=64,
                  dtype=torch.float16)
    geom = KVGeometry(spec, Layout.PER_LAYER, 2 * MiB)
    vts = [vmm.VirtualTensor(backend, geom.tensor_bytes, geom.unit_bytes, zero_chunk)
           for _ in range(geom.num_tensors)]
    base = backend.physical_bytes()
    pa = vmm.PageAllocator(backend, vts, geom.regions(), geom.num_pages, 0, 0, False, max_run_pages=4)
    x = [gpu_view(v) for v in vts]
    regions = geom.regions()
    assert pa.alloc_pages(6) == list(range(6))
    assert pa.runs() == [(0, 4, 4), (4, 2, 2)]
    creates = 2 if backend.map_offset_ok else 2 * len(regions)
    ph = pa.phase_times()
    assert ph["map.create"][1] == creates and ph["map.map"][1] == 2 * len(regions)
    assert ph["map.set_access"][1] == len(regions)
    for p in range(6):
        for i, r in enumerate(regions):
            x[r.tensor][r.base + p * r.size : r.base + (p + 1) * r.size] = (p * 16 + i) % 251 + 1
    pa.free_pages([0, 2, 4, 5])  # run [4..5] goes whole; run [0..3] stays for pages 1 and 3
    torch.cuda.synchronize()
    assert pa.runs() == [(0, 4, 2)]
    for p in range(6):
        for i, r in enumerate(regions):
            part = x[r.tensor][r.base + p * r.size : r.base + (p + 1) * r.size]
            want = 0 if p >= 4 else (p * 16 + i) % 251 + 1
            assert int(part.min()) == want == int(part.max())
    backend.flush_releases()  # the unmapped run's release is deferred: flush to count it
    assert backend.physical_bytes() == base + 4 * pa.page_bytes
    pa.free_pages([1, 3])
    backend.flush_releases()
    assert pa.runs() == [] and backend.physical_bytes() == base
    torch.cuda.synchronize()
    assert all(int(t.sum()) == 0 for t in x)
    pa.close()

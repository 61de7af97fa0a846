"""The public API on kvcached's module paths, the runtime's life cycle, and the env-derived constants."""

from __future__ import annotations

import os
import re
import uuid

import pytest
import torch

from kvcached import _vmm, utils, vmm_ops
from kvcached.backend import choose_backend
from kvcached.errors import KVCachedConfigError, KVCachedStateError
from kvcached.kv_cache_manager import KVCacheManager

MiB = 1 << 20


@pytest.fixture(autouse=True)
def own_host_budget(monkeypatch: pytest.MonkeyPatch):
    """Host backends share one budget per /dev/shm segment: give each test its own segment."""
    name = f"kvcached_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("KVCACHED_HOST_SHM_NAME", name)
    yield
    _vmm.unlink_host_shm(name)


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("KVCACHED_IPC_NAME", f"kvcached_test_{os.getpid()}_{uuid.uuid4().hex[:8]}")
    yield monkeypatch
    if vmm_ops.is_initialized():
        vmm_ops.shutdown_kvcached()


def test_public_names_exist() -> None:
    import kvcached.cli.utils as cu
    import kvcached.integration.sglang.interfaces as sg
    import kvcached.integration.vllm.interfaces as vi

    for mod, names in (
        (vmm_ops, ["init_kvcached", "shutdown_kvcached", "create_kv_tensors", "kv_tensors_created",
                   "map_to_kv_tensors", "unmap_from_kv_tensors", "PageAllocator"]),
        (vi, ["init_kvcached", "alloc_kv_cache", "get_kv_cache_manager", "shutdown_kvcached"]),
        (sg, ["init_kvcached", "alloc_kv_cache", "get_kv_cache_manager", "shutdown_kvcached"]),
        (utils, ["PAGE_SIZE", "DEFAULT_IPC_NAME", "CONTIGUOUS_LAYOUT", "SHM_DIR", "get_kvcached_logger"]),
        (cu, ["get_kv_cache_limit", "update_kv_cache_limit"]),
    ):
        for name in names:
            assert getattr(mod, name) is not None, f"{mod.__name__}.{name}"
    for method in ("alloc", "free", "try_to_reserve", "free_reserved", "trim", "resize", "available_size", "clear",
                   "get_mapped_memory_size"):
        assert callable(getattr(KVCacheManager, method))


def test_constants_follow_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVCACHED_PAGE_SIZE_MB", raising=False)
    assert utils.PAGE_SIZE == 2 * MiB
    monkeypatch.setenv("KVCACHED_PAGE_SIZE_MB", "4")
    assert utils.PAGE_SIZE == 4 * MiB
    monkeypatch.setenv("KVCACHED_CONTIGUOUS_LAYOUT", "false")
    assert utils.CONTIGUOUS_LAYOUT is False
    monkeypatch.delenv("KVCACHED_CONTIGUOUS_LAYOUT")
    assert utils.CONTIGUOUS_LAYOUT is (not getattr(torch.version, "hip", None))
    assert utils.default_contiguous_layout("hip") is False and utils.default_contiguous_layout("host") is True
    monkeypatch.setenv("KVCACHED_IPC_NAME", "my-engine_1")
    assert utils.DEFAULT_IPC_NAME == "my-engine_1"
    monkeypatch.setenv("KVCACHED_IPC_NAME", "my engine/1")  # refused, not rewritten: kvctl finds the name as set
    with pytest.raises(KVCachedConfigError, match="KVCACHED_IPC_NAME='my engine/1' holds ' /'"):
        _ = utils.DEFAULT_IPC_NAME
    monkeypatch.delenv("KVCACHED_IPC_NAME")
    # the engine tag depends on which engine this process has imported (the e2e tests import vLLM)
    assert re.match(rf"kvcached_(proc|vLLM|SGLang)_{os.getpgid(0)}(_\d+)?$", utils.DEFAULT_IPC_NAME)
    assert utils.SHM_DIR == "/dev/shm"
    with pytest.raises(AttributeError):
        _ = utils.NO_SUCH_CONSTANT


def test_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVCACHED_BACKEND", raising=False)
    assert choose_backend("cpu").kind == "host"
    gpu = "hip" if getattr(torch.version, "hip", None) else "cuda"
    assert choose_backend("cuda:1") == type(choose_backend("cpu"))(gpu, 1)
    assert choose_backend(torch.device("cuda", 2)).index == 2
    assert choose_backend("hip:0").kind == "hip"
    monkeypatch.setenv("KVCACHED_BACKEND", "host")
    assert choose_backend("cuda:0").kind == "host"


@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "per_layer"])
def test_kv_tensors_are_zero_copy_and_read_zero(fresh: pytest.MonkeyPatch, contiguous: bool) -> None:
    vmm_ops.init_kvcached("cpu", contiguous_layout=contiguous)
    assert vmm_ops.backend_name() == "host"
    assert not vmm_ops.kv_tensors_created()
    ts = vmm_ops.create_kv_tensors(4 * 2 * MiB, 2, "cpu", 3)
    assert vmm_ops.kv_tensors_created() and not vmm_ops.kv_tensors_created(1)
    assert len(ts) == (1 if contiguous else 3)
    assert all(t.dtype == torch.uint8 and t.dim() == 1 for t in ts)
    assert sum(t.numel() for t in ts) == 3 * 4 * 2 * MiB
    group = vmm_ops.get_group(0)
    assert [t.data_ptr() for t in ts] == [vt.ptr for vt in group.vtensors]  # zero-copy
    assert all(int(t.count_nonzero()) == 0 for t in ts)  # unmapped memory reads zeros
    m = KVCacheManager(2 * 512, 16, 256, 3)
    blocks = m.alloc(600)
    assert blocks is not None and m.get_mapped_memory_size("mb") == 2 * 3 * 2 * 2


def test_life_cycle(fresh: pytest.MonkeyPatch) -> None:
    for _ in range(2):  # init -> use -> shutdown, twice in one process
        vmm_ops.init_kvcached("cpu")
        vmm_ops.create_kv_tensors(4 * MiB, 2, "cpu", 1)
        m = KVCacheManager(512, 16, 256, 1)
        assert m.alloc(1) is not None
        vmm_ops.shutdown_kvcached()
        with pytest.raises(KVCachedStateError, match="closed|shut down"):
            m.alloc(1)
    with pytest.raises(KVCachedStateError, match="not initialized"):
        vmm_ops.shutdown_kvcached()


def test_manager_waits_for_tensors_made_later(fresh: pytest.MonkeyPatch) -> None:
    import threading

    vmm_ops.init_kvcached("cpu")
    m = KVCacheManager(512, 16, 256, 1)  # before the tensors exist, as in an engine's scheduler
    t = threading.Timer(0.1, lambda: vmm_ops.create_kv_tensors(4 * MiB, 2, "cpu", 1))
    t.start()
    got = m.alloc(5)  # waits for the tensors
    t.join()
    assert got is not None and len(got) == 5


def test_explicit_map_and_unmap(fresh: pytest.MonkeyPatch) -> None:
    vmm_ops.init_kvcached("cpu", contiguous_layout=False)
    ts = vmm_ops.create_kv_tensors(4 * 2 * MiB, 2, "cpu", 2)
    ps = vmm_ops.runtime().page_size
    assert vmm_ops.map_to_kv_tensors([ps])  # page 1 of every layer's K and V
    ts[1][ps:2 * ps].fill_(7)
    assert int(ts[1][ps:2 * ps].min()) == 7
    assert vmm_ops.unmap_from_kv_tensors([ps])
    assert int(ts[1].count_nonzero()) == 0


def test_explicit_unmap_of_one_page_of_a_batch_returns_its_memory(fresh: pytest.MonkeyPatch) -> None:
    # pages the caller maps together are still unmapped one by one: "they read as zeros again"
    vmm_ops.init_kvcached("cpu", contiguous_layout=False)
    ps, backend = vmm_ops.runtime().page_size, vmm_ops.runtime().backend
    ts = vmm_ops.create_kv_tensors(2 * 4 * ps, 2, "cpu", 2)  # 4 pages of K and V per layer
    before = backend.physical_bytes()
    assert vmm_ops.map_to_kv_tensors([0, ps, 2 * ps])
    for t in ts:
        t[: 3 * ps].fill_(5)
    assert vmm_ops.unmap_from_kv_tensors([ps])
    backend.flush_releases()  # unmapped at once; the memory goes back on the backend's thread, or now
    assert backend.physical_bytes() - before == 2 * 2 * 2 * ps  # pages 0 and 2 of 2 layers, K and V
    assert all(int(t[ps : 2 * ps].count_nonzero()) == 0 and int(t[:ps].min()) == 5 for t in ts)
    assert vmm_ops.unmap_from_kv_tensors([0, 2 * ps])


@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "per_layer"])
def test_explicit_map_reaches_every_layer_and_rejects_misuse(fresh: pytest.MonkeyPatch, contiguous: bool) -> None:
    vmm_ops.init_kvcached("cpu", contiguous_layout=contiguous)
    rt = vmm_ops.runtime()
    ps, layers, pages = rt.page_size, 3, 4
    ts = vmm_ops.create_kv_tensors(pages * 2 * ps, 2, "cpu", layers)
    geom = vmm_ops.get_group(0).geometry
    backend = rt.backend
    before = backend.physical_bytes()
    assert vmm_ops.map_to_kv_tensors([2 * ps, 0])
    assert backend.physical_bytes() - before == 2 * layers * 2 * ps  # pages 0 and 2 of every layer, K and V
    for i, r in enumerate(geom.regions()):  # every region of the mapped pages is real, distinct memory
        for p in (0, 2):
            ts[r.tensor][r.base + p * r.size : r.base + (p + 1) * r.size].fill_(i + 1)
    for i, r in enumerate(geom.regions()):
        for p in (0, 2):
            assert int(ts[r.tensor][r.base + p * r.size : r.base + (p + 1) * r.size].min()) == i + 1
    for bad, match in (([ps, ps], "twice"), ([0], "already in use"), ([ps + 1], "multiple of the page size"),
                       ([pages * ps], "beyond"), ([-ps], "non-negative")):
        with pytest.raises(ValueError, match=match):
            vmm_ops.map_to_kv_tensors(bad)
    with pytest.raises(ValueError, match="not in use"):
        vmm_ops.unmap_from_kv_tensors([ps])
    assert vmm_ops.unmap_from_kv_tensors([0, 2 * ps])
    backend.flush_releases()
    assert backend.physical_bytes() == before
    assert all(int(t.count_nonzero()) == 0 for t in ts)


@pytest.mark.gpu
@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "per_layer"])
def test_gpu_views_and_physical_memory(fresh: pytest.MonkeyPatch, contiguous: bool) -> None:
    import kvcached.integration.vllm.interfaces as vi

    fresh.setenv("KVCACHED_MIN_RESERVED_PAGES", "0")
    fresh.setenv("KVCACHED_MAX_RESERVED_PAGES", "0")
    vi.init_kvcached(device="cuda:0", contiguous_layout=contiguous)
    try:
        layers, heads, head, bs = 32, 8, 128, 16
        views = vi.alloc_kv_cache((2, 1, bs, heads, head), bs, torch.bfloat16, "cuda:0", layers)
        m = vi.get_kv_cache_manager(views[0].shape[1], bs, heads * head * 2, layers)
        torch.cuda.synchronize()
        free0 = torch.cuda.mem_get_info()[0]
        blocks = m.alloc(64 * 8)  # 8 page groups of 128 MiB = 1 GiB
        assert blocks is not None
        free1 = torch.cuda.mem_get_info()[0]
        assert free0 - free1 >= 8 * m.page_group_bytes - 64 * MiB
        for layer, v in enumerate(views):
            v[:, blocks] = float(layer)  # index assignment writes in place (v[:, blocks] is a copy)
        for layer, v in enumerate(views):
            assert torch.equal(v[:, blocks], torch.full_like(v[:, blocks], float(layer)))
        m.free(blocks[1:])
        m.trim()
        torch.cuda.synchronize()
        assert torch.cuda.mem_get_info()[0] - free1 >= 6 * m.page_group_bytes
        assert torch.equal(views[3][:, blocks[0]], torch.full_like(views[3][:, blocks[0]], 3.0))
    finally:
        vi.shutdown_kvcached()

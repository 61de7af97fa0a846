"""Pages grow to fit KV blocks that do not divide 2 MiB (vLLM's Mamba hybrids on a GPU), or say why they cannot.

On the H200, vLLM 0.24 gives a tiny Granite-4.0-H's attention layers blocks of 96 tokens
(12288 B of one layer's K) so that a block holds a Mamba state; such blocks straddle 2 MiB
pages, and kvcached refused the engine. Host backend, vLLM's interface module.
"""

from __future__ import annotations

import os
import uuid

import pytest
import torch

from kvcached import vmm_ops
from kvcached.errors import KVCachedConfigError
from kvcached.integration.vllm import interfaces as vi

MiB = 1 << 20
LAYERS, HEADS, HEAD = 2, 2, 32
DTYPE = torch.bfloat16


@pytest.fixture(autouse=True)
def runtime(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("KVCACHED_IPC_NAME", f"kvcached_test_{os.getpid()}_{uuid.uuid4().hex[:8]}")
    monkeypatch.setenv("KVCACHED_HOST_MEM_LIMIT_MB", "256")
    monkeypatch.delenv("KVCACHED_PAGE_SIZE_MB", raising=False)
    yield monkeypatch
    if vmm_ops.is_initialized():
        vmm_ops.shutdown_kvcached()


def _shape(block: int) -> tuple[int, ...]:
    return (2, 1, block, HEADS, HEAD)


def test_blocks_of_48_tokens_get_6_mib_pages_and_never_alias() -> None:
    vi.init_kvcached("cpu")
    views, meta = vi.alloc_kv_cache(_shape(48), 48, DTYPE, "cpu", LAYERS, return_meta=True)
    block_bytes = 48 * HEADS * HEAD * 2  # 6144 B: 2 MiB / 6144 is not whole, 6 MiB / 6144 = 1024
    assert vmm_ops.runtime().page_size == 6 * MiB
    assert meta["geometry"].page_size == 6 * MiB and meta["geometry"].blocks_per_page == 1024
    assert meta["gpu_mem_bytes_per_layer_k_or_v"] % (6 * MiB) == 0
    mgr = vi.get_kv_cache_manager(meta["num_blocks_per_layer"], 48, HEADS * HEAD * 2, LAYERS)
    try:
        assert mgr.page_size == 6 * MiB
        ids = mgr.alloc(1500)  # more than one page's 1024 blocks: the second page is mapped too
        assert ids is not None and len(ids) == 1500
        assert mgr.get_mapped_memory_size() >= 2 * 6 * MiB * LAYERS * 2
        k = views[0][0]  # layer 0's K: (blocks, 48, heads, head)
        for i, b in enumerate(ids):
            k[b].fill_(float(i % 251))
        for i, b in enumerate(ids):  # no block's write reached another block
            assert torch.all(k[b] == float(i % 251)), f"block {b} was overwritten"
        assert k[ids[0]].numel() * k.element_size() == block_bytes
        mgr.free(ids)
    finally:
        mgr.close()


def test_a_page_the_user_chose_stays_and_the_misfit_is_reported(runtime: pytest.MonkeyPatch) -> None:
    runtime.setenv("KVCACHED_PAGE_SIZE_MB", "2")
    vi.init_kvcached("cpu")
    with pytest.raises(KVCachedConfigError, match="does not divide the 2 MiB page.*the page size was chosen"):
        vi.alloc_kv_cache(_shape(48), 48, DTYPE, "cpu", LAYERS)
    assert vmm_ops.runtime().page_size == 2 * MiB


def test_the_page_cannot_change_under_existing_kv_tensors() -> None:
    vi.init_kvcached("cpu")
    vi.alloc_kv_cache(_shape(16), 16, DTYPE, "cpu", LAYERS, group_id=0)
    with pytest.raises(KVCachedConfigError, match="KV tensors exist already"):
        vi.alloc_kv_cache(_shape(48), 48, DTYPE, "cpu", LAYERS, group_id=1)
    assert vmm_ops.runtime().page_size == 2 * MiB


def test_no_page_grows_past_the_bound() -> None:
    vi.init_kvcached("cpu")
    # 16 tokens x 1 head x 125 x 2 B = 4000 B = 2^5 x 125: whole blocks first fill 250 MiB
    with pytest.raises(KVCachedConfigError, match="fill no page up to 64 MiB"):
        vi.alloc_kv_cache((2, 1, 16, 1, 125), 16, DTYPE, "cpu", LAYERS)
    assert vmm_ops.runtime().page_size == 2 * MiB


def test_fit_page_size_checks_its_argument() -> None:
    vi.init_kvcached("cpu")
    with pytest.raises(KVCachedConfigError, match="block_bytes must be a positive int"):
        vmm_ops.fit_page_size(0)
    assert vmm_ops.fit_page_size(4096) == 2 * MiB  # blocks that divide the page change nothing

"""Zeroing new blocks clears exactly their pages, in every slot, in both layouts (``kv_zero``)."""

from __future__ import annotations

import os

import pytest
import torch

from kvcached.integration.vllm import interfaces, kv_alloc, kv_zero

BLOCK, CELL, SLOTS = 16, 4096, 3  # 64 KiB pages: 32 blocks per 2 MiB page


@pytest.fixture(params=["contiguous", "per_layer"])
def placed(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("KVCACHED_HOST_MEM_LIMIT_MB", "256")
    monkeypatch.setenv("KVCACHED_IPC_NAME", f"kvcached_e2e_zero_{os.getpid()}")
    interfaces.init_kvcached(device="cpu", contiguous_layout=request.param == "contiguous")
    yield request.param
    interfaces.shutdown_kvcached()
    kv_alloc.reset()


@pytest.mark.parametrize("kv_factor", [1, 2])
def test_zeroer_clears_exactly_the_new_blocks(placed: str, kv_factor: int) -> None:
    _, meta, group = kv_alloc._place(64, BLOCK, CELL // kv_factor, SLOTS, kv_factor, "cpu")
    info = kv_alloc.pool_info()
    manager = interfaces.get_kv_cache_manager(info.num_blocks, BLOCK, info.cell_size, SLOTS,
                                              num_kv_buffers=kv_factor, group_id=group)
    try:
        held = manager.alloc(40)  # maps two pages' worth of blocks 1..40 (block 0 is the null block)
        assert held is not None
        geom, raws = meta["geometry"], meta["raw_kv_tensors"]
        regions = kv_zero.plan_regions(geom, raws)
        if placed == "contiguous":
            assert len(regions) == 1 and regions[0].length == SLOTS * CELL * BLOCK
        else:
            assert len(regions) == SLOTS * kv_factor

        def pages(block: int) -> list[torch.Tensor]:  # every byte of one block, as the layout places it
            out = []
            for layer in range(SLOTS):
                for kv in range(kv_factor):
                    t, off = geom.block_byte_offset(layer, kv, block)
                    out.append(raws[t].view(torch.uint8)[off:off + BLOCK * CELL // kv_factor])
            return out

        for b in held:
            for p in pages(b):
                p.fill_(0xAB)
        zeroer = kv_zero.SlotZeroer("cpu")
        zeroer.zero_block_ids([3, 17, 33])
        for b in held:
            want = 0 if b in (3, 17, 33) else 0xAB
            assert all(bool((p == want).all()) for p in pages(b)), f"block {b}: expected {want:#x} everywhere"
    finally:
        manager.close()


def test_zeroer_without_a_placement_does_nothing() -> None:
    kv_zero.reset()
    kv_zero.SlotZeroer("cpu").zero_block_ids([1, 2])  # vLLM's own allocator placed this cache (profiling)

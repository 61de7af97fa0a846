"""Engine-facing views (vLLM FlashAttention / FlashInfer / MLA, SGLang MHA / MLA) in both
layouts: live blocks keep their contents while other blocks grow, shrink, trim and resize."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from kvcached.errors import KVCachedConfigError
from kvcached.integration.sglang import interfaces as sg
from kvcached.integration.vllm import interfaces as vi

LAYERS, HEADS, HEAD, BS = 2, 2, 64, 16
DTYPE = torch.float16


@dataclass
class Case:
    mgr: object
    write: Callable[[int, float], None]  # fill every element of block b (all layers, K and V)
    read: Callable[[int], list[torch.Tensor]]  # the block's pieces, in write order
    expect: Callable[[int, float], list[float]]


def _vllm(style: str) -> Case:
    vi.init_kvcached(device="cpu")
    if style == "mla":
        shape: tuple[int, ...] = (1000, BS, HEAD)
        views = vi.alloc_kv_cache(shape, BS, DTYPE, "cpu", LAYERS, attention_type="MLA")
        mgr = vi.get_kv_cache_manager(len(views[0]) // 2, BS, HEAD * 2, LAYERS, num_kv_buffers=1)
        assert views[0].shape[1:] == (BS, HEAD)

        def parts(b: int) -> list[torch.Tensor]:
            return [v[b] for v in views]

        def expect(b: int, x: float) -> list[float]:
            return [x + layer for layer in range(LAYERS)]
    else:
        shape = (2, 1000, BS, HEADS, HEAD) if style == "flash_attn" else (1000, 2, BS, HEADS, HEAD)
        views = vi.alloc_kv_cache(shape, BS, DTYPE, "cpu", LAYERS)
        n = views[0].shape[1] if style == "flash_attn" else views[0].shape[0]
        assert views[0].shape == ((2, n, BS, HEADS, HEAD) if style == "flash_attn" else (n, 2, BS, HEADS, HEAD))
        mgr = vi.get_kv_cache_manager(n // 2, BS, HEADS * HEAD * 2, LAYERS)

        def parts(b: int) -> list[torch.Tensor]:
            if style == "flash_attn":
                return [v[kv, b] for v in views for kv in (0, 1)]
            return [v[b, kv] for v in views for kv in (0, 1)]

        def expect(b: int, x: float) -> list[float]:
            return [(x + layer) * (1 if kv == 0 else -1) for layer in range(LAYERS) for kv in (0, 1)]

    def write(b: int, x: float) -> None:
        for t, val in zip(parts(b), expect(b, x), strict=True):
            t.fill_(val)

    return Case(mgr, write, parts, expect)


def _sglang(kind: str) -> Case:
    sg.init_kvcached(device="cpu")
    page = 16  # SGLang's paged allocator (FA3, FlashMLA) on either layout
    if kind == "mla":
        bufs = sg.alloc_kv_cache((1000, 1, HEAD), DTYPE, "cpu", LAYERS, page_size=page, attention_type="MLA")
        assert bufs[0].shape[1:] == (1, HEAD)
        tokens = bufs[0].shape[0]
        mgr = sg.get_kv_cache_manager(tokens // page // 2, page, HEAD * 2, LAYERS, num_kv_buffers=1)

        def parts(b: int) -> list[torch.Tensor]:
            return [buf[b * page:(b + 1) * page] for buf in bufs]

        def expect(b: int, x: float) -> list[float]:
            return [x + layer for layer in range(LAYERS)]
    else:
        ks, vs = sg.alloc_kv_cache((1000, HEADS, HEAD), DTYPE, "cpu", LAYERS, page_size=page)
        assert ks[0].shape[1:] == (HEADS, HEAD) and len(vs) == LAYERS
        tokens = ks[0].shape[0]
        mgr = sg.get_kv_cache_manager(tokens // page // 2, page, HEADS * HEAD * 2, LAYERS)

        def parts(b: int) -> list[torch.Tensor]:
            return [buf[layer][b * page:(b + 1) * page] for layer in range(LAYERS) for buf in (ks, vs)]

        def expect(b: int, x: float) -> list[float]:
            return [(x + layer) * (1 if kv == 0 else -1) for layer in range(LAYERS) for kv in (0, 1)]

    def write(b: int, x: float) -> None:
        for t, val in zip(parts(b), expect(b, x), strict=True):
            t.fill_(val)

    return Case(mgr, write, parts, expect)


STYLES = ["vllm-flash_attn", "vllm-flashinfer", "vllm-mla", "sglang-mha", "sglang-mla"]


@pytest.fixture(params=[True, False], ids=["contiguous", "per_layer"])
def layout_env(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("KVCACHED_IPC_NAME", f"kvcached_test_{os.getpid()}_{uuid.uuid4().hex[:8]}")
    monkeypatch.setenv("KVCACHED_HOST_MEM_LIMIT_MB", "64")
    monkeypatch.setenv("KVCACHED_CONTIGUOUS_LAYOUT", "true" if request.param else "false")
    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "1")
    monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", "2")
    yield request.param
    vi.shutdown_kvcached()
    sg.shutdown_kvcached()


def _stamp(b: int) -> float:
    return float(b % 500)


def _intact(case: Case, blocks: list[int]) -> None:
    for b in blocks:
        for t, val in zip(case.read(b), case.expect(b, _stamp(b)), strict=True):
            assert torch.equal(t, torch.full_like(t, val)), f"block {b} changed"


@pytest.mark.parametrize("style", STYLES)
def test_views_keep_live_blocks(layout_env: bool, style: str) -> None:
    case = _vllm(style.split("-")[1]) if style.startswith("vllm") else _sglang(style.split("-")[1])
    m = case.mgr
    live = m.alloc(40)
    assert live is not None
    for b in live:
        case.write(b, _stamp(b))
    grow = m.alloc(m.available_size())  # every page mapped
    assert grow is not None and not set(grow) & set(live)
    for b in grow[:: max(1, len(grow) // 64)]:
        case.write(b, _stamp(b))
    _intact(case, live)
    m.free(grow)  # shrink
    m.trim()
    _intact(case, live)
    assert m.resize(2 << 20) in (True, False)  # shrink the cap to one page
    _intact(case, live)
    assert m.resize(1 << 40) is True  # and grow it back (capped at capacity)
    again = m.alloc(100)
    assert again is not None
    for b in again:
        case.write(b, _stamp(b) + 0.5)
    _intact(case, live)
    m.free(again)
    m.trim()
    _intact(case, live)
    # a freed and trimmed page reads as zeros again (it went back to the zero page)
    lonely = [b for b in again if b // m.blocks_per_page not in {x // m.blocks_per_page for x in live}]
    if lonely:
        assert all(torch.count_nonzero(t) == 0 for t in case.read(lonely[0]))


def test_vllm_kernel_block_size_on_per_layer(layout_env: bool) -> None:
    vi.init_kvcached(device="cpu")
    shape = (2, 1000, 32, HEADS, HEAD)
    if layout_env:
        with pytest.raises(KVCachedConfigError, match="per-layer"):
            vi.alloc_kv_cache(shape, 32, DTYPE, "cpu", LAYERS, kernel_block_size=16)
        return
    views = vi.alloc_kv_cache(shape, 32, DTYPE, "cpu", LAYERS, kernel_block_size=16)
    n_kernel = views[0].shape[1]
    m = vi.get_kv_cache_manager(n_kernel // 2 // 2, 32, HEADS * HEAD * 2, LAYERS)
    (b,) = m.alloc(1)
    # virtual block b is kernel blocks 2b and 2b+1
    views[0][0, 2 * b].fill_(1.0)
    views[0][0, 2 * b + 1].fill_(2.0)
    assert views[0][0, 2 * b + 1].max().item() == 2.0 and views[0][0, 2 * b].min().item() == 1.0


def test_state_slots_keep_an_unused_array_of_no_bytes() -> None:
    """A hybrid model may declare a state array it does not use (LFM2's temporal state has a dimension of 0):
    it takes no bytes and its view is empty; a slot with no bytes at all, or a negative dimension, is refused."""
    from kvcached.layout import StateSlots, state_views

    conv, unused = ((4, 3), torch.bfloat16), ((1, 256, 0), torch.float32)
    slots = StateSlots((conv, unused), 3, 2 << 20)
    assert slots.entry_bytes == StateSlots((conv,), 3, 2 << 20).slot_bytes
    base = torch.zeros(8 * slots.slot_bytes, dtype=torch.uint8)
    views = state_views(base, slots, 8)
    assert views[0].shape == (3, 8, 4, 3) and views[1].shape == (3, 8, 1, 256, 0) and views[1].numel() == 0
    views[0][1, 2] = 1
    assert int(base.count_nonzero()) == 12 * 2  # one layer of one slot: 12 bf16 values, nothing else
    with pytest.raises(KVCachedConfigError, match="take no bytes"):
        StateSlots((unused,), 3, 2 << 20)
    with pytest.raises(KVCachedConfigError, match="ints >= 0"):
        StateSlots((((4, -1), torch.float32),), 3, 2 << 20)

"""Where each vLLM layer's pages go (``kv_alloc.layer_slots``), for the layouts vLLM gives hybrid models."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, KVCacheTensor, SlidingWindowSpec

from kvcached.errors import KVCachedConfigError
from kvcached.integration.vllm.kv_alloc import layer_slots, state_tensors

N = 64  # blocks
FULL = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float16)
SWA = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float16, sliding_window=32)
PAGE = FULL.page_size_bytes
GROUPS = [KVCacheGroupSpec(["l0", "l2"], SWA), KVCacheGroupSpec(["l1", "l3"], FULL)]


def _config(tensors: list, groups: list = GROUPS) -> SimpleNamespace:
    return SimpleNamespace(num_blocks=N, kv_cache_tensors=tensors, kv_cache_groups=groups)


def _tensor(layers: list[str], layer_stride: int, block_stride: int, offset: int = 0, size: int = 2 * N * PAGE):
    return KVCacheTensor(size=size, layers=layers, layer_stride=layer_stride, block_stride=block_stride,
                         offset=offset)


def test_groups_overlay_layer_outer() -> None:
    """vLLM >= 0.29, layer-outer: each group's j-th layer owns region j; the groups overlay each other."""
    s = layer_slots(_config([_tensor(["l0", "l2"], N * PAGE, PAGE), _tensor(["l1", "l3"], N * PAGE, PAGE)]))
    assert (s.num_slots, s.page_bytes) == (2, PAGE)
    assert s.slot_of == {"l0": 0, "l1": 0, "l2": 1, "l3": 1}
    assert s.group_of == {"l0": 0, "l2": 0, "l1": 1, "l3": 1}
    assert s.spec_of["l0"] is SWA and s.spec_of["l3"] is FULL


def test_groups_overlay_block_outer() -> None:
    """Block-outer: the j-th layer of each group sits j pages into every block."""
    s = layer_slots(_config([_tensor(["l0", "l2"], PAGE, 2 * PAGE), _tensor(["l1", "l3"], PAGE, 2 * PAGE)]))
    assert s.num_slots == 2 and s.slot_of == {"l0": 0, "l1": 0, "l2": 1, "l3": 1}


def test_one_group_has_one_slot_per_layer() -> None:
    s = layer_slots(_config([_tensor(["a", "b", "c"], N * PAGE, PAGE, size=3 * N * PAGE)],
                            [KVCacheGroupSpec(["a", "b", "c"], FULL)]))
    assert s.num_slots == 3 and s.slot_of == {"a": 0, "b": 1, "c": 2}


def test_shared_by_tensors_of_older_vllm() -> None:
    """vLLM <= 0.28: one tensor per slot, shared by one layer of each group."""
    t = [SimpleNamespace(size=N * PAGE, shared_by=["l0", "l1"], block_stride=0),
         SimpleNamespace(size=N * PAGE, shared_by=["l2", "l3"], block_stride=0)]
    s = layer_slots(_config(t))
    assert s.num_slots == 2 and s.slot_of == {"l0": 0, "l1": 0, "l2": 1, "l3": 1}
    packed = [SimpleNamespace(size=2 * N * PAGE, shared_by=["l0", "l1", "l2", "l3"], block_stride=2 * PAGE)]
    with pytest.raises(KVCachedConfigError, match="packs"):
        layer_slots(_config(packed))


def test_refusals_name_the_problem() -> None:
    big = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float16)
    mixed = [KVCacheGroupSpec(["l0", "l2"], SWA), KVCacheGroupSpec(["l1", "l3"], big)]
    tensors = [_tensor(["l0", "l2"], N * PAGE, PAGE), _tensor(["l1", "l3"], N * PAGE, PAGE)]
    with pytest.raises(KVCachedConfigError, match="same bytes per block"):
        layer_slots(_config(tensors, mixed))
    with pytest.raises(KVCachedConfigError, match="slots"):  # a backing allocation of another size
        layer_slots(_config([_tensor(["l0", "l2"], N * PAGE, PAGE, size=3 * N * PAGE),
                             _tensor(["l1", "l3"], N * PAGE, PAGE, size=3 * N * PAGE)]))
    with pytest.raises(KVCachedConfigError, match=r"no KV cache tensor to layers \['l3'\]"):
        layer_slots(_config([_tensor(["l0", "l2"], N * PAGE, PAGE), _tensor(["l1"], N * PAGE, PAGE)]))


@pytest.mark.parametrize("block_stride", [4096, 3 * 4096])  # one page a block (per-layer) or a block of pages
def test_mamba_state_tensors_equal_the_layers_own_unpacking(block_stride: int) -> None:
    """vLLM 0.24-0.26 gets a Mamba layer's states from the runner; they must be the bytes that vLLM >= 0.27's
    ``MambaBase.bind_kv_cache`` unpacks from the page view, block by block, whatever the block stride."""
    shapes, dtypes = ((3, 8), (2, 4, 16)), (torch.bfloat16, torch.float32)
    spec = SimpleNamespace(shapes=shapes, dtypes=dtypes)
    blocks, offset, page = 5, 2048, 4096
    raw = torch.randint(0, 256, (offset + blocks * block_stride,), dtype=torch.uint8)
    got = state_tensors(raw, offset, block_stride, spec, blocks)
    pages = torch.as_strided(raw.view(torch.int8), (blocks, page), (block_stride, 1), offset)
    at = 0
    for shape, dtype, t in zip(shapes, dtypes, got, strict=True):
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        want = pages[:, at:at + n].view(dtype).view(-1, *shape)
        assert t.shape == (blocks, *shape) and t.dtype == dtype
        assert torch.equal(t.view(torch.int8), want.view(torch.int8))
        at += n
    got[1][3].fill_(1.5)  # a view, not a copy: a write lands in block 3's page
    assert torch.equal(pages[3, 48:48 + 512].view(torch.float32), torch.full((128,), 1.5))


def test_mamba_state_tensors_refuse_a_misaligned_state() -> None:
    spec = SimpleNamespace(shapes=((3,), (4,)), dtypes=(torch.bfloat16, torch.float32))
    with pytest.raises(KVCachedConfigError, match="starts at byte 6"):
        state_tensors(torch.zeros(4096, dtype=torch.uint8), 0, 1024, spec, 2)

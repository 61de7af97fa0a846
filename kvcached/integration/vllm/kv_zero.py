"""Zeroing newly allocated blocks, for kvcached's layouts (stands in for vLLM's ``KVBlockZeroer``).

vLLM zeroes the blocks a step hands out when a model's groups overlay each other
(Mamba state and attention pages share bytes, and stale state bytes must not reach
attention as NaN). Its zeroer takes a layer's block stride as that layer's page
size, which holds for a dense per-layer cache only: in kvcached's contiguous layout
a block stride spans every slot, so it would clear the next blocks' pages of other
layers, some of them live. Here each block's own pages are cleared, in every slot
(a block belongs to one group at a time, so all of its slots are that group's):
one indexed fill per run of adjacent pages, a single one in the contiguous layout.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

_lock = threading.Lock()
_plan: tuple[list[Region], int] | None = None  # (regions, blocks)


@dataclass(frozen=True)
class Region:
    """``length`` bytes at ``offset + block * stride`` of ``tensor`` belong to ``block``."""

    tensor: torch.Tensor  # 1-D uint8, a whole kvcached virtual tensor
    offset: int
    stride: int
    length: int


def plan_regions(geometry: Any, raws: list[torch.Tensor]) -> list[Region]:
    """Every page of one block, by layer and K/V half, merged where they are adjacent."""
    spec = geometry.spec
    parts = []
    for layer in range(spec.num_layers):
        st = geometry.layer_strides(layer)
        for kv in range(spec.kv_factor):
            parts.append((st.tensor, (st.offset + kv * st.kv_stride) * spec.itemsize,
                          st.block_stride * spec.itemsize, spec.block_elems * spec.itemsize))
    merged: list[list[int]] = []
    for tensor, offset, stride, length in sorted(parts):
        last = merged[-1] if merged else None
        if last and last[0] == tensor and last[2] == stride and last[1] + last[3] == offset:
            last[3] += length
        else:
            merged.append([tensor, offset, stride, length])
    return [Region(raws[t].view(torch.uint8), o, s, n) for t, o, s, n in merged]


def record(geometry: Any, raws: list[torch.Tensor], num_blocks: int) -> None:
    """Called where the KV tensors are placed (this worker process)."""
    global _plan
    with _lock:
        _plan = (plan_regions(geometry, raws), num_blocks)


def reset() -> None:
    global _plan
    with _lock:
        _plan = None


def zero_blocks(regions: Iterable[Region], num_blocks: int, block_ids: torch.Tensor) -> None:
    for r in regions:
        rows = torch.as_strided(r.tensor, (num_blocks, r.length), (r.stride, 1), r.offset)
        rows.index_fill_(0, block_ids, 0)


class SlotZeroer:
    """Same calls as vLLM's ``KVBlockZeroer`` (its constructor's arguments are not needed)."""

    def __init__(self, device: Any, *args: Any, **kwargs: Any) -> None:
        self.device = torch.device(device)
        with _lock:
            self.regions, self.num_blocks = _plan or ([], 0)

    def zero_block_ids(self, block_ids: list[int]) -> None:
        if not block_ids or not self.regions:
            return
        ids = torch.tensor(block_ids, dtype=torch.int64).to(self.device, non_blocking=True)
        zero_blocks(self.regions, self.num_blocks, ids)

    def warmup(self, *args: Any, **kwargs: Any) -> None:
        self.zero_block_ids([0])  # block 0 is vLLM's null block: clearing it is always safe

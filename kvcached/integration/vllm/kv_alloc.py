"""vLLM's KV cache tensors, allocated by kvcached instead of ``torch.zeros``.

vLLM 0.32 views every attention layer's cache as ``[B, H, N, C]`` (C in bytes),
one dense page of ``page_size_bytes`` per (layer, block), and leaves the inside
of that page to the attention backend. kvcached therefore treats one vLLM page
as one opaque block (an MLA-style ``(num_blocks, block_size, bytes_per_token)``
uint8 cache with ``kv_factor=1``): :func:`alloc_kv_cache` places the blocks in
the configured layout (contiguous: all layers of a block side by side;
per-layer: one tensor per layer) and vLLM's own ``create_kv_cache_views`` builds
the page interior, so every backend sees exactly the bytes it would without
kvcached, only at kvcached's block addresses.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kvcached import vmm_ops
from kvcached.errors import KVCachedConfigError, KVCachedStateError
from kvcached.integration.vllm import interfaces
from kvcached.utils import get_kvcached_logger

logger = get_kvcached_logger()


@dataclass(frozen=True)
class PoolInfo:
    """What the scheduler's block pool needs to open a KVCacheManager over the tensors."""

    num_blocks: int
    block_size: int
    cell_size: int  # bytes of one token of one layer (the whole vLLM page / block_size)
    num_layers: int
    group_id: int = 0


_lock = threading.Lock()
_pool_info: PoolInfo | None = None
_plain = threading.local()
vllm_allocate_kv_cache: Any = None  # vLLM's own allocator, set by ``patches``


@contextlib.contextmanager
def plain_allocation() -> Iterator[None]:
    """Within this block KV caches come from vLLM's own allocator (a throw-away profiling cache)."""
    _plain.on = True
    try:
        yield
    finally:
        _plain.on = False


def pool_info() -> PoolInfo:
    """The geometry recorded by :func:`allocate_kv_cache` in this process."""
    info = _pool_info
    if info is None:
        raise KVCachedStateError(
            "kvcached: the scheduler's block pool was created in a process whose worker did not allocate the KV "
            "cache through kvcached. kvcached supports one worker in the engine-core process (tensor and "
            "pipeline parallel size 1, the default uniprocess executor); unset ENABLE_KVCACHED for other setups."
        )
    return info


def reset() -> None:
    global _pool_info
    with _lock:
        _pool_info = None


def ensure_initialized(device: Any, contiguous_layout: bool | None = None) -> None:
    """Start kvcached on the worker's device (``cpu`` means the host backend); no-op if running."""
    dev = torch.device(device)
    text = "cpu" if dev.type == "cpu" else f"cuda:{dev.index if dev.index is not None else 0}"
    interfaces.init_kvcached(tp_rank=0, world_size=1, is_worker=True, device=text,
                             contiguous_layout=contiguous_layout)


def _the_attention_spec(kv_cache_config: Any) -> Any:
    from vllm.v1.kv_cache_interface import AttentionSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        kinds = ", ".join(type(g.kv_cache_spec).__name__ for g in groups)
        raise KVCachedConfigError(
            f"kvcached supports models whose layers form one KV cache group; this model has {len(groups)} "
            f"({kinds}). Unset ENABLE_KVCACHED to run it without kvcached."
        )
    spec = groups[0].kv_cache_spec
    if not isinstance(spec, AttentionSpec) or not spec.has_layer_views:
        raise KVCachedConfigError(
            f"kvcached supports attention KV caches; this model's cache is {type(spec).__name__}. "
            "Unset ENABLE_KVCACHED to run it without kvcached."
        )
    if spec.page_size_padded is not None:
        raise KVCachedConfigError(
            f"kvcached does not support padded KV pages (page_size_padded={spec.page_size_padded}); "
            "unset ENABLE_KVCACHED for this model."
        )
    return spec


def capacity_bytes(num_layers: int) -> int:
    """KV bytes to report to vLLM: every layer's share of the device, in whole kvcached pages.

    vLLM turns this into ``num_blocks = bytes // (page_size_bytes * num_layers)``,
    which is exactly the number of blocks :func:`alloc_kv_cache` makes room for
    (virtually: nothing is mapped until a block is handed out).
    """
    rt = vmm_ops.runtime()
    return interfaces.virtual_bytes_per_kv(rt, num_layers, 1) * num_layers


def allocate_kv_cache(kv_cache_config: Any, device: torch.device, layout: Any,
                      kernel_block_sizes: list[int] | None = None) -> dict[str, torch.Tensor]:
    """Drop-in for ``vllm.v1.worker.utils.allocate_kv_cache``: same arguments, same views."""
    global _pool_info
    from vllm.v1.kv_cache_interface import KVCacheTensor, create_kv_cache_views

    if not kv_cache_config.kv_cache_tensors:
        return {}
    if getattr(_plain, "on", False) and vllm_allocate_kv_cache is not None:
        return vllm_allocate_kv_cache(kv_cache_config, device, layout, kernel_block_sizes)
    from kvcached.integration.vllm.patches import contiguous_layout

    ensure_initialized(device, contiguous_layout())
    spec = _the_attention_spec(kv_cache_config)
    if not layout.is_block_compact:
        raise KVCachedConfigError(
            f"kvcached needs a KV layout whose pages are dense per (layer, block); vLLM resolved {layout.name}. "
            "Set VLLM_KV_CACHE_LAYOUT=LBHNC (or another layout starting with L and B)."
        )
    layer_names = [name for t in kv_cache_config.kv_cache_tensors for name in t.layers]
    num_layers = len(layer_names)
    num_blocks = kv_cache_config.num_blocks
    page_bytes = spec.page_size_bytes
    block_size = spec.block_size
    if page_bytes % block_size:
        raise KVCachedConfigError(
            f"a vLLM KV page of {page_bytes} B is not a whole number of bytes per token for block size "
            f"{block_size}; unset ENABLE_KVCACHED for this model."
        )
    cell = page_bytes // block_size
    # a fresh group per engine, so a second engine in this process (after the first shut down) starts clean
    group_id = 0
    while vmm_ops.kv_tensors_created(group_id):
        group_id += 1
    views, meta = interfaces.alloc_kv_cache((num_blocks, block_size, cell), block_size, torch.uint8, str(device),
                                            num_layers, attention_type="MLA", group_id=group_id, return_meta=True)
    if num_blocks > meta["num_blocks_per_layer"]:
        raise KVCachedConfigError(
            f"vLLM planned {num_blocks} KV blocks but kvcached's virtual tensors hold "
            f"{meta['num_blocks_per_layer']}; lower --kv-cache-memory-bytes or raise KVCACHED_HOST_MEM_LIMIT_MB."
        )
    kbs = kernel_block_sizes[0] if kernel_block_sizes else None
    out: dict[str, torch.Tensor] = {}
    for idx, name in enumerate(layer_names):
        base = views[idx]  # (blocks, block_size, cell) uint8, block stride set by kvcached's layout
        raw = torch.as_strided(base, (1,), (1,), 0)  # the whole virtual tensor, offset 0
        place = KVCacheTensor(size=page_bytes * num_blocks, layers=[name], layer_stride=page_bytes,
                              block_stride=base.stride(0), offset=base.storage_offset())
        out[name] = create_kv_cache_views(raw, spec, num_blocks, layout, place, kernel_block_size=kbs)[0]
    with _lock:
        _pool_info = PoolInfo(num_blocks, block_size, cell, num_layers, group_id)
    logger.info("kvcached: %d layers x %d virtual blocks of %d B in the %s layout on %s", num_layers, num_blocks,
                page_bytes, vmm_ops.runtime().layout.value, device)
    return out

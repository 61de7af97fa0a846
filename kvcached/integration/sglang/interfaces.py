"""SGLang entry points, with kvcached's names and signatures.

SGLang keeps per-token K and V buffers ``[num_tokens, H, D]`` per layer and calls
its token groups "pages" (``page_size`` tokens); kvcached calls them blocks.
"""

from __future__ import annotations

from typing import Any

import torch

from kvcached import observability, pool_registry, vmm_ops
from kvcached.errors import KVCachedConfigError, KVCachedStateError
from kvcached.integration.vllm.interfaces import _default_device, virtual_bytes_per_kv
from kvcached.kv_cache_manager import KVCacheManager
from kvcached.layout import KVSpec, Layout, engine_pages_per_page, mla_view, sglang_buffers, token_major_geometry
from kvcached.utils import get_kvcached_logger, normalize_gpu_device

logger = get_kvcached_logger()

_kvcached_initialized: bool = False
_kvcached_device: str | None = None
_async_sched: bool = False
_world_size: int = 1
_pp_rank: int = 0
# bytes of one token of one layer's K (or V) in each group's buffers: a manager must use the same cell size
_token_bytes: dict[int, int] = {}
INTEGRATION = "sglang"  # the tag of this integration's pools in kvcached.pool_registry


def init_kvcached(tp_rank: int = 0, world_size: int = 1, pp_rank: int = 0, device: str | None = None,
                  async_sched: bool = False, contiguous_layout: bool | None = None) -> None:
    global _kvcached_initialized, _kvcached_device, _async_sched, _world_size, _pp_rank
    if world_size != 1:
        raise KVCachedConfigError(f"kvcached supports tensor parallel size 1 for now, got world_size={world_size}.")
    if _kvcached_initialized and vmm_ops.is_initialized():
        return
    device = normalize_gpu_device(device or _default_device())
    vmm_ops.init_kvcached(device, None, contiguous_layout)
    _kvcached_initialized, _kvcached_device = True, device
    _async_sched, _world_size, _pp_rank = async_sched, world_size, pp_rank


def shutdown_kvcached() -> bool:
    global _kvcached_initialized, _kvcached_device, _async_sched
    if _kvcached_initialized and vmm_ops.is_initialized():
        vmm_ops.shutdown_kvcached()
    _token_bytes.clear()
    _kvcached_initialized, _kvcached_device, _async_sched = False, None, False
    pool_registry.clear_registered_kv_cache_pools(integration=INTEGRATION)
    return True


def kv_cache_pool_snapshot_dicts() -> list[dict[str, Any]]:
    """JSON snapshots of this integration's live pools (:mod:`kvcached.observability`)."""
    return observability.get_registered_kv_cache_pool_snapshot_dicts(integration=INTEGRATION)


def alloc_kv_cache(kvcache_shape: tuple[int, ...], dtype: torch.dtype, device: str, num_layers: int,
                   page_size: int = 1, attention_type: str = "MHA", kv_layout: str = "NHD",
                   group_id: int = 0) -> Any:
    """MHA/GQA: ``(k_buffers, v_buffers)``, each a per-layer ``[num_tokens, H, D]`` view.
    MLA: a per-layer list of ``[num_tokens, 1, D]`` views. ``kvcache_shape`` is
    ``(num_tokens, H, D)``; ``num_tokens`` becomes what the device could hold."""
    if not _kvcached_initialized or not vmm_ops.is_initialized():
        raise KVCachedStateError("kvcached is not initialized; call init_kvcached() first.")
    rt = vmm_ops.runtime()
    if attention_type not in ("MHA", "GQA", "MLA"):
        raise KVCachedConfigError(f"attention type {attention_type!r} is not supported; use MHA, GQA or MLA.")
    is_mla = attention_type == "MLA"
    if not is_mla and kv_layout != "NHD":
        raise KVCachedConfigError(f"KV layout {kv_layout!r} is not supported; use NHD.")
    shape = tuple(int(s) for s in kvcache_shape)
    if len(shape) != 3:
        raise KVCachedConfigError(f"SGLang kv cache shape must be (num_tokens, heads, head_dim), got {shape}.")
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size <= 0:
        raise KVCachedConfigError(f"page_size (tokens per block) must be a positive int, got {page_size!r}.")
    heads, head_size = shape[1], shape[2]
    if is_mla and heads != 1:
        raise KVCachedConfigError(f"MLA kv cache shape must have 1 head, got {shape}.")
    kv = 1 if is_mla else 2
    token_bytes = heads * head_size * dtype.itemsize
    pages_per_page = engine_pages_per_page(page_size, token_bytes, rt.page_size)
    per_kv = virtual_bytes_per_kv(rt, num_layers, kv)
    num_pages = per_kv // rt.page_size * pages_per_page
    if shape[0] > num_pages * page_size:
        logger.warning("requested %d tokens, the device can hold %d", shape[0], num_pages * page_size)
    # one-token blocks for any SGLang page size: token-major on the contiguous layout
    geom = token_major_geometry(KVSpec(num_layers, num_pages, page_size, heads, head_size, dtype, kv), rt.layout,
                                rt.page_size)
    raw = vmm_ops.create_kv_tensors(per_kv * kv, dtype.itemsize, device, num_layers, kv, group_id)
    _token_bytes[group_id] = token_bytes
    if is_mla:
        return [mla_view(raw, geom, layer) for layer in range(num_layers)]  # (tokens, 1, D): one-token blocks
    ks, vs = [], []
    for layer in range(num_layers):
        k, v = sglang_buffers(raw, geom, layer)
        ks.append(k)
        vs.append(v)
    return ks, vs


def get_kv_cache_manager(num_blocks: int, block_size: int, cell_size: int, num_layers: int,
                         reserve_null_block: bool = True, num_kv_buffers: int = 2, group_id: int = 0,
                         pool_name: str | None = None, layout: Layout | None = None) -> KVCacheManager:
    """Token-slot allocator: blocks of ``block_size`` tokens (SGLang's page size) of ``cell_size`` bytes
    per token and layer; block 0 is SGLang's padding slot (page). ``layout``: the group's own, if it has one."""
    if not _kvcached_initialized or not vmm_ops.is_initialized():
        raise KVCachedStateError("kvcached is not initialized; call init_kvcached() first.")
    token_bytes = _token_bytes.get(group_id) if vmm_ops.kv_tensors_created(group_id) else None
    if token_bytes is not None and cell_size != token_bytes:
        # the buffers are token-major: page p is p * page_size / token_bytes tokens in; another
        # cell size would map memory under other tokens than the ones handed out
        raise KVCachedConfigError(
            f"cell_size={cell_size} B does not match the {token_bytes} B per token of group {group_id}'s "
            "buffers from alloc_kv_cache (heads x head_dim x dtype size)."
        )
    manager = KVCacheManager(num_blocks, block_size, cell_size, num_layers, _world_size, pp_rank=_pp_rank,
                             async_sched=_async_sched, reserve_null_block=reserve_null_block,
                             num_kv_buffers=num_kv_buffers, group_id=group_id, pool_name=pool_name, layout=layout)
    pool_registry.register_kv_cache_pool(manager, integration=INTEGRATION)
    return manager

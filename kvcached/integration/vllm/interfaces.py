"""vLLM entry points, with kvcached's names and signatures.

``init_kvcached`` -> ``alloc_kv_cache`` (per-layer views over virtual KV tensors)
-> ``get_kv_cache_manager`` (block ids; memory mapped as blocks are used) ->
``shutdown_kvcached``. Views come from :mod:`kvcached.layout` only.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvcached import observability, pool_registry, vmm_ops
from kvcached.errors import KVCachedConfigError, KVCachedStateError
from kvcached.kv_cache_manager import KVCacheManager
from kvcached.layout import FLASH_ATTN, FLASHINFER, KVGeometry, KVSpec, Layout, kv_cache_view, mla_view
from kvcached.utils import get_kvcached_logger, normalize_gpu_device

logger = get_kvcached_logger()

_kvcached_initialized: bool = False
_kvcached_device: str | None = None
_async_sched: bool = False
_world_size: int = 1
_pp_rank: int = 0
_is_worker: bool = False
INTEGRATION = "vllm"  # the tag of this integration's pools in kvcached.pool_registry


def _default_device() -> str:
    if torch.cuda.is_available():
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


def init_kvcached(tp_rank: int = 0, world_size: int = 1, pp_rank: int = 0, is_worker: bool = False,
                  device: str | None = None, async_sched: bool = False,
                  contiguous_layout: bool | None = None, null_budget: int = 0, page_size: int | None = None) -> None:
    """Start kvcached for this vLLM process (idempotent: a second call only updates flags).

    ``device="null"`` with ``null_budget`` bytes: the bookkeeping-only runtime of a tensor-parallel
    engine's scheduler (see :mod:`kvcached.integration.vllm.tp`). ``page_size`` None: ``KVCACHED_PAGE_SIZE_MB``.
    """
    global _kvcached_initialized, _kvcached_device, _async_sched, _world_size, _pp_rank, _is_worker
    if world_size != 1:
        raise KVCachedConfigError(
            f"init_kvcached(world_size={world_size}): kvcached drives one device per process; with vLLM, tensor "
            "parallelism needs nothing from the caller (kvcached.integration.vllm.tp). Use world_size=1."
        )
    if _kvcached_initialized and vmm_ops.is_initialized():
        _is_worker = _is_worker or is_worker
        _async_sched = _async_sched or async_sched
        _pp_rank = pp_rank
        return
    device = "null" if device == "null" else normalize_gpu_device(device or _default_device())
    vmm_ops.init_kvcached(device, page_size, contiguous_layout, null_budget=null_budget)
    _kvcached_initialized = True
    _kvcached_device = device
    _world_size, _pp_rank, _async_sched, _is_worker = world_size, pp_rank, async_sched, is_worker


def shutdown_kvcached() -> bool:
    """Unmap everything and forget the KV tensors. True when done (kvcached's contract)."""
    global _kvcached_initialized, _kvcached_device, _async_sched, _is_worker
    if _kvcached_initialized and vmm_ops.is_initialized():
        vmm_ops.shutdown_kvcached()
    _kvcached_initialized = False
    _kvcached_device = None
    _async_sched = False
    _is_worker = False
    pool_registry.clear_registered_kv_cache_pools(integration=INTEGRATION)
    return True


def kv_cache_pool_snapshot_dicts() -> list[dict[str, Any]]:
    """JSON snapshots of this integration's live pools (:mod:`kvcached.observability`)."""
    return observability.get_registered_kv_cache_pool_snapshot_dicts(integration=INTEGRATION)


def _require_init() -> vmm_ops.Runtime:
    if not _kvcached_initialized or not vmm_ops.is_initialized():
        raise KVCachedStateError("kvcached is not initialized; call init_kvcached() first.")
    return vmm_ops.runtime()


def virtual_bytes_per_kv(rt: vmm_ops.Runtime, num_layers: int, kv_factor: int, round_up: bool = False) -> int:
    """Virtual bytes of one layer's K (or V): the whole device's memory shared out, in whole pages.

    ``round_up``: to the next whole page, so that a page grown by :func:`vmm_ops.fit_page_size`
    after vLLM planned its blocks (on the share rounded to the page of that time) still holds
    them all; it is address space, nothing is mapped.
    """
    total = int(rt.backend.mem_info()[1])
    per = total // num_layers // kv_factor
    per = -(-per // rt.page_size) * rt.page_size if round_up else per - per % rt.page_size
    if per <= 0:
        raise KVCachedConfigError(
            f"device memory {total} B is too small for {num_layers} layers x {kv_factor} of one "
            f"{rt.page_size >> 20} MiB page each."
        )
    return per


def alloc_kv_cache(kvcache_shape: tuple[int, ...], block_size: int, dtype: torch.dtype, device: str,
                   num_layers: int, attention_type: str = "MHA", kv_layout: str = "NHD", group_id: int = 0,
                   kernel_block_size: int | None = None, return_meta: bool = False) -> Any:
    """Per-layer KV cache views over virtual tensors, in vLLM's shapes.

    ``kvcache_shape``: FlashAttention ``(2, N, block_size, H, D)``, FlashInfer
    ``(N, 2, block_size, H, D)`` or MLA ``(N, block_size, D)``. ``N`` is replaced by
    what the device could hold (the memory is virtual: nothing is mapped until a
    :class:`KVCacheManager` hands the block out). With ``return_meta`` a dict
    ``{raw_kv_tensors, num_blocks_per_layer, gpu_mem_bytes_per_layer_k_or_v,
    num_layers, dtype, geometry}`` is returned as well.
    """
    rt = _require_init()
    if attention_type not in ("MHA", "GQA", "MLA"):
        raise KVCachedConfigError(f"attention type {attention_type!r} is not supported; use MHA, GQA or MLA.")
    if kv_layout != "NHD":
        raise KVCachedConfigError(f"KV layout {kv_layout!r} is not supported; use NHD.")
    shape = tuple(int(s) for s in kvcache_shape)
    is_mla = attention_type == "MLA"
    if is_mla:
        if len(shape) != 3 or shape[1] != block_size:
            raise KVCachedConfigError(f"MLA kv cache shape must be (num_blocks, {block_size}, head_size), got {shape}.")
        heads, head_size, style, kv = 1, shape[2], None, 1
    else:
        if len(shape) != 5 or shape[2] != block_size or 2 not in shape[:2]:
            raise KVCachedConfigError(
                f"kv cache shape {shape} is neither (2, N, {block_size}, H, D) nor (N, 2, {block_size}, H, D)."
            )
        style = FLASH_ATTN if shape[0] == 2 else FLASHINFER
        heads, head_size, kv = shape[3], shape[4], 2
    kbs = block_size if kernel_block_size is None else kernel_block_size
    if kbs <= 0 or block_size % kbs:
        raise KVCachedConfigError(f"block_size ({block_size}) must be a multiple of kernel_block_size ({kbs}).")
    if kbs != block_size and rt.layout is Layout.CONTIGUOUS:
        raise KVCachedConfigError(
            f"kernel_block_size ({kbs}) != block_size ({block_size}) needs the per-layer layout; set "
            "KVCACHED_CONTIGUOUS_LAYOUT=false."
        )
    block_bytes = block_size * heads * head_size * dtype.itemsize
    if vmm_ops.fit_page_size(block_bytes) % block_bytes:
        raise KVCachedConfigError(
            f"a KV block of {block_bytes} B does not divide the {rt.page_size >> 20} MiB page, so blocks would "
            "straddle pages, and the page cannot grow to fit them (KV tensors exist already, the page size was "
            f"chosen, or whole blocks fill no page up to {vmm_ops.MAX_FITTED_PAGE >> 20} MiB); pick a block size "
            "that divides the page or set KVCACHED_PAGE_SIZE_MB to a multiple of 2 that it divides."
        )
    per_kv = virtual_bytes_per_kv(rt, num_layers, kv, round_up=True)
    num_pages = per_kv // rt.page_size
    num_blocks = num_pages * (rt.page_size // block_bytes)
    requested = shape[0] if is_mla or style == FLASHINFER else shape[1]
    if requested > num_blocks:
        logger.warning("requested %d blocks, the device can hold %d", requested, num_blocks)
    ratio = block_size // kbs
    geom = KVGeometry(KVSpec(num_layers, num_blocks * ratio, kbs, heads, head_size, dtype, kv), rt.layout,
                      rt.page_size)
    raw = vmm_ops.create_kv_tensors(per_kv * kv, dtype.itemsize, device, num_layers, kv, group_id)
    if is_mla:
        views = [mla_view(raw, geom, layer) for layer in range(num_layers)]
    else:
        views = [kv_cache_view(raw, geom, layer, style) for layer in range(num_layers)]
    if not return_meta:
        return views
    meta = {"raw_kv_tensors": raw, "num_blocks_per_layer": num_blocks, "gpu_mem_bytes_per_layer_k_or_v": per_kv,
            "num_layers": num_layers, "dtype": dtype, "geometry": geom}
    return views, meta


def get_kv_cache_manager(num_blocks: int, block_size: int, cell_size: int, num_layers: int, num_kv_buffers: int = 2,
                         group_id: int = 0, pool_name: str | None = None,
                         reserve_null_block: bool = True) -> KVCacheManager:
    """The block allocator over ``alloc_kv_cache``'s tensors (block 0 reserved for padding, as in vLLM)."""
    _require_init()
    manager = KVCacheManager(num_blocks, block_size, cell_size, num_layers, _world_size, pp_rank=_pp_rank,
                             async_sched=_async_sched, reserve_null_block=reserve_null_block,
                             num_kv_buffers=num_kv_buffers, group_id=group_id, pool_name=pool_name)
    pool_registry.register_kv_cache_pool(manager, integration=INTEGRATION)
    return manager


def cell_size_of(shape: tuple[int, ...], dtype: torch.dtype, attention_type: str = "MHA") -> int:
    """Bytes of one token of one layer's K (or V) for a vLLM kv cache shape."""
    inner = shape[2:] if attention_type == "MLA" else shape[3:]
    return math.prod(inner) * dtype.itemsize

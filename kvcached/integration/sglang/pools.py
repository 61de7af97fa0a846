"""SGLang's MHA and MLA token-to-KV pools with their buffers in kvcached's virtual KV tensors.

Each pool is SGLang's own class with only buffer creation replaced: the per-layer
``[size + page_size, H, D]`` buffers become views of one kvcached group (a group per
pool, so a draft model's pool or a hybrid model's sub-pool has its own), and the pool
carries the :class:`KVCacheManager` whose blocks are SGLang's pages (block 0 is
SGLang's padding page). Memory is mapped only under pages the allocator hands out.

Options whose buffers are not plain ``[tokens, H, D]`` tensors (quantized or FP4
pools, HND or AITER layouts, post-capture backing, memory saver, custom memory
pools, K and V of different widths, DSA) are refused with an error.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

from kvcached import config, vmm_ops
from kvcached.errors import KVCachedConfigError
from kvcached.integration.common import fresh_group_id
from kvcached.integration.sglang import interfaces
from kvcached.kv_cache_manager import KVCacheManager


def contiguous_layout() -> bool:
    """``KVCACHED_CONTIGUOUS_LAYOUT`` when set; else per-layer under SGLang.

    Per-layer views are dense ``[tokens, H, D]`` tensors, exactly what SGLang allocates
    itself; the contiguous layout's views are token-major strided views, which SGLang's
    Triton backend reads (it takes strides) but its CUDA store and FlashInfer/FA3 paths
    were not checked with (no GPU run yet).
    """
    explicit = config.contiguous_layout_override()
    return False if explicit is None else explicit


def _refuse(pool: str, what: str) -> None:
    raise KVCachedConfigError(f"kvcached's SGLang {pool} pool does not support {what}; unset ENABLE_KVCACHED "
                              "to run this configuration without kvcached.")


def _single_rank(pool: str) -> None:
    """Each SGLang rank (TP/PP/DP) runs a scheduler of its own that must decide as the others do; kvcached's
    per-rank availability would differ between GPUs, so more than one rank is refused."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        ranks = torch.distributed.get_world_size()
        if ranks > 1:
            _refuse(pool, f"{ranks} ranks (tensor, pipeline or data parallelism); it runs one GPU per engine")


def _kv_views(kind: str, rows: int, heads: int, dim: int, dtype: torch.dtype, device: Any, layers: int,
              page_size: int) -> tuple[Any, KVCacheManager]:
    """Per-layer views of ``rows`` tokens in a fresh kvcached group, and the group's manager."""
    interfaces.init_kvcached(device=str(device), contiguous_layout=contiguous_layout())
    # DeepSeek's MLA token (576 x 2 B) does not divide 2 MiB: a process's first pool may grow the page to fit
    vmm_ops.fit_page_size(page_size * heads * dim * dtype.itemsize)
    group_id = fresh_group_id()
    pages = -(-rows // page_size)  # SGLang sizes are page multiples; a remainder still gets whole pages
    views = interfaces.alloc_kv_cache((pages * page_size, heads, dim), dtype, str(device), layers,
                                      page_size=page_size, attention_type=kind, group_id=group_id)
    first = views[0] if kind == "MLA" else views[0][0]
    if first.shape[0] < rows:
        raise KVCachedConfigError(
            f"SGLang asked for {rows} KV tokens of {layers} layers; kvcached's virtual KV space on {device} holds "
            f"{first.shape[0]}. Lower --mem-fraction-static or --max-total-tokens."
        )
    manager = interfaces.get_kv_cache_manager(pages, page_size, heads * dim * dtype.itemsize, layers,
                                              reserve_null_block=True, num_kv_buffers=1 if kind == "MLA" else 2,
                                              group_id=group_id, pool_name=f"sglang-{kind.lower()}{group_id}")
    if kind == "MLA":
        return [v[:rows] for v in views], manager
    ks, vs = views
    return ([k[:rows] for k in ks], [v[:rows] for v in vs]), manager


class KvcachedMHATokenToKVPool(MHATokenToKVPool):
    """SGLang's MHA/GQA pool; K and V of each layer are views into kvcached's virtual tensors."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        for name, bad in (("quant_method", lambda v: v is not None), ("post_capture_active", bool),
                          ("kv_cache_layout", lambda v: v is not None), ("enable_memory_saver", bool)):
            if bad(kwargs.get(name)):
                _refuse("MHA", f"{name}={kwargs[name]!r}")
        if len(args) > 7 and args[7]:
            _refuse("MHA", "enable_memory_saver=True")
        self.kvcached_manager: KVCacheManager | None = None
        super().__init__(*args, **kwargs)

    def _create_buffers_normal(self) -> None:  # called by MHATokenToKVPool.__init__ via _create_buffers
        if self.kv_cache_layout != "nhd":
            _refuse("MHA", f"the {self.kv_cache_layout!r} KV layout (SGLANG_USE_HND_KVCACHE / AITER)")
        if self.enable_custom_mem_pool:
            _refuse("MHA", "a custom memory pool (NVLink disaggregation)")
        if self.v_head_dim != self.head_dim:
            _refuse("MHA", f"V head dim {self.v_head_dim} != K head dim {self.head_dim}")
        _single_rank("MHA")
        (self.k_buffer, self.v_buffer), self.kvcached_manager = _kv_views(
            "MHA", self.size + self.page_size, self.head_num, self.head_dim, self.store_dtype, self.device,
            self.layer_num, self.page_size)


class KvcachedMLATokenToKVPool(MLATokenToKVPool):
    """SGLang's MLA pool; each layer's latent buffer is a view into kvcached's virtual tensor."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_dsa") or kwargs.get("override_kv_cache_dim") is not None:
            _refuse("MLA", "DSA (its indexer buffers)")
        if kwargs.get("enable_memory_saver") or (len(args) > 7 and args[7]):
            _refuse("MLA", "enable_memory_saver=True")
        self.kvcached_manager: KVCacheManager | None = None
        super().__init__(*args, **kwargs)

    def _create_buffers(self) -> None:  # called by MLATokenToKVPool.__init__
        if self.custom_mem_pool is not None:
            _refuse("MLA", "a custom memory pool (NVLink disaggregation)")
        _single_rank("MLA")
        self.kv_buffer, self.kvcached_manager = _kv_views(
            "MLA", self.size + self.page_size, 1, self.kv_cache_dim, self.store_dtype, self.device,
            self.layer_num, self.page_size)


def manager_of(kvcache: Any) -> KVCacheManager:
    """The kvcached manager behind an SGLang pool (a hybrid linear-attention pool: its full-attention pool's)."""
    for pool in (kvcache, getattr(kvcache, "full_kv_pool", None)):
        manager = getattr(pool, "kvcached_manager", None)
        if manager is not None:
            return manager
    raise KVCachedConfigError(
        f"the SGLang KV pool {type(kvcache).__name__} does not come from kvcached, so kvcached's allocator cannot "
        "hand out its slots; kvcached covers MHA/GQA and MLA pools (and hybrid linear attention's full-attention "
        "pool). Unset ENABLE_KVCACHED for this model."
    )

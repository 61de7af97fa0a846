"""vLLM's KV cache tensors, placed by kvcached instead of ``torch.zeros``.

kvcached never looks inside a vLLM page (one layer's K and V of one block). It
places pages in the configured layout (contiguous: all layers of a block side by
side; per-layer: one tensor per layer) and leaves the page interior to vLLM's
attention backend, so every backend sees exactly the bytes it would without
kvcached, only at kvcached's block addresses. Two ways in, by vLLM version
(:mod:`adapters` picks one):

* vLLM >= 0.29 views each layer through ``create_kv_cache_views``:
  :func:`allocate_kv_cache` is a drop-in for ``vllm.v1.worker.utils.allocate_kv_cache``;
* vLLM 0.24-0.28 reshapes raw per-layer buffers to the backend's
  ``get_kv_cache_shape`` / ``get_kv_cache_stride_order``: :func:`build_views` builds
  those same views over kvcached's memory. A block-first physical shape
  (``(N, ...)``: Triton, FlashInfer, ours) keeps each page whole (one kvcached
  buffer); a K/V-first one (``(2, N, ...)``: FlashAttention) puts K and V in
  kvcached's two buffers.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kvcached import vmm_ops
from kvcached.errors import KVCachedConfigError, KVCachedStateError
from kvcached.integration.common import fresh_group_id
from kvcached.integration.vllm import interfaces, kv_zero, settings
from kvcached.utils import get_kvcached_logger

logger = get_kvcached_logger()


@dataclass(frozen=True)
class PoolInfo:
    """What the scheduler's block pool needs to open a KVCacheManager over the tensors."""

    num_blocks: int
    block_size: int
    cell_size: int  # bytes of one token of one layer in one of the kv_factor buffers
    num_layers: int
    group_id: int = 0
    kv_factor: int = 1  # 1: a vLLM page kept whole; 2: its K and V halves in two buffers
    # tensor parallel (set in the engine core from the workers' reports, see ``tp``): the ranks, the
    # smallest rank's device bytes, and the workers' layout and page size
    world_size: int = 1
    rank_bytes: int = 0
    layout: str = ""
    page_size: int = 0


_lock = threading.Lock()
_pool_info: PoolInfo | None = None
_memory_cap: int | None = None  # bytes, from vLLM's memory flags (see settings.memory_flag)
_plain = threading.local()
vllm_allocate_kv_cache: Any = None  # vLLM's own allocator (>= 0.29), set by ``adapters``


@contextlib.contextmanager
def plain_allocation() -> Iterator[None]:
    """Within this block KV caches come from vLLM's own allocator (a throw-away profiling cache)."""
    _plain.on = True
    try:
        yield
    finally:
        _plain.on = False


def plain() -> bool:
    return bool(getattr(_plain, "on", False))


def pool_info() -> PoolInfo:
    """The geometry recorded when the KV cache was placed in this process."""
    info = _pool_info
    if info is None:
        raise KVCachedStateError(
            "kvcached: the scheduler's block pool was created in a process where no worker placed the KV cache "
            "through kvcached and no tensor-parallel workers reported theirs (pipeline parallelism and "
            "data-parallel engine cores are not supported); unset ENABLE_KVCACHED for this setup."
        )
    return info


def placed_here() -> bool:
    """Did a worker in this process place the KV cache (rather than tensor-parallel workers report theirs)?"""
    info = _pool_info
    return info is not None and info.world_size == 1


def set_remote_pool_info(info: PoolInfo) -> None:
    """The engine core's view of its tensor-parallel workers' pools (see ``tp.after_kv_caches``)."""
    global _pool_info
    with _lock:
        _pool_info = info


def set_memory_cap(cap_bytes: int | None) -> None:
    global _memory_cap
    _memory_cap = cap_bytes


def memory_cap() -> int | None:
    """This engine's KV memory cap from ``--kv-cache-memory-bytes`` / ``--gpu-memory-utilization``, if given."""
    return _memory_cap


def reset() -> None:
    global _pool_info, _memory_cap
    with _lock:
        _pool_info = None
        _memory_cap = None
    kv_zero.reset()


def ensure_initialized(device: Any, contiguous_layout: bool | None = None) -> None:
    """Start kvcached on the worker's device (``cpu`` means the host backend); no-op if running."""
    dev = torch.device(device)
    text = "cpu" if dev.type == "cpu" else f"cuda:{dev.index if dev.index is not None else 0}"
    interfaces.init_kvcached(tp_rank=0, world_size=1, is_worker=True, device=text,
                             contiguous_layout=contiguous_layout)


@dataclass(frozen=True)
class Slots:
    """Where vLLM puts each layer's pages, in kvcached's terms.

    vLLM lays a model's KV cache out as ``num_slots`` page-sized places per block; the
    layers of different KV cache groups (full and sliding-window attention, say) share
    a slot, which is sound because a block id belongs to one group at a time. kvcached
    places ``num_slots`` "layers" and hands every layer its slot's pages.
    """

    page_bytes: int
    block_size: int  # of the first group; every group's blocks have page_bytes per slot
    num_slots: int
    slot_of: dict[str, int]  # layer name -> slot
    spec_of: dict[str, Any]  # layer name -> its KV cache spec
    group_of: dict[str, int]  # layer name -> KV cache group id


def _layer_specs(kv_cache_config: Any) -> tuple[dict[str, Any], dict[str, int]]:
    specs: dict[str, Any] = {}
    groups: dict[str, int] = {}
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        per_layer = getattr(group.kv_cache_spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
        for name in group.layer_names:
            specs[name] = per_layer[name] if per_layer is not None else group.kv_cache_spec
            groups[name] = gid
    return specs, groups


def layer_slots(kv_cache_config: Any) -> Slots:
    """Each layer's slot, or a clear refusal for a cache kvcached cannot place."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

    specs, groups = _layer_specs(kv_cache_config)
    for name, spec in specs.items():
        if not isinstance(spec, (AttentionSpec, MambaSpec)) or not getattr(spec, "has_layer_views", True):
            raise KVCachedConfigError(
                f"kvcached places attention KV caches and Mamba state; layer {name} keeps a {type(spec).__name__}. "
                "Unset ENABLE_KVCACHED to run this model without kvcached."
            )
        # vLLM pads a Mamba state page up to the attention page: the padding is just the slot's unused tail
        if isinstance(spec, AttentionSpec) and getattr(spec, "page_size_padded", None) is not None:
            raise KVCachedConfigError(
                f"kvcached does not place padded KV pages (layer {name}: page_size_padded={spec.page_size_padded}); "
                "unset ENABLE_KVCACHED for this model."
            )
    pages = {spec.page_size_bytes for spec in specs.values()}
    if len(pages) != 1:
        raise KVCachedConfigError(
            f"kvcached needs every KV cache group to use the same bytes per block; this model's groups use "
            f"{sorted(pages)}. Unset ENABLE_KVCACHED to run it without kvcached."
        )
    page = pages.pop()
    num_blocks = kv_cache_config.num_blocks
    slot_of: dict[str, int] = {}
    tensors = kv_cache_config.kv_cache_tensors
    if tensors and hasattr(tensors[0], "shared_by"):  # vLLM <= 0.28: one tensor per slot
        for idx, t in enumerate(tensors):
            if getattr(t, "block_stride", 0) or t.size != num_blocks * page:
                raise KVCachedConfigError(
                    f"vLLM packs this model's KV cache ({t}); kvcached places one tensor of {num_blocks} pages of "
                    f"{page} B per slot. Unset ENABLE_KVCACHED to run it without kvcached."
                )
            slot_of.update((name, idx) for name in t.shared_by)
    else:  # vLLM >= 0.29: layers at offset + j * layer_stride of one backing allocation; groups overlay
        starts = {name: t.offset + j * t.layer_stride for t in tensors for j, name in enumerate(t.layers)}
        order = {addr: idx for idx, addr in enumerate(sorted(set(starts.values())))}
        slot_of = {name: order[addr] for name, addr in starts.items()}
        sizes = {t.size for t in tensors}
        if sizes != {len(order) * num_blocks * page}:
            raise KVCachedConfigError(
                f"vLLM lays this model's KV cache out in {sizes} B for {len(order)} slots of {num_blocks} pages of "
                f"{page} B; kvcached places only that. Unset ENABLE_KVCACHED to run it without kvcached."
            )
    missing = sorted(set(specs) - set(slot_of))
    if missing:
        raise KVCachedConfigError(f"vLLM gave no KV cache tensor to layers {missing}; this is a kvcached bug.")
    first = kv_cache_config.kv_cache_groups[0].layer_names[0]
    return Slots(page, specs[first].block_size, len(set(slot_of.values())), slot_of, specs, groups)


def capacity_bytes(num_layers: int) -> int:
    """KV bytes to report to vLLM: every layer's share of the device, in whole kvcached pages.

    vLLM turns this into ``num_blocks = bytes // (page_size_bytes * num_layers)``. The
    share is rounded as for two buffers per layer, which never exceeds what one buffer
    per layer holds, so the blocks fit whichever way :func:`_place` lays them out
    (virtually: nothing is mapped until a block is handed out).
    """
    rt = vmm_ops.runtime()
    return interfaces.virtual_bytes_per_kv(rt, num_layers, 2) * 2 * num_layers


def reserve_tensors(num_blocks: int, block_size: int, cell: int, num_layers: int, kv_factor: int,
                    device: Any) -> tuple[list[torch.Tensor], dict[str, Any], int]:
    """Virtual KV tensors for ``num_blocks`` blocks in a fresh group (views, meta, group id)."""
    group_id = fresh_group_id()
    if kv_factor == 1:
        shape: tuple[int, ...] = (num_blocks, block_size, cell)
        kind = "MLA"
    else:
        shape = (2, num_blocks, block_size, 1, cell)
        kind = "MHA"
    views, meta = interfaces.alloc_kv_cache(shape, block_size, torch.uint8, str(device), num_layers,
                                            attention_type=kind, group_id=group_id, return_meta=True)
    if num_blocks > meta["num_blocks_per_layer"]:
        raise KVCachedConfigError(
            f"vLLM planned {num_blocks} KV blocks but kvcached's virtual tensors hold "
            f"{meta['num_blocks_per_layer']}; lower --kv-cache-memory-bytes or raise KVCACHED_HOST_MEM_LIMIT_MB."
        )
    return views, meta, group_id


def _place(num_blocks: int, block_size: int, cell: int, num_layers: int, kv_factor: int,
           device: Any) -> tuple[list[torch.Tensor], dict[str, Any], int]:
    """Reserve virtual KV tensors for ``num_blocks`` blocks; record the pool geometry."""
    global _pool_info
    views, meta, group_id = reserve_tensors(num_blocks, block_size, cell, num_layers, kv_factor, device)
    with _lock:
        _pool_info = PoolInfo(num_blocks, block_size, cell, num_layers, group_id, kv_factor)
    kv_zero.record(meta["geometry"], meta["raw_kv_tensors"], num_blocks)
    logger.info("kvcached: %d layers x %d virtual blocks of %d B in the %s layout on %s", num_layers, num_blocks,
                block_size * cell * kv_factor, vmm_ops.runtime().layout.value, device)
    return views, meta, group_id


# -- vLLM >= 0.29 ------------------------------------------------------------
def allocate_kv_cache(kv_cache_config: Any, device: torch.device, layout: Any,
                      kernel_block_sizes: list[int] | None = None) -> dict[str, torch.Tensor]:
    """Drop-in for ``vllm.v1.worker.utils.allocate_kv_cache`` (vLLM >= 0.29): same arguments, same views."""
    from vllm.v1.kv_cache_interface import KVCacheTensor, create_kv_cache_views

    if not kv_cache_config.kv_cache_tensors:
        return {}
    if plain() and vllm_allocate_kv_cache is not None:
        return vllm_allocate_kv_cache(kv_cache_config, device, layout, kernel_block_sizes)
    ensure_initialized(device, settings.contiguous_layout())
    slots = layer_slots(kv_cache_config)
    if not layout.is_block_compact:
        raise KVCachedConfigError(
            f"kvcached needs a KV layout whose pages are dense per (layer, block); vLLM resolved {layout.name}. "
            "Set VLLM_KV_CACHE_LAYOUT=LBHNC (or another layout starting with L and B)."
        )
    num_blocks, page_bytes = kv_cache_config.num_blocks, slots.page_bytes
    cell = _cell(page_bytes, slots.block_size, 1)
    views, _, _ = _place(num_blocks, slots.block_size, cell, slots.num_slots, 1, device)
    out: dict[str, torch.Tensor] = {}
    for name, slot in slots.slot_of.items():
        base = views[slot]  # (blocks, block_size, cell) uint8, block stride set by kvcached's layout
        raw = torch.as_strided(base, (1,), (1,), 0)  # the whole virtual tensor, offset 0
        place = KVCacheTensor(size=page_bytes * num_blocks, layers=[name], layer_stride=page_bytes,
                              block_stride=base.stride(0), offset=base.storage_offset())
        gid = slots.group_of[name]
        kbs = kernel_block_sizes[gid] if kernel_block_sizes and gid < len(kernel_block_sizes) else None
        out[name] = create_kv_cache_views(raw, slots.spec_of[name], num_blocks, layout, place,
                                          kernel_block_size=kbs)[0]
    return out


def _cell(page_bytes: int, block_size: int, kv_factor: int) -> int:
    if page_bytes % (block_size * kv_factor):
        raise KVCachedConfigError(
            f"a vLLM KV page of {page_bytes} B is not a whole number of bytes per token for block size "
            f"{block_size}; unset ENABLE_KVCACHED for this model."
        )
    return page_bytes // (block_size * kv_factor)


# -- vLLM 0.24 - 0.28 ----------------------------------------------------------
@dataclass(frozen=True)
class PhysicalForm:
    """How a backend lays one layer's cache out in memory (``get_kv_cache_shape`` permuted by its stride order)."""

    order: tuple[int, ...]  # logical dim of each physical dim
    shape: tuple[int, ...]  # physical shape
    block_dim: int  # physical position of the blocks
    kv_factor: int  # 1: block-first; 2: (2, blocks, ...)


def physical_form(backend: Any, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                  cache_dtype: str) -> PhysicalForm:
    """Find the block dimension by asking the backend for two block counts; refuse shapes kvcached cannot place."""
    def shape_of(n: int) -> tuple[int, ...]:
        return tuple(int(s) for s in backend.get_kv_cache_shape(n, block_size, num_kv_heads, head_size,
                                                               cache_dtype_str=cache_dtype))

    logical, probe = shape_of(num_blocks), shape_of(num_blocks + 1)
    changed = [i for i, (a, b) in enumerate(zip(logical, probe, strict=True)) if a != b]
    name = getattr(backend, "get_name", lambda: backend.__name__)()
    if len(changed) != 1:
        raise KVCachedConfigError(f"kvcached cannot find the block dimension of {name}'s KV cache shape {logical}.")
    try:
        order = tuple(int(i) for i in backend.get_kv_cache_stride_order())
        if sorted(order) != list(range(len(logical))):
            raise ValueError(order)
    except (AttributeError, NotImplementedError):
        order = tuple(range(len(logical)))
    shape = tuple(logical[i] for i in order)
    block_dim = order.index(changed[0])
    if block_dim == 0:
        return PhysicalForm(order, shape, 0, 1)
    if block_dim == 1 and shape[0] == 2:
        return PhysicalForm(order, shape, 1, 2)
    raise KVCachedConfigError(
        f"{name} lays its KV cache out as {shape} (blocks at dimension {block_dim}); kvcached places blocks-first "
        "or (2, blocks, ...) caches only. Choose another attention backend or unset ENABLE_KVCACHED."
    )


def _dense_strides(shape: tuple[int, ...]) -> list[int]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return strides[::-1]


def build_views(attn_groups: Iterable[Any], kernel_block_sizes: list[int], cache_dtype: str, kv_cache_config: Any,
                device: Any, skip: Iterable[str] = ()) -> dict[str, torch.Tensor]:
    """Every attention layer's KV cache view over kvcached's memory (vLLM 0.24-0.28), as vLLM would shape it.

    ``skip``: layers that share another layer's cache (vLLM aliases them afterwards).
    """
    ensure_initialized(device, settings.contiguous_layout())
    slots = layer_slots(kv_cache_config)
    skipped = set(skip)
    layers: list[tuple[str, Any, int]] = []  # (name, backend, kernel block size)
    for group in attn_groups:
        if group.kv_cache_group_id >= len(kernel_block_sizes):
            continue
        kbs = kernel_block_sizes[group.kv_cache_group_id]
        layers += [(name, group.backend, kbs) for name in group.layer_names if name not in skipped]
    if not layers:
        return {}
    num_blocks, page_bytes = kv_cache_config.num_blocks, slots.page_bytes
    states = [(name, backend, kbs) for name, backend, kbs in layers if _is_state(slots.spec_of[name])]
    layers = [layer for layer in layers if layer not in states]
    forms = {}
    for name, backend, kbs in layers:
        spec = slots.spec_of[name]
        key = (backend, kbs, spec.block_size, spec.num_kv_heads, spec.head_size)
        if key not in forms:
            if spec.block_size % kbs:
                raise KVCachedConfigError(
                    f"vLLM block size {spec.block_size} is not a multiple of the kernel block size {kbs}.")
            forms[key] = physical_form(backend, num_blocks * (spec.block_size // kbs), kbs, spec.num_kv_heads,
                                       spec.head_size, cache_dtype)
    kv_factors = {f.kv_factor for f in forms.values()} or {1}
    if len(kv_factors) != 1:
        raise KVCachedConfigError("kvcached needs every attention layer of a model to lay its cache out alike.")
    # A Mamba state page shares its slot with an attention page, whole: K and V then stay inside the page
    # (vLLM's own hybrid layout, blocks first), not in kvcached's two buffers.
    kv = 1 if states else kv_factors.pop()
    _, meta, _ = _place(num_blocks, slots.block_size, _cell(page_bytes, slots.block_size, kv), slots.num_slots,
                        kv, device)
    geom, raws = meta["geometry"], meta["raw_kv_tensors"]
    out: dict[str, torch.Tensor] = {}
    for name, backend, kbs in layers:
        spec = slots.spec_of[name]
        form = forms[backend, kbs, spec.block_size, spec.num_kv_heads, spec.head_size]
        dtype = spec.dtype
        itemsize = torch.empty((), dtype=dtype).element_size()
        ratio = spec.block_size // kbs
        st = geom.layer_strides(slots.slot_of[name])  # bytes: the geometry's dtype is uint8
        kernel_block_bytes = page_bytes // kv // ratio
        if ratio > 1 and form.kv_factor != kv:
            raise KVCachedConfigError(
                f"{name}: vLLM splits blocks of {spec.block_size} tokens into kernel blocks of {kbs} for a K/V-first "
                "backend in a model with Mamba state; kvcached cannot place that. Choose a blocks-first attention "
                "backend or unset ENABLE_KVCACHED."
            )
        if ratio > 1 and st.block_stride != ratio * kernel_block_bytes:
            raise KVCachedConfigError(
                f"vLLM splits blocks of {spec.block_size} tokens into kernel blocks of {kbs}, which needs blocks "
                "dense per layer; set KVCACHED_CONTIGUOUS_LAYOUT=false."
            )
        strides = [0] * len(form.shape)
        strides[form.block_dim + 1:] = _dense_strides(form.shape[form.block_dim + 1:])
        strides[form.block_dim] = st.block_stride // ratio // itemsize
        if form.kv_factor == 2:
            strides[0] = (st.kv_stride if kv == 2 else page_bytes // 2) // itemsize
        phys = torch.as_strided(raws[st.tensor].view(dtype), form.shape, strides, st.offset // itemsize)
        inverse = [form.order.index(i) for i in range(len(form.order))]
        out[name] = phys.permute(*inverse)
    unpacks = _layer_unpacks_state() if states else True
    for name, _, _ in states:
        st = geom.layer_strides(slots.slot_of[name])
        raw = raws[st.tensor]
        if unpacks:  # as vLLM >= 0.27 views them: one page of bytes per block, unpacked by the layer
            out[name] = torch.as_strided(raw.view(torch.int8), (num_blocks, 1, 1, page_bytes),
                                         (st.block_stride, page_bytes, page_bytes, 1), st.offset)
        else:
            out[name] = state_tensors(raw, st.offset, st.block_stride, slots.spec_of[name], num_blocks)
    return out


def _layer_unpacks_state() -> bool:
    """vLLM >= 0.27: ``MambaBase.bind_kv_cache`` unpacks a raw page view; before, the runner built the states."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    return hasattr(MambaBase, "bind_kv_cache")


def state_tensors(raw: torch.Tensor, offset: int, block_stride: int, spec: Any, num_blocks: int) -> list[torch.Tensor]:
    """A Mamba layer's states as vLLM before 0.27 hands them over: one tensor per (shape, dtype) of ``spec``,
    ``[num_blocks, *shape]``, each block's states packed one after another from the start of its page
    (at ``offset + block * block_stride`` bytes of ``raw``)."""
    out, at = [], offset
    for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True):
        size = torch.empty((), dtype=dtype).element_size()
        if at % size or block_stride % size:
            raise KVCachedConfigError(f"A Mamba state of {dtype} starts at byte {at} with a block stride of "
                                      f"{block_stride}, not multiples of its {size}-byte elements.")
        out.append(torch.as_strided(raw.view(dtype), (num_blocks, *shape),
                                    (block_stride // size, *_dense_strides(tuple(shape))), at // size))
        at += size * int(torch.Size(shape).numel())
    return out


def _is_state(spec: Any) -> bool:
    from vllm.v1.kv_cache_interface import MambaSpec

    return isinstance(spec, MambaSpec)

"""The VMM runtime on its kvcached module path: init, KV tensors, explicit map/unmap.

One runtime per process: :func:`init_kvcached` picks the native backend from the
device string, page size and layout; :func:`create_kv_tensors` reserves the
virtual KV tensors of one group (backed by the zero page until pages are mapped);
:class:`kvcached.kv_cache_manager.KVCacheManager` maps pages under them on demand.
Where every byte lives is decided by :mod:`kvcached.layout` only.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcached import _vmm, config
from kvcached.backend import BackendChoice, choose_backend
from kvcached.errors import KVCachedConfigError, KVCachedStateError
from kvcached.layout import KVGeometry, KVSpec, Layout
from kvcached.utils import default_contiguous_layout

PageAllocator = _vmm.PageAllocator
BlockPool = _vmm.BlockPool
Backend = _vmm.Backend
VirtualTensor = _vmm.VirtualTensor
DriverError = _vmm.DriverError
OutOfMemoryError = _vmm.OutOfMemoryError


@dataclass
class KVGroup:
    """The virtual KV tensors of one group and whoever maps pages under them."""

    group_id: int
    geometry: KVGeometry  # page-grained: one "block" per page; sizes and regions only
    vtensors: list[Any]
    tensors: list[torch.Tensor]
    allocator: Any = None  # native PageAllocator, made by the first user
    owner: Any = None  # weakref to the KVCacheManager, or "explicit" for map_to_kv_tensors

    @property
    def regions(self) -> list[tuple[int, int, int]]:
        return [(r.tensor, r.base, r.size) for r in self.geometry.regions()]

    def owner_alive(self) -> bool:
        if self.owner is None:
            return False
        if self.owner == "explicit":
            return True
        return self.owner() is not None


@dataclass
class Runtime:
    choice: BackendChoice
    backend: Any
    device: str
    page_size: int
    layout: Layout
    groups: dict[int, KVGroup] = field(default_factory=dict)
    managers: weakref.WeakSet = field(default_factory=weakref.WeakSet)

    @property
    def contiguous(self) -> bool:
        return self.layout is Layout.CONTIGUOUS

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.choice.torch_device)


_runtime: Runtime | None = None
_lock = threading.RLock()


def runtime() -> Runtime:
    """The live runtime; KVCachedStateError before :func:`init_kvcached` or after shutdown."""
    rt = _runtime
    if rt is None:
        raise KVCachedStateError(
            "kvcached is not initialized (or was shut down); call kvcached.vmm_ops.init_kvcached(device) first."
        )
    return rt


def is_initialized() -> bool:
    return _runtime is not None


def page_geometry(num_layers: int, num_pages: int, page_size: int, kv_factor: int, layout: Layout) -> KVGeometry:
    """A geometry whose block is a whole page: it has the same tensors and regions as
    every real geometry with these pages, layers, K/V factor and layout."""
    spec = KVSpec(num_layers, num_pages, 1, 1, page_size, torch.uint8, kv_factor)
    return KVGeometry(spec, layout, page_size)


def init_kvcached(device: str | torch.device = "cuda:0", page_size: int | None = None,
                  contiguous_layout: bool | str | Layout | None = None) -> None:
    """Start the runtime on ``device`` (``cuda:N``, ``hip:N`` or ``cpu``).

    ``page_size`` (bytes; None or 0: ``KVCACHED_PAGE_SIZE_MB``) must be a multiple
    of 2 MiB and of the driver's granularity. ``contiguous_layout`` None takes
    ``KVCACHED_CONTIGUOUS_LAYOUT`` or the backend's default (per-layer on HIP).
    """
    global _runtime
    with _lock:
        if _runtime is not None:
            raise KVCachedStateError(
                f"kvcached is already initialized on {_runtime.device}; call shutdown_kvcached() before "
                "initializing again."
            )
        # read here too, like every variable: a value set after import takes effect or raises now
        logging.getLogger("kvcached").setLevel(config.log_level())
        choice = choose_backend(device)
        if page_size is None or page_size == 0:
            page_size = config.page_size()
        if not isinstance(page_size, int) or isinstance(page_size, bool):
            raise KVCachedConfigError(f"page_size must be an int number of bytes, got {page_size!r}.")
        if page_size < 0 or page_size % config.BASE_PAGE:
            raise KVCachedConfigError(
                f"page_size={page_size} B is not a positive multiple of 2 MiB (2097152 B); GPU drivers map "
                "memory in 2 MiB granules."
            )
        if contiguous_layout is None:
            layout = Layout.parse(default_contiguous_layout(choice.kind))
        else:
            layout = Layout.parse(contiguous_layout)
        host_limit = config.host_memory_limit() if choice.kind == "host" else 0
        backend = _vmm.Backend(choice.kind, choice.index, host_limit)
        gran = int(backend.granularity)
        if gran and page_size % gran:
            raise KVCachedConfigError(
                f"page_size={page_size} B is not a multiple of the {choice.kind} driver's granularity {gran} B; "
                "set KVCACHED_PAGE_SIZE_MB to a multiple of it."
            )
        _runtime = Runtime(choice, backend, f"{'cpu' if choice.kind == 'host' else choice.torch_device}",
                           page_size, layout)


def shutdown_kvcached() -> None:
    """Close every KV cache manager, unmap every page and forget the KV tensors.

    Tensors the caller still holds stay valid memory (reads see zeros) until
    torch frees them; their pages are unmapped here.
    """
    global _runtime
    with _lock:
        rt = runtime()
        for mgr in list(rt.managers):
            mgr.close()
        for group in rt.groups.values():
            if group.allocator is not None:
                group.allocator.close()
                group.allocator = None
        rt.groups.clear()
        _runtime = None
        from kvcached import mem_info

        mem_info.stop_publisher()


def _check_positive_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise KVCachedConfigError(f"{name} must be a positive int, got {value!r}.")
    return value


def _check_device(rt: Runtime, dev_str: Any) -> None:
    if dev_str is None:
        return
    choice = choose_backend(dev_str)
    if choice != rt.choice:
        raise KVCachedConfigError(
            f"device {dev_str!r} does not match the device kvcached was initialized on ({rt.device}); "
            "pass the same device or re-initialize."
        )


# GPU drivers charge ~25 us per mapping for access rights, so backing a per-layer
# tensor's free space with one zero mapping per 2 MiB page costs seconds at start-up
# (benchmarks/results/vmm_cuda_nvidia_h200.md). Large zero chunks, split only around
# mapped pages, cut that 30x for about 2 x 64 MiB of device memory; free memory then
# still reads as zeros, but writes into it alias only within a chunk.
ZERO_CHUNK_BYTES = 64 << 20


def _zero_chunk(backend: _vmm.Backend, geom: KVGeometry) -> int:
    unit = geom.unit_bytes
    if backend.kind == "host" or unit * 2 > ZERO_CHUNK_BYTES:
        return 0
    return unit << ((ZERO_CHUNK_BYTES // unit).bit_length() - 1)  # unit x a power of two, as the core needs


def create_kv_tensors(size: int, dtype_size: int, dev_str: str, num_layers: int, num_kv_buffers: int = 2,
                      group_id: int = 0, unified_pool: bool = False) -> list[torch.Tensor]:
    """Reserve the virtual KV tensors of ``group_id``; return them as 1-D uint8 tensors.

    ``size`` is the bytes of one layer (K and V together, i.e. ``num_kv_buffers``
    halves), a multiple of ``num_kv_buffers * page_size``. Contiguous layout: one
    tensor of ``num_layers * size`` bytes; per-layer: ``num_layers`` tensors of
    ``size`` bytes. ``unified_pool`` keeps K and V of a block together (one buffer).
    Nothing is physically mapped yet: every page reads as zeros.
    """
    with _lock:
        rt = runtime()
        _check_positive_int("size", size)
        _check_positive_int("dtype_size", dtype_size)
        _check_positive_int("num_layers", num_layers)
        if isinstance(num_kv_buffers, bool) or num_kv_buffers not in (1, 2):
            raise KVCachedConfigError(
                f"num_kv_buffers must be 1 (MLA / unified) or 2 (K and V), got {num_kv_buffers!r}."
            )
        if not isinstance(group_id, int) or isinstance(group_id, bool) or group_id < 0:
            raise KVCachedConfigError(f"group_id must be an int >= 0, got {group_id!r}.")
        _check_device(rt, dev_str)
        kv = 1 if unified_pool else num_kv_buffers
        if size % (kv * rt.page_size):
            raise KVCachedConfigError(
                f"size={size} B per layer is not a multiple of {kv} x the {rt.page_size >> 20} MiB page; "
                "round the per-layer K/V size to whole pages."
            )
        if rt.page_size % dtype_size:
            raise KVCachedConfigError(f"dtype_size={dtype_size} does not divide the page size {rt.page_size}.")
        group = rt.groups.get(group_id)
        if group is not None:
            raise KVCachedStateError(
                f"KV tensors of group {group_id} already exist; use another group_id or shut down first."
            )
        geom = page_geometry(num_layers, size // (kv * rt.page_size), rt.page_size, kv, rt.layout)
        vtensors = [_vmm.VirtualTensor(rt.backend, geom.tensor_bytes, geom.unit_bytes, _zero_chunk(rt.backend, geom))
                    for _ in range(geom.num_tensors)]
        tensors = [torch.from_dlpack(vt.to_dlpack()) for vt in vtensors]
        for t in tensors:
            if t.dtype != torch.uint8 or t.dim() != 1 or t.numel() != geom.tensor_bytes:
                raise KVCachedStateError(f"native VirtualTensor gave {t.dtype} {tuple(t.shape)}; expected 1-D uint8.")
        rt.groups[group_id] = KVGroup(group_id, geom, vtensors, tensors)
        return list(tensors)


def kv_tensors_created(group_id: int = 0) -> bool:
    """True once :func:`create_kv_tensors` has made the tensors of ``group_id``."""
    if not isinstance(group_id, int) or isinstance(group_id, bool) or group_id < 0:
        raise KVCachedConfigError(f"group_id must be an int >= 0, got {group_id!r}.")
    rt = _runtime
    return rt is not None and group_id in rt.groups


def get_group(group_id: int = 0) -> KVGroup:
    rt = runtime()
    group = rt.groups.get(group_id)
    if group is None:
        raise KVCachedStateError(
            f"no KV tensors for group {group_id}; call create_kv_tensors(..., group_id={group_id}) first."
        )
    return group


def _pages_from_offsets(rt: Runtime, group: KVGroup, offsets: Any) -> list[int]:
    pages = []
    for off in offsets:
        if not isinstance(off, int) or isinstance(off, bool):
            raise ValueError(f"offset {off!r} is not an int byte offset.")
        if off < 0 or off % rt.page_size:
            raise ValueError(f"offset {off} is not a non-negative multiple of the page size {rt.page_size}.")
        page = off // rt.page_size
        if page >= group.geometry.num_pages:
            raise ValueError(
                f"offset {off} (page {page}) is beyond the KV tensors' {group.geometry.num_pages} pages."
            )
        pages.append(page)
    if len(set(pages)) != len(pages):
        raise ValueError("offsets name the same page twice.")
    return pages


def _explicit_allocator(rt: Runtime, group: KVGroup) -> Any:
    if group.owner_alive() and group.owner != "explicit":
        raise KVCachedStateError(
            f"group {group.group_id} is managed by a KVCacheManager; map and free through its alloc()/free()."
        )
    if group.allocator is None:
        # no reserve, no prealloc thread: unmap means unmapped now
        group.allocator = _vmm.PageAllocator(rt.backend, group.vtensors, group.regions,
                                             group.geometry.num_pages, 0, 0, False)
        group.owner = "explicit"
    return group.allocator


def map_to_kv_tensors(offsets: list[int], group_id: int = 0) -> bool:
    """Map physical memory at page byte offsets ``offsets`` (``page_id * page_size``) of
    every layer's K and V of ``group_id``. All-or-nothing: ValueError for an offset that is
    not a page boundary, past the tensors, repeated or already mapped; OutOfMemoryError when
    physical memory is short. Not for a group a :class:`KVCacheManager` manages."""
    with _lock:
        rt = runtime()
        group = get_group(group_id)
        pages = _pages_from_offsets(rt, group, offsets)
        _explicit_allocator(rt, group).map_pages(pages)
        return True


def unmap_from_kv_tensors(offsets: list[int], group_id: int = 0) -> bool:
    """Unmap the pages at ``offsets`` (mapped by :func:`map_to_kv_tensors`); they read as zeros again."""
    with _lock:
        rt = runtime()
        group = get_group(group_id)
        pages = _pages_from_offsets(rt, group, offsets)
        _explicit_allocator(rt, group).free_pages(pages)
        return True


def backend_name() -> str:
    """``cuda``, ``hip`` or ``host`` of the live runtime."""
    return runtime().choice.kind


__all__ = [
    "PageAllocator", "BlockPool", "Backend", "VirtualTensor", "DriverError", "OutOfMemoryError",
    "init_kvcached", "shutdown_kvcached", "create_kv_tensors", "kv_tensors_created",
    "map_to_kv_tensors", "unmap_from_kv_tensors", "backend_name", "page_geometry", "runtime", "is_initialized",
]

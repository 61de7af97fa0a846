"""The VMM runtime on its kvcached module path: init, KV tensors, explicit map/unmap.

One runtime per process: :func:`init_kvcached` picks the native backend from the
device string, page size and layout; :func:`create_kv_tensors` reserves the
virtual KV tensors of one group (backed by the zero page until pages are mapped);
:class:`kvcached.kv_cache_manager.KVCacheManager` maps pages under them on demand.
Where every byte lives is decided by :mod:`kvcached.layout` only.
"""

from __future__ import annotations

import logging
import math
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcached import _vmm, compat, config
from kvcached.backend import BackendChoice, choose_backend
from kvcached.errors import KVCachedConfigError, KVCachedStateError
from kvcached.layout import KVGeometry, KVSpec, Layout
from kvcached.log import get_kvcached_logger
from kvcached.utils import default_contiguous_layout

logger = get_kvcached_logger()

_NATIVE_BACKEND = _vmm.Backend  # the type itself, even where a test swaps _vmm.Backend for a subclass


class _PageAllocatorMeta(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, (_vmm.PageAllocator, StandalonePageAllocator))


class PageAllocator(metaclass=_PageAllocatorMeta):
    """Either constructor form, told apart by the first argument:

    * ``PageAllocator(backend, tensors, regions, num_pages, min_reserved=0, max_reserved=0,
      prealloc=False)`` (a :class:`Backend` first): our native allocator,
      :class:`kvcached._vmm.PageAllocator`, returned as is.
    * ``PageAllocator(num_layers, mem_size_per_layer, page_size, world_size=1, pp_rank=0,
      async_sched=False, contiguous_layout=None, enable_page_prealloc=True, num_kv_buffers=2,
      group_id=0, ipc_name="")``: the existing kvcached's form, a
      :class:`StandalonePageAllocator` over the KV tensors of ``group_id``.

    ``isinstance(x, PageAllocator)`` holds for both. Our own code builds the native
    class by its native path, ``kvcached._vmm.PageAllocator``.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else kwargs.get("backend")
        if isinstance(first, _NATIVE_BACKEND):
            return _vmm.PageAllocator(*args, **kwargs)
        return StandalonePageAllocator(*args, **kwargs)


BlockPool = _vmm.BlockPool
Backend = _vmm.Backend
VirtualTensor = _vmm.VirtualTensor
DriverError = _vmm.DriverError
OutOfMemoryError = _vmm.OutOfMemoryError


# Pages mapped in one call share one allocation per region, up to this many pages (0: the
# native default, 1 GiB worth), and go back to the driver only together. Page by page (1)
# where runs buy nothing or the pages' real owner frees them one at a time:
PAGE_BY_PAGE = 1


def page_runs(backend: Any, layout: Layout) -> int:
    """``max_run_pages`` for an allocator on ``backend`` over tensors in ``layout``.

    Runs pay off in the per-layer layout, where a page is one small mapping per layer and
    buffer (H200: grow / shrink 1 GiB 5.0 / 5.4 ms with runs, 29 / 25 ms page by page, in
    one run of benchmarks/bench_vmm.py). In the contiguous layout a page is already one
    large allocation (all layers of its blocks), and runs measured slower there (1.07 / 2.17
    ms p50, against 0.48 / 0.87 page by page in an earlier run), while a page in use would
    pin its whole run: page by page. The null backend is the tensor-parallel scheduler's: it
    maps nothing, and page-by-page accounting keeps its counts equal to what the workers hold
    (they map its pages page by page too: integration/vllm/tp.py).
    """
    if not isinstance(backend, _NATIVE_BACKEND):
        raise KVCachedConfigError(f"page_runs: backend must be a kvcached Backend, got {type(backend).__name__}.")
    return PAGE_BY_PAGE if backend.kind == "null" or Layout.parse(layout) is Layout.CONTIGUOUS else 0


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

    def take(self, owner: Any, num_pages: int, min_reserved: int, max_reserved: int, prealloc: bool,
             max_run_pages: int | None = None) -> Any:
        """A fresh native allocator of ``num_pages`` over these tensors, owned by ``owner`` (held weakly).

        The caller holds ``_lock``. A live owner (manager, standalone allocator or explicit
        mappings) is refused; a dead one's allocator is closed first. ``max_run_pages``: see
        :func:`page_runs`; None picks it from the backend and the layout.
        """
        if self.owner_alive():
            raise KVCachedStateError(
                f"group {self.group_id} already has a live KVCacheManager, PageAllocator or explicit mappings; "
                "close it (close()) or use another group_id."
            )
        if self.allocator is not None:
            self.allocator.close()
        rt = runtime()
        if max_run_pages is None:
            max_run_pages = page_runs(rt.backend, self.geometry.layout)
        self.allocator = _vmm.PageAllocator(rt.backend, self.vtensors, self.regions, num_pages, min_reserved,
                                            max_reserved, prealloc, max_run_pages=max_run_pages)
        self.owner = weakref.ref(owner)
        return self.allocator

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
    page_chosen: bool = False  # by the caller or KVCACHED_PAGE_SIZE_MB: fit_page_size leaves it alone

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
                  contiguous_layout: bool | str | Layout | None = None, null_budget: int = 0) -> None:
    """Start the runtime on ``device`` (``cuda:N``, ``hip:N`` or ``cpu``).

    ``device="null"`` reserves address space only, with ``null_budget`` bytes of pretend
    physical memory: the bookkeeping of a tensor-parallel engine's scheduler, whose workers
    map the pages it hands out.

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
        page_chosen = bool(page_size) or config.page_size_chosen()
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
        if choice.kind == "null":
            if not isinstance(null_budget, int) or isinstance(null_budget, bool) or null_budget <= 0:
                raise KVCachedConfigError(f"device 'null' needs null_budget > 0 bytes, got {null_budget!r}.")
            host_limit = null_budget
        backend = _vmm.Backend(choice.kind, choice.index, host_limit)
        gran = int(backend.granularity)
        if gran and page_size % gran:
            raise KVCachedConfigError(
                f"page_size={page_size} B is not a multiple of the {choice.kind} driver's granularity {gran} B; "
                "set KVCACHED_PAGE_SIZE_MB to a multiple of it."
            )
        _runtime = Runtime(choice, backend, choice.torch_device,
                           page_size, layout, page_chosen=page_chosen)


# vLLM sizes a Mamba hybrid's attention blocks so that one block holds a Mamba state (on the
# H200: 96 tokens, 12288 B of one layer's K), and such a block need not divide 2 MiB. A block
# must never straddle two pages, so before the first KV tensor the page grows to the smallest
# multiple of itself that whole blocks fill, up to this bound (a page is the step in which
# memory is mapped and given back).
MAX_FITTED_PAGE = 64 << 20


def fit_page_size(block_bytes: int) -> int:
    """The page size after fitting it to KV blocks of ``block_bytes``; unchanged when blocks already fill it.

    The page grows (to ``lcm(page, block_bytes)``) only while no KV tensor exists, when neither the
    caller of :func:`init_kvcached` nor ``KVCACHED_PAGE_SIZE_MB`` chose it, and up to
    :data:`MAX_FITTED_PAGE`; otherwise it stays and the caller reports the misfit.
    """
    _check_positive_int("block_bytes", block_bytes)
    with _lock:
        rt = runtime()
        if rt.page_size % block_bytes == 0 or rt.page_chosen or rt.groups:
            return rt.page_size
        fitted = math.lcm(rt.page_size, block_bytes)
        gran = int(rt.backend.granularity)
        if fitted > MAX_FITTED_PAGE or (gran and fitted % gran):
            return rt.page_size
        logger.info("kvcached: KV blocks of %d B do not divide the %d MiB page; pages are %d MiB from now on",
                    block_bytes, rt.page_size >> 20, fitted >> 20)
        rt.page_size = fitted
        return fitted


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
    if backend.kind in ("host", "null") or unit * 2 > ZERO_CHUNK_BYTES:
        return 0
    return unit << ((ZERO_CHUNK_BYTES // unit).bit_length() - 1)  # unit x a power of two, as the core needs


def create_kv_tensors(size: int, dtype_size: int, dev_str: str, num_layers: int, num_kv_buffers: int = 2,
                      group_id: int = 0, unified_pool: bool = False,
                      layout: Layout | str | None = None) -> list[torch.Tensor]:
    """Reserve the virtual KV tensors of ``group_id``; return them as 1-D uint8 tensors.

    ``size`` is the bytes of one layer (K and V together, i.e. ``num_kv_buffers``
    halves), a multiple of ``num_kv_buffers * page_size``. Contiguous layout: one
    tensor of ``num_layers * size`` bytes; per-layer: ``num_layers`` tensors of
    ``size`` bytes. ``unified_pool`` keeps K and V of a block together (one buffer).
    Nothing is physically mapped yet: every page reads as zeros. ``layout`` (None: the
    runtime's) gives this group a layout of its own: recurrent state slots are always
    contiguous (:class:`kvcached.layout.StateSlots`).
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
        geom = page_geometry(num_layers, size // (kv * rt.page_size), rt.page_size, kv,
                             rt.layout if layout is None else Layout.parse(layout))
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
        # no reserve, no prealloc thread, page by page: unmap means unmapped now
        group.allocator = _vmm.PageAllocator(rt.backend, group.vtensors, group.regions,
                                             group.geometry.num_pages, 0, 0, False, max_run_pages=PAGE_BY_PAGE)
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


class StandalonePageAllocator(compat.PageCounts):
    """The existing kvcached's ``PageAllocator(num_layers, mem_size_per_layer, page_size, ...)``.

    Hands out whole pages of the KV tensors of ``group_id`` (made by ``create_kv_tensors``,
    which must have run): ``alloc_page()`` maps one page in every layer's K and V and
    returns a :class:`Page`; ``free_page``/``free_pages`` give pages back. The group then
    belongs to this allocator, as it would to a ``KVCacheManager``; :meth:`close` (or
    ``shutdown_kvcached``) releases it.

    Arguments our core decides itself: ``contiguous_layout`` (None: the runtime's; a
    value that differs raises), ``async_sched`` (every call is thread-safe), ``pp_rank``
    (ignored), ``ipc_name`` (ignored: memory is published per KVCacheManager by
    :mod:`kvcached.mem_info`). ``world_size`` must be 1 and ``page_size`` the runtime's.
    The reserve sizes come from ``KVCACHED_MIN/MAX_RESERVED_PAGES``; the background
    refill runs from :meth:`start_prealloc_thread` when ``enable_page_prealloc``.
    """

    def __init__(self, num_layers: int, mem_size_per_layer: int, page_size: int, world_size: int = 1,
                 pp_rank: int = 0, async_sched: bool = False, contiguous_layout: bool | None = None,
                 enable_page_prealloc: bool = True, num_kv_buffers: int = 2, group_id: int = 0,
                 ipc_name: str = "") -> None:
        for name, value in (("num_layers", num_layers), ("mem_size_per_layer", mem_size_per_layer),
                            ("page_size", page_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise KVCachedConfigError(f"PageAllocator: {name} must be a positive int, got {value!r}.")
        if isinstance(world_size, bool) or world_size != 1:
            raise KVCachedConfigError(f"PageAllocator: world_size={world_size!r} is not supported; use 1.")
        if not isinstance(pp_rank, int) or isinstance(pp_rank, bool) or pp_rank < 0:
            raise KVCachedConfigError(f"PageAllocator: pp_rank must be an int >= 0, got {pp_rank!r}.")
        if not isinstance(ipc_name, str):
            raise KVCachedConfigError(f"PageAllocator: ipc_name must be a str, got {ipc_name!r}.")
        rt = runtime()
        if page_size != rt.page_size:
            raise KVCachedConfigError(
                f"PageAllocator: page_size={page_size} B differs from the runtime's {rt.page_size} B page; "
                "pass the page size init_kvcached was given."
            )
        if contiguous_layout is not None and bool(contiguous_layout) != rt.contiguous:
            raise KVCachedConfigError(
                f"PageAllocator: contiguous_layout={contiguous_layout!r} but kvcached runs the "
                f"{rt.layout.value} layout; pass None or set KVCACHED_CONTIGUOUS_LAYOUT before init_kvcached."
            )
        pages = mem_size_per_layer // page_size
        if pages == 0:
            raise KVCachedConfigError(
                f"PageAllocator: mem_size_per_layer={mem_size_per_layer} B is less than one {page_size} B page."
            )
        with _lock:
            group = get_group(group_id)
            spec = group.geometry.spec
            if spec.num_layers != num_layers or spec.kv_factor != num_kv_buffers:
                raise KVCachedConfigError(
                    f"PageAllocator(num_layers={num_layers}, num_kv_buffers={num_kv_buffers}) does not match the "
                    f"KV tensors of group {group_id} ({spec.num_layers} layers, {spec.kv_factor} K/V buffers)."
                )
            if pages > group.geometry.num_pages:
                raise KVCachedConfigError(
                    f"PageAllocator: mem_size_per_layer={mem_size_per_layer} B is {pages} pages but the KV "
                    f"tensors of group {group_id} hold {group.geometry.num_pages}."
                )
            r = config.reserve_config()
            native = group.take(self, group.geometry.num_pages, r.min_reserved_pages, r.max_reserved_pages, False)
            native.set_limit_pages(pages)
        self.native = native
        self.num_layers = num_layers
        self.mem_size_per_layer = mem_size_per_layer
        self.page_size = page_size
        self.group_id = group_id
        self.enable_page_prealloc = bool(enable_page_prealloc and r.prealloc)
        self._runtime = rt
        self._group = group

    def __repr__(self) -> str:
        return (f"PageAllocator(group_id={self.group_id}, pages={self.get_num_total_pages()}, "
                f"in_use={self.get_num_inuse_pages()}, reserved={self.get_num_reserved_pages()})")

    def start_prealloc_thread(self) -> None:
        """Start the background refill of the reserve (no-op when prealloc is disabled)."""
        if self.enable_page_prealloc:
            self.native.start_prealloc_thread()

    def alloc_page(self) -> compat.Page:
        """Map one page (every layer's K and V) and return it; ValueError when none is free,
        ``OutOfMemoryError`` when physical memory is short."""
        if self.get_num_free_pages() <= 0:
            raise ValueError("No free pages left.")
        (page_id,) = self.native.alloc_pages(1)
        return compat.Page(int(page_id), self.page_size)

    def free_page(self, page_id: int) -> None:
        self.native.free_pages([page_id])

    def free_pages(self, page_ids: list[int]) -> None:
        """Give pages back (kept mapped up to the reserve's size, the rest unmapped); ValueError,
        with nothing freed, for a page not in use."""
        self.native.free_pages(list(page_ids))

    def resize(self, new_mem_size: int) -> bool:
        """Set the size to ``new_mem_size`` bytes of one layer's K (or V).

        False, with nothing changed, below the pages in use or beyond the KV tensors;
        True otherwise. Shrinking unmaps reserve pages above the new size."""
        pages = self._pages_of(new_mem_size)
        if pages < self.get_num_inuse_pages() or pages > int(self.native.num_pages):
            return False
        self.native.set_limit_pages(pages)
        self.mem_size_per_layer = new_mem_size
        return True

    def close(self) -> None:
        """Unmap every page and give the group back (another allocator or manager may take it)."""
        self.native.close()
        if self._group.allocator is self.native:
            self._group.allocator = None
            self._group.owner = None

    def __del__(self) -> None:
        try:
            self.native.stop_prealloc_thread()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass


def backend_name() -> str:
    """``cuda``, ``hip`` or ``host`` of the live runtime."""
    return runtime().choice.kind


__all__ = [
    "PageAllocator", "BlockPool", "Backend", "VirtualTensor", "DriverError", "OutOfMemoryError",
    "init_kvcached", "shutdown_kvcached", "create_kv_tensors", "kv_tensors_created",
    "map_to_kv_tensors", "unmap_from_kv_tensors", "backend_name", "page_geometry", "runtime", "is_initialized",
]

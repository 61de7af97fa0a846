"""``KVCacheManager``: blocks of a KV cache whose physical memory follows use.

A thin layer over the native ``BlockPool`` (blocks within pages) and
``PageAllocator`` (pages mapped under the virtual KV tensors): the fast path
(``alloc``/``free``/``available_size``) is one native call, with no Python loop
over blocks and no Python lock: the native pool has its own. Blocks held by
``try_to_reserve`` and the first bind to the KV tensors are Python state, guarded
by locks of their own, so the default manager is safe to call from several threads.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from kvcached import config, limits, pool_registry, vmm_ops
from kvcached.compat import PageAllocatorView
from kvcached.deferred_free import DeferredFree
from kvcached.errors import KVCachedConfigError, KVCachedStateError, KVCachePoolExhausted
from kvcached.layout import KVGeometry, KVSpec, Layout
from kvcached.utils import get_kvcached_logger

logger = get_kvcached_logger()

KV_TENSOR_WAIT_TIMEOUT: float = 10.0  # seconds to wait for create_kv_tensors in another thread


def _locked(lock: threading.RLock, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with lock:
            return fn(*args, **kwargs)

    return wrapper


def _read_once(indices: Iterable[int]) -> list[int] | tuple[int, ...]:
    """``free``'s ids as a list or tuple (an iterator is consumed here, once)."""
    if isinstance(indices, (list, tuple)):
        return indices
    if isinstance(indices, (bytes, bytearray, memoryview, str)):  # they iterate as ints or characters
        raise ValueError(f"free: ids must be a list of ints, got {type(indices).__name__}: its bytes or characters "
                         "are not block ids; pass a list such as [3, 4].")
    if not hasattr(indices, "__iter__"):
        raise ValueError(f"free: ids must be a list of ints, got {type(indices).__name__}.")
    return list(indices)


class KVCacheManager:
    """Hands out KV block ids of one KV-cache group; maps pages under them as needed.

    Args (as in kvcached):
        num_blocks: blocks the engine may address.
        block_size: tokens per block.
        cell_size: bytes of one token of one layer's K (or V).
        num_layers: layers sharing each block id.
        world_size: tensor-parallel size (only 1 is supported).
        async_sched: every call takes one lock, so calls never interleave (the default is
            thread-safe too, but lets a plain alloc/free run beside other calls).
        reserve_null_block: block 0 is taken at start and never handed out (SGLang, vLLM padding).
        num_kv_buffers: 2 for K and V, 1 for MLA or a unified pool.
        group_id: which ``create_kv_tensors`` group the blocks live in.
        deferred_free: give freed blocks back only once the device work launched before
            the free has run (see :mod:`kvcached.deferred_free`); None: on for GPU backends.
        layout: the group's layout when it has its own (``create_kv_tensors(layout=...)``); None: the runtime's.

    Promises: a block id returned by :meth:`alloc` (or held by
    :meth:`try_to_reserve`) is backed by physical memory mapped at that moment;
    two engines sharing a device can never both hold the same memory. Numbers
    such as :meth:`available_size` are advisory: another engine may take the
    memory before the next ``alloc``, which then returns None.
    """

    def __init__(self, num_blocks: int, block_size: int, cell_size: int, num_layers: int, world_size: int = 1,
                 pp_rank: int = 0, async_sched: bool = False, reserve_null_block: bool = False,
                 num_kv_buffers: int = 2, group_id: int = 0, pool_name: str | None = None,
                 tp_size: int | None = None, deferred_free: bool | None = None,
                 layout: Layout | str | None = None) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size), ("cell_size", cell_size),
                            ("num_layers", num_layers)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise KVCachedConfigError(f"KVCacheManager: {name} must be a positive int, got {value!r}.")
        if tp_size is not None:
            world_size = tp_size
        if isinstance(world_size, bool) or world_size != 1:
            raise KVCachedConfigError(
                f"KVCacheManager: world_size={world_size}: a KVCacheManager drives one device; with vLLM, tensor "
                "parallelism goes through kvcached.integration.vllm.tp. Use 1."
            )
        if isinstance(num_kv_buffers, bool) or num_kv_buffers not in (1, 2):
            raise KVCachedConfigError(f"num_kv_buffers must be 1 or 2, got {num_kv_buffers!r}.")
        if not isinstance(group_id, int) or isinstance(group_id, bool) or group_id < 0:
            raise KVCachedConfigError(f"KVCacheManager: group_id must be an int >= 0, got {group_id!r}.")
        rt = vmm_ops.runtime()
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.cell_size = cell_size
        self.block_mem_size = block_size * cell_size
        self.num_layers = num_layers
        self.num_kv_buffers = num_kv_buffers
        self.group_id = group_id
        self.pool_name = pool_name or f"group{group_id}"
        self.async_sched = async_sched
        self.reserve_null_block = reserve_null_block
        self.page_size = rt.page_size
        # Blocks per page and bytes per page index come from the layout module (a token of one
        # layer's K or V is cell_size opaque bytes); it refuses blocks that would straddle pages.
        self.layout = rt.layout if layout is None else Layout.parse(layout)
        geom = KVGeometry(KVSpec(num_layers, num_blocks, block_size, 1, cell_size, torch.uint8, num_kv_buffers),
                          self.layout, rt.page_size)
        self.blocks_per_page = geom.blocks_per_page
        self.num_pages = geom.num_pages
        self.page_group_bytes = geom.page_group_bytes
        # NOTE: per layer and per K/V, as kvcached defines it
        self.mem_size = num_blocks * self.block_mem_size
        self._reserve = config.reserve_config()
        if rt.choice.kind == "null":  # bookkeeping only (a TP scheduler): a reserve would just take budget
            self._reserve = config.ReserveConfig(0, 0, False)
        self._util = config.gpu_utilization()

        self._reserved: list[int] = []
        # Guards every read-then-change of _reserved: alloc takes from it after a native call
        # that may drop the GIL, so another thread could take or free the same blocks meanwhile.
        self._reserved_lock = threading.Lock()
        # One thread binds; the others wait, then see _pool set only once the null block is taken.
        self._bind_lock = threading.Lock()
        self._limits: dict[str, int] = {}
        self._limit_lock = threading.Lock()
        self._memory_limit = limits.PoolLimit()  # set_memory_limit's revisioned limit (source "ipc")
        self._control_lock = threading.Lock()
        self._pool: Any = None
        self._allocator: Any = None
        self._view: PageAllocatorView | None = None
        # Set once bound to the KV tensors (the existing kvcached's post-init event): at
        # construction when they exist, otherwise at the first call that needs them.
        self._post_init_done = threading.Event()
        self._closed = False
        self.null_block: list[int] | None = None
        self.device_total = 0
        self._runtime = rt
        if deferred_free is None:
            deferred_free = rt.choice.kind in ("cuda", "hip")  # host and null: nothing runs asynchronously
        self._deferred = DeferredFree(rt.torch_device, self._release) if deferred_free else None
        rt.managers.add(self)
        pool_registry.register_kv_cache_pool(self)
        if vmm_ops.kv_tensors_created(group_id):
            self._bind()
        if async_sched:
            self._lock = threading.RLock()
            for name in ("alloc", "free", "try_to_reserve", "free_reserved", "trim", "resize", "clear"):
                setattr(self, name, _locked(self._lock, getattr(self, name)))

    # -- binding to the KV tensors ----------------------------------------
    def _bind(self) -> Any:
        with self._bind_lock:
            if self._closed:
                raise KVCachedStateError(f"KVCacheManager {self.pool_name} is closed; create a new one.")
            if self._pool is not None:
                return self._pool
            return self._bind_locked()

    def _bind_locked(self) -> Any:
        deadline = time.monotonic() + KV_TENSOR_WAIT_TIMEOUT
        while not vmm_ops.kv_tensors_created(self.group_id):
            if vmm_ops._runtime is not self._runtime:
                raise KVCachedStateError("kvcached was shut down; this KVCacheManager can no longer be used.")
            if time.monotonic() > deadline:
                raise KVCachedStateError(
                    f"KV tensors of group {self.group_id} were not created within {KV_TENSOR_WAIT_TIMEOUT:.0f} s; "
                    "call create_kv_tensors (or alloc_kv_cache) before using the KVCacheManager."
                )
            time.sleep(0.001)
        from kvcached import mem_info

        mem_info.start_publisher()  # a KVCACHED_IPC_NAME it may not use fails before anything is bound
        with vmm_ops._lock:
            group = vmm_ops.get_group(self.group_id)
            geom = group.geometry
            if (geom.spec.num_layers, geom.spec.kv_factor, geom.layout) != (self.num_layers, self.num_kv_buffers,
                                                                             self.layout):
                raise KVCachedConfigError(
                    f"KVCacheManager(num_layers={self.num_layers}, num_kv_buffers={self.num_kv_buffers}, "
                    f"layout={self.layout.value}) does not match the KV tensors of group {self.group_id} "
                    f"({geom.spec.num_layers} layers, {geom.spec.kv_factor} K/V buffers, {geom.layout.value})."
                )
            if self.num_pages > geom.num_pages:
                raise KVCachedConfigError(
                    f"num_blocks={self.num_blocks} needs {self.num_pages} pages but the KV tensors of group "
                    f"{self.group_id} hold {geom.num_pages}; lower num_blocks or create larger KV tensors."
                )
            r = self._reserve
            allocator = group.take(self, self.num_pages, r.min_reserved_pages, r.max_reserved_pages, r.prealloc)
            self._allocator = allocator
            pool = vmm_ops.BlockPool(allocator, self.blocks_per_page, self.num_blocks)
        total = int(self._runtime.backend.mem_info()[1])
        self.device_total = total
        self._set_limit("utilization", int(self._util * total) // self.page_group_bytes)
        if self.reserve_null_block:
            null = pool.alloc(1)
            if null != [0]:
                raise KVCachedStateError(f"could not reserve block 0 as the null block (got {null}).")
            self.null_block = null
        mem_info.register(self)
        self._view = PageAllocatorView(self, allocator)
        # Last: the lock-free fast path (self._pool or self._bind()) may use the pool from here on.
        self._pool = pool
        self._post_init_done.set()
        return pool

    @property
    def page_allocator(self) -> PageAllocatorView:
        """The pages under this pool: the existing kvcached's queries (``get_num_free_pages()``...,
        see :class:`kvcached.compat.PageAllocatorView`) and every attribute of our native
        allocator (``num_in_use``, ``limit_pages``...)."""
        self._bind()
        view = self._view
        if view is None:  # closed meanwhile
            raise KVCachedStateError(f"KVCacheManager {self.pool_name} is closed; create a new one.")
        return view

    # -- names of the existing kvcached ----------------------------------------
    def _wait_post_init(self) -> None:
        """Block until bound to the KV tensors (waits for them up to KV_TENSOR_WAIT_TIMEOUT)."""
        self._bind()

    @property
    def reserved_blocks(self) -> list[int]:
        """A copy of the block ids :meth:`try_to_reserve` holds (the next :meth:`alloc` hands them out first)."""
        with self._reserved_lock:
            return list(self._reserved)

    @property
    def num_reserved_blocks(self) -> int:
        """How many blocks :meth:`try_to_reserve` holds (without copying their ids)."""
        return len(self._reserved)

    def _get_num_alloced_blocks(self) -> int:
        """Blocks out of the pool: handed out, held by :meth:`try_to_reserve`, the null block."""
        return self.num_allocated_blocks()

    # -- limits -------------------------------------------------------------
    def _set_limit(self, source: str, pages: int | None) -> bool:
        """Cap mapped pages at the smallest of every source's cap (utilization, resize, kvctl)."""
        with self._limit_lock:
            if self._allocator is None:  # closed meanwhile (the monitor thread may race a close)
                return False
            if pages is None:
                self._limits.pop(source, None)
            else:
                self._limits[source] = max(0, pages)
            cap = min([self.num_pages, *self._limits.values()])
            return bool(self._allocator.set_limit_pages(cap))

    @property
    def limit_pages(self) -> int:
        self._bind()
        return int(self._allocator.limit_pages)

    # -- the kvcached API ---------------------------------------------------
    def alloc(self, need_size: int, *, spare_reserved: int = 0) -> list[int] | None:
        """``need_size`` block ids, all backed by mapped memory; None if not possible now. Blocks held by
        :meth:`try_to_reserve` go first, but ``spare_reserved`` of them, kept for another allocation."""
        pool = self._pool or self._bind()
        if spare_reserved and (not isinstance(spare_reserved, int) or isinstance(spare_reserved, bool)
                               or spare_reserved < 0):
            raise ValueError(f"alloc: spare_reserved must be an int >= 0, got {spare_reserved!r}.")
        self._drain_deferred()
        try:
            if len(self._reserved) <= spare_reserved:
                return pool.alloc(need_size)
            return self._alloc_with_reserved(pool, need_size, spare_reserved)
        except TypeError:
            raise TypeError(f"alloc: need_size must be an int number of blocks, got {need_size!r}.") from None

    def _alloc_with_reserved(self, pool: Any, need_size: int, spare: int) -> list[int] | None:
        if not isinstance(need_size, int) or isinstance(need_size, bool):
            raise TypeError(f"alloc: need_size must be an int number of blocks, got {need_size!r}.")
        if need_size < 0:
            raise ValueError(f"alloc: need_size must be an int >= 0, got {need_size!r}.")
        with self._reserved_lock:
            taken = max(0, min(need_size, len(self._reserved) - spare))
            rest = need_size - taken
            extra: list[int] = []
            if rest:
                got = pool.alloc(rest)
                if got is None:
                    return None
                extra = got
            out = self._reserved[:taken]
            del self._reserved[:taken]
        return out + extra

    def free(self, indices: Iterable[int]) -> None:
        """Give blocks back; ValueError (nothing freed) for an unknown, reserved or already free id.

        With deferred freeing, a block whose page keeps a live block returns at once (no
        page can be unmapped under the device's work); the others return once the device
        work launched so far has run, counting as allocated until then
        (:attr:`pending_free_blocks`).
        """
        pool = self._pool or self._bind()
        if self._reserved or self.null_block is not None:
            indices = self._check_freeable(indices)
        if self._deferred is None:
            pool.free(indices)
            return
        ids = _read_once(indices)
        try:
            later = pool.free_keeping_pages(ids)  # all-or-nothing: a pending id counts as freed
        except ValueError as refused:  # the manager's own message, worked out only now, off the fast path
            raise self._deferred_ids_error(pool, ids) or refused from None
        self._after_device(pool, later)

    def _give_back(self, pool: Any, ids: list[int]) -> None:
        """Free ids the manager itself holds (no check needed), those that empty a page once the device is done."""
        if self._deferred is None:
            pool.free(ids)
        else:
            self._after_device(pool, pool.free_keeping_pages(ids))

    def _after_device(self, pool: Any, later: list[int]) -> None:
        """Give ``later`` (blocks ``free_keeping_pages`` left pending) back once the device work launched so far ran.

        The engine reuses a block in stream order, as it does without kvcached: only an unmap can hurt work still
        queued, so only the blocks that would empty a page wait. A block freed at once because another allocated
        block (a held one too) kept its page may still be read by queued work: whichever free empties that page
        later, in :meth:`free` or in :meth:`free_reserved`, must wait too.
        """
        if not later:
            return
        try:
            self._deferred.add(later)
        except BaseException:
            # No event to wait for (a broken device context): these stay allocated, so a later
            # free of them can still work; the blocks freed at once are back already.
            pool.cancel_pending(later)
            raise
        self._deferred.drain()

    def _deferred_ids_error(self, pool: Any, ids: list[int] | tuple[int, ...]) -> ValueError | None:
        """The manager's own message for ids the pool refused (a pending id, a repeated one...), if it has one."""
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or not pool.is_allocated(i) or i in self._deferred:
                return ValueError(f"free: block {i!r} is not an allocated block id (double free?); nothing was freed.")
        if len(set(ids)) != len(ids):
            return ValueError("free: a block id appears twice in one call; nothing was freed.")
        return None

    def _drain_deferred(self) -> None:
        """Give back what the device has finished with (no lock taken while nothing is pending)."""
        if self._deferred is not None and len(self._deferred):
            self._deferred.drain()

    def _release(self, ids: list[int]) -> None:
        pool = self._pool  # free() takes the pending blocks that free_keeping_pages left
        if pool is not None:
            pool.free(ids)

    @property
    def pending_free_blocks(self) -> int:
        """Blocks freed but held until the device work that may read them has run (those
        whose free would have emptied a page)."""
        return 0 if self._deferred is None else len(self._deferred)

    def wait_pending_frees(self) -> None:
        """Wait for the device work that pending frees wait on, and give those blocks back (a host sync: for a
        caller that just freed memory it needs now, such as a cache evicted for an admission, not a hot path)."""
        if self._deferred is not None:
            self._deferred.flush()

    def _check_freeable(self, indices: Iterable[int]) -> list[int] | tuple[int, ...]:
        """The ids, read once: an iterator checked here would reach the pool empty."""
        indices = _read_once(indices)
        if self.null_block is not None and 0 in indices:
            raise ValueError("block 0 is the null block reserved for padding; it cannot be freed.")
        if self._reserved:
            try:
                held = set(self._reserved).intersection(indices)
            except TypeError:  # an unhashable id: pool.free names it
                held = set()
            if held:
                raise ValueError(
                    f"blocks {sorted(held)[:8]} are held by try_to_reserve(); release them with free_reserved()."
                )
        return indices

    def try_to_reserve(self, need_size: int) -> bool:
        """Take ``need_size`` more blocks now for a later :meth:`alloc`; False (nothing taken) if not possible."""
        pool = self._pool or self._bind()
        self._drain_deferred()
        if not isinstance(need_size, int) or isinstance(need_size, bool) or need_size < 0:
            raise ValueError(f"try_to_reserve: need_size must be an int >= 0, got {need_size!r}.")
        got = pool.alloc(need_size)
        if got is None:
            return False
        with self._reserved_lock:
            self._reserved.extend(got)
        return True

    def free_reserved(self, keep: int = 0) -> None:
        """Give back the blocks held by :meth:`try_to_reserve`, all but ``keep`` of them (they stay held)."""
        pool = self._pool or self._bind()
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 0:
            raise ValueError(f"free_reserved: keep must be an int >= 0, got {keep!r}.")
        with self._reserved_lock:
            held, self._reserved = self._reserved[keep:], self._reserved[:keep]
        if not held:
            return
        try:  # a held block may be all that kept a page mapped under queued work on its other blocks
            self._give_back(pool, held)
        except BaseException:
            # no event to wait for (a broken device context): those not given back at once stay held
            with self._reserved_lock:
                self._reserved.extend(i for i in held if pool.is_allocated(i))
            raise

    def trim(self) -> None:
        """Unmap every mapped page that holds no block (the prealloc reserve)."""
        self._bind()
        self._allocator.trim()

    def resize(self, new_mem_size: int) -> bool:
        """Cap the pool at ``new_mem_size`` bytes of one layer's K (or V), as in kvcached.

        True if applied now. False if more is in use than the new size: the cap
        still holds (no new pages are mapped) and the pool shrinks to it as blocks are freed.
        """
        self._bind()
        if not isinstance(new_mem_size, int) or isinstance(new_mem_size, bool) or new_mem_size <= 0:
            raise ValueError(f"resize: new_mem_size must be a positive int of bytes, got {new_mem_size!r}.")
        return self._set_limit("resize", new_mem_size // self.page_size)

    def available_size(self) -> int:
        """Blocks an :meth:`alloc` could get now (advisory: see the class docstring)."""
        pool = self._pool or self._bind()
        self._drain_deferred()
        return pool.available() + len(self._reserved)

    def get_mapped_memory_size(self, unit: str = "bytes") -> float:
        """Bytes of physical memory behind pages that hold blocks (all layers, K and V)."""
        self._bind()
        scale = {"bytes": 1, "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30}.get(unit)
        if scale is None:
            raise ValueError(f"unknown unit {unit!r}; use bytes, kb, mb or gb.")
        used = int(self._allocator.num_in_use) * self.page_group_bytes
        return used if scale == 1 else used / scale

    @property
    def mapped_bytes(self) -> int:
        """All physically mapped bytes, including the prealloc reserve."""
        self._bind()
        return int(self._allocator.mapped_bytes)

    def num_allocated_blocks(self) -> int:
        return int((self._pool or self._bind()).num_allocated())

    def clear(self) -> None:
        """Free every block (held reservations too), once the device work queued so far has run; the null block
        stays reserved."""
        pool = self._pool or self._bind()
        self.wait_pending_frees()
        with self._reserved_lock:
            self._reserved = []
        if pool.num_allocated() == 0:
            return
        keep = 0 if self.null_block is not None else -1
        if hasattr(pool, "allocated_ids"):
            ids = [i for i in pool.allocated_ids() if i != keep]
        else:
            ids = [i for i in range(self.num_blocks) if i != keep and pool.is_allocated(i)]
        if ids:
            # work queued before the reset (an overlapping engine's last batch) may still read them: the pages go
            # once it has run, and before this returns (a host sync: callers, such as SGLang's flush_cache, expect
            # the pool empty now; a reset is rare and idle)
            self._give_back(pool, ids)
            self.wait_pending_frees()

    def close(self) -> None:
        """Unmap everything and detach from the KV tensors (their pages read as zeros)."""
        if self._closed:
            return
        self._closed = True
        from kvcached import mem_info

        mem_info.unregister(self)
        pool_registry.unregister_kv_cache_pool(self)
        if self._deferred is not None:
            try:
                self._deferred.close()  # unmapping below must not pull pages from under running kernels
            except Exception as exc:  # a broken device context: unmap anyway, nothing can read it now
                logger.warning("%s: waiting for the device before unmapping failed: %s", self.pool_name, exc)
        if self._allocator is not None:
            self._allocator.close()
            group = self._runtime.groups.get(self.group_id)
            if group is not None and group.allocator is self._allocator:
                group.allocator = None
                group.owner = None
        self._pool = None
        self._allocator = None
        self._view = None

    def _raise_exhausted(self, need: int) -> None:
        raise KVCachePoolExhausted(
            f"{self.pool_name}: cannot provide {need} blocks (available about {self.available_size()}); free "
            "blocks, raise the limit (kvctl limit) or lower the demand."
        )

    def alloc_or_raise(self, need_size: int) -> list[int]:
        """Like :meth:`alloc` but raises KVCachePoolExhausted instead of returning None."""
        got = self.alloc(need_size)
        if got is None:
            self._raise_exhausted(need_size)
        return got  # type: ignore[return-value]

    # -- revisioned limits (kvcached.control) and snapshots (kvcached.observability) ------
    def set_memory_limit(self, limit_bytes: int | None, *, revision: int) -> dict[str, Any]:
        """Cap this pool at ``limit_bytes`` (all layers, K and V; whole page groups, at most the pool) as
        ``revision``. Returns :meth:`memory_limit_state` with ``status``: ``applied``, ``deferred`` (more is
        in use: the pool shrinks as blocks are freed, nothing is taken away), ``stale`` (an older revision
        than the one held) or ``conflict`` (the held revision with another limit); the last two change
        nothing. None lifts the limit. It is the limit ``kvctl limit`` sets (the instance's, split)."""
        limit, revision = limits.check_args(limit_bytes, revision)
        self._bind()
        with self._control_lock:
            return limits.set_pool_limit(self, limit, revision)

    def memory_limit_state(self) -> dict[str, Any]:
        """The revisioned limit this pool holds and how it stands (see :meth:`set_memory_limit`)."""
        self._bind()
        with self._control_lock:
            return limits.pool_state(self)

    @property
    def in_shrink(self) -> bool:
        """More pages hold blocks than the pool's cap allows: it gives pages back as blocks are freed."""
        alloc = self._allocator
        return alloc is not None and int(alloc.num_in_use) > int(alloc.limit_pages)

    def observability_snapshot(self, *, integration: str | None = None) -> Any:
        """A read-only :class:`kvcached.observability.KVCachePoolSnapshot` of this pool."""
        from kvcached import observability

        pool_registry.check_integration(integration)
        # an unbound pool is described without waiting for its KV tensors
        return observability.build_kv_cache_pool_snapshot(self, integration=integration, allocator=self._view)

    def observability_snapshot_dict(self, *, integration: str | None = None) -> dict[str, Any]:
        """:meth:`observability_snapshot` as a JSON-serialisable dict."""
        return self.observability_snapshot(integration=integration).to_dict()

    # -- what kvcached.mem_info publishes and sets --------------------------
    def usage(self) -> PoolUsage | None:
        """This pool's memory, as its /dev/shm segment shows it; None before the KV tensors
        exist or after :meth:`close`. No driver call: the monitor thread calls it."""
        alloc = self._allocator
        if alloc is None:
            return None
        rt = self._runtime
        return PoolUsage(used=int(alloc.num_in_use) * self.page_group_bytes,
                         prealloc=int(alloc.num_reserved) * self.page_group_bytes,
                         capacity=self.num_pages * self.page_group_bytes, device_total=self.device_total,
                         layout=self.layout.value,
                         device="tp" if rt.choice.kind == "null" else rt.device,  # a TP engine's ranks map it
                         peak=int(alloc.peak_in_use) * self.page_group_bytes,
                         pages_mapped=int(alloc.pages_mapped_total), pages_unmapped=int(alloc.pages_unmapped_total))

    def reset_peak(self) -> None:
        """Start a new window for ``usage().peak`` at what is in use now (``kvctl peak --reset``)."""
        alloc = self._allocator
        if alloc is not None:
            alloc.reset_peak()

    def set_limit(self, source: str, pages: int | None) -> bool:
        """Cap mapped pages for ``source`` (``"ipc"``: kvctl's limit); None lifts that source's cap.

        The pool keeps the smallest cap of all sources (utilization, :meth:`resize`, kvctl),
        never below what is in use. False once closed.
        """
        if not isinstance(source, str) or not source:
            raise ValueError(f"set_limit: source must be a non-empty name such as 'ipc', got {source!r}.")
        if pages is not None and (not isinstance(pages, int) or isinstance(pages, bool) or pages < 0):
            raise ValueError(f"set_limit: pages must be an int >= 0 or None (no cap), got {pages!r}.")
        return self._set_limit(source, pages)


@dataclass(frozen=True)
class PoolUsage:
    """Bytes of one :class:`KVCacheManager`'s pool (all layers, K and V)."""

    used: int  # pages holding blocks
    prealloc: int  # pages mapped ahead (the reserve)
    capacity: int  # every page the pool can address
    device_total: int  # the device's memory, read when the pool was bound
    layout: str  # "contiguous" or "per_layer"
    device: str
    peak: int = 0  # most bytes of pages holding blocks at once since the pool was bound or reset_peak()
    pages_mapped: int = 0  # page indices mapped since the pool was bound (each maps every layer, K and V)
    pages_unmapped: int = 0

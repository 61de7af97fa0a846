"""The page-allocator names of the existing kvcached project, over our native core.

Code written against the existing kvcached (``ovg-project/kvcached``) reads its
pages through ``manager.page_allocator.get_num_*_pages()`` and builds allocators
as ``PageAllocator(num_layers, mem_size_per_layer, page_size, ...)``. Our own API
stays primary (``KVCacheManager`` plus the native ``kvcached._vmm.PageAllocator``);
this module only translates:

* :class:`PageAllocatorView` is what ``KVCacheManager.page_allocator`` returns: the
  existing kvcached's query and control methods, and every attribute of our
  native allocator (``num_in_use``, ``limit_pages``, ``set_limit_pages``...) forwarded.
* ``kvcached.vmm_ops.StandalonePageAllocator`` (built by ``vmm_ops.PageAllocator``
  called in the existing kvcached's form) shares :class:`PageCounts`: an allocator
  of whole pages over the KV tensors of one ``create_kv_tensors`` group, without a
  ``KVCacheManager``. It lives in vmm_ops, beside the runtime it uses.
* :class:`Page` is the page object its ``alloc_page`` returns.

Units are the existing kvcached's: a *page* is ``page_size`` bytes of one layer's K
(or V) tensor, the same page index in every layer and in K and V; ``mem_size`` is
bytes of one layer's K (or V). "Free" pages are those not holding blocks, the
prealloc reserve included; "reserved" pages are mapped but hold no block.
"""

from __future__ import annotations

import weakref
from typing import Any

from kvcached.errors import KVCachedStateError


def _int(name: str, value: Any, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}.")
    return value


class Page:
    """A page's blocks, as the existing kvcached's ``InternalPage``: ``init(block_mem_size)``
    then ``alloc``/``free``. Page ``p`` holds blocks ``[p * n, (p + 1) * n)`` with
    ``n = page_size // block_mem_size`` (our layouts never let a block straddle pages)."""

    __slots__ = ("page_id", "page_size", "start_block", "end_block", "num_kv_blocks", "free_list")

    def __init__(self, page_id: int, page_size: int) -> None:
        self.page_id = _int("page_id", page_id)
        self.page_size = _int("page_size", page_size, 1)
        self.start_block: int | None = None
        self.end_block: int | None = None
        self.num_kv_blocks: int | None = None
        self.free_list: list[int] = []

    def __repr__(self) -> str:
        return f"Page(page_id={self.page_id}, free={len(self.free_list)}/{self.num_kv_blocks})"

    @staticmethod
    def get_num_blocks(page_size: int, block_mem_size: int) -> int:
        return _int("page_size", page_size, 1) // _int("block_mem_size", block_mem_size, 1)

    @staticmethod
    def get_block_range(page_id: int, page_size: int, block_mem_size: int) -> tuple[int, int]:
        n = Page.get_num_blocks(page_size, block_mem_size)
        return page_id * n, (page_id + 1) * n

    def _ready(self) -> None:
        if self.num_kv_blocks is None:
            raise KVCachedStateError(f"page {self.page_id} is not initialised; call init(block_mem_size) first.")

    def init(self, block_mem_size: int) -> None:
        start, end = self.get_block_range(self.page_id, self.page_size, block_mem_size)
        if end == start:
            raise ValueError(f"a block of {block_mem_size} B does not fit in a {self.page_size} B page.")
        self.start_block, self.end_block, self.num_kv_blocks = start, end, end - start
        self.free_list = list(range(start, end))

    def alloc(self, num_blocks: int = 1) -> list[int]:
        self._ready()
        _int("num_blocks", num_blocks)
        if not self.free_list:
            raise ValueError(f"page {self.page_id} is already full.")
        out, self.free_list = self.free_list[:num_blocks], self.free_list[num_blocks:]
        return out

    def free(self, block_id: int) -> None:
        self.free_batch([block_id])

    def free_batch(self, block_ids: list[int]) -> None:
        self._ready()
        free = set(self.free_list)
        for b in block_ids:
            if not isinstance(b, int) or isinstance(b, bool) or not self.start_block <= b < self.end_block:
                raise ValueError(f"page {self.page_id} does not hold block {b!r}.")
            if b in free:
                raise ValueError(f"block {b} is already free.")
            free.add(b)
        self.free_list.extend(block_ids)

    def empty(self) -> bool:
        self._ready()
        return len(self.free_list) == self.num_kv_blocks

    def full(self) -> bool:
        self._ready()
        return not self.free_list

    def num_free_blocks(self) -> int:
        self._ready()
        return len(self.free_list)

    def get_free_blocks(self) -> list[int]:
        self._ready()
        return list(self.free_list)


class PageCounts:
    """The existing kvcached's page queries over a native allocator ``self.native`` whose
    page cap (``limit_pages``) is the current size."""

    native: Any
    page_size: int

    def get_num_total_pages(self) -> int:
        """Pages the current size allows (``resize`` changes it)."""
        n = self.native
        return int(min(n.limit_pages, n.num_pages))

    def get_num_inuse_pages(self) -> int:
        """Pages holding at least one block."""
        return int(self.native.num_in_use)

    def get_num_free_pages(self) -> int:
        """``total - in use``: pages that can still take blocks (the reserve counts as free)."""
        return max(0, self.get_num_total_pages() - self.get_num_inuse_pages())

    def get_num_reserved_pages(self) -> int:
        """Pages mapped ahead by the prealloc reserve, holding no block."""
        return int(self.native.num_reserved)

    def get_avail_physical_pages(self) -> int:
        """Pages that could still be put in use now, given the size cap, the reserve and the
        device's free memory (advisory: another engine may take it first)."""
        return int(self.native.obtainable_pages())

    def get_page_state(self) -> dict[str, int]:
        total, inuse = self.get_num_total_pages(), self.get_num_inuse_pages()
        return {"total_pages": total, "free_pages": max(0, total - inuse), "inuse_pages": inuse,
                "reserved_pages": self.get_num_reserved_pages()}

    def _pages_of(self, new_mem_size: int) -> int:
        """Whole pages in ``new_mem_size`` bytes of one layer's K (or V), for ``resize``."""
        if not isinstance(new_mem_size, int) or isinstance(new_mem_size, bool) or new_mem_size <= 0:
            raise ValueError(f"resize: new_mem_size must be a positive int of bytes, got {new_mem_size!r}.")
        return new_mem_size // self.page_size

    def get_page_id(self, block_id: int, block_mem_size: int) -> int:
        """The page holding ``block_id`` for blocks of ``block_mem_size`` bytes."""
        return _int("block_id", block_id) // Page.get_num_blocks(self.page_size, block_mem_size)

    def trim(self) -> None:
        """Unmap the prealloc reserve; it is not refilled until pages are taken again."""
        self.native.trim()

    def stop_prealloc_thread(self) -> None:
        """Stop refilling the reserve in the background (it then changes only on calls)."""
        self.native.stop_prealloc_thread()


class PageAllocatorView(PageCounts):
    """``KVCacheManager.page_allocator``: the existing kvcached's page queries over the
    manager's native allocator; any other attribute is the native allocator's."""

    def __init__(self, manager: Any, native: Any) -> None:
        self._manager = weakref.proxy(manager)
        self.native = native
        self.page_size = manager.page_size

    def __getattr__(self, name: str) -> Any:  # only for names this class does not define
        return getattr(self.native, name)

    def __repr__(self) -> str:
        return f"PageAllocatorView({self.native!r})"

    def start_prealloc_thread(self) -> None:
        """Start (again) the background refill of the reserve; a no-op with prealloc disabled
        (``KVCACHED_PAGE_PREALLOC_ENABLED=false``) or while it runs."""
        if self._manager._reserve.prealloc:
            self.native.start_prealloc_thread()

    def resize(self, new_mem_size: int) -> bool:
        """Cap the pool at ``new_mem_size`` bytes of one layer's K (or V).

        As the existing kvcached's allocator: False, with nothing changed, when fewer
        pages than those in use; else True. The cap is the one
        :meth:`KVCacheManager.resize` sets and never exceeds the manager's own pages.
        """
        pages = self._pages_of(new_mem_size)
        if pages < self.get_num_inuse_pages():
            return False
        self._manager._set_limit("resize", pages)
        return True

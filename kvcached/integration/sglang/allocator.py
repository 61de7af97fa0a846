"""SGLang's token-to-KV allocators, drawing SGLang pages from kvcached's ``KVCacheManager``.

SGLang's allocators keep every free page in a device tensor. Here the free list is
kvcached's: a page index is a kvcached block (``block_size`` = SGLang's page size),
mapped while it is handed out and given back on free, so memory follows load.

Contract kept with SGLang (0.5.17 - 0.5.23):
- ``alloc*`` return None when the pages cannot be had now (a kvctl limit, another
  engine holding the device): SGLang's scheduler then waits or retracts, as when its
  own pool is full; ``available_size()`` counts what could be mapped now, so the
  scheduler's admission check sees the limit before it allocates;
- page 0 is SGLang's padding page: kvcached's null block, mapped and never handed out;
- a double free raises ValueError (kvcached checks every id) instead of corrupting a list;
- a decode step's pages are held from SGLang's check (``check_decode_mem``, see :mod:`patches`) to its
  allocation, so another engine cannot take them in between: the check fails instead (SGLang retracts); so
  are a prefill's, from the request's admission (``PrefillAdder``) to ``prepare_for_extend``;
- ``free_pages`` / ``release_pages`` (and ``get_all_free_pages``) stay empty: SGLang's idle checks read them.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.kernels.ops.memory.allocator import alloc_decode_kernel, alloc_extend_kernel
from sglang.srt.mem_cache.allocator import (
    BaseTokenToKVPoolAllocator,
    PagedTokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)
from sglang.srt.utils import get_num_new_pages, next_power_of_2

from kvcached.integration.sglang.pools import manager_of
from kvcached.kv_cache_manager import KVCacheManager


class Holds:
    """Blocks kept mapped in kvcached for an allocation to come (KV pages, Mamba slots), so another engine
    cannot take them between SGLang's check and its allocation; the next ``kvcached.alloc`` hands them out."""

    kvcached: KVCacheManager

    def hold(self, blocks: int, *, after_eviction: bool = False) -> bool:
        """Hold ``blocks`` in all; False (nothing more held) if the rest cannot be had now. ``after_eviction``:
        the caller has just freed cached blocks for this, whose pages go back only once the device's work
        queued before their free has run (an engine that overlaps scheduling has a batch running): wait for it
        rather than fail."""
        short = int(blocks) - self.held
        if short <= 0 or self.kvcached.try_to_reserve(short):
            return True
        if not (after_eviction and self.kvcached.pending_free_blocks):
            return False
        self.kvcached.wait_pending_frees()
        return self.kvcached.try_to_reserve(short)

    @property
    def held(self) -> int:
        """kvcached's reserved blocks (the allocator is the only one reserving in its pool)."""
        return self.kvcached.num_reserved_blocks

    def release_held(self) -> None:
        """Give back every block :meth:`hold` kept."""
        if self.held:
            self.kvcached.free_reserved()


class _KvcachedAllocatorMixin(Holds):
    """The parts both page sizes share; ``self`` is also a ``BaseTokenToKVPoolAllocator``."""

    size: int
    page_size: int
    device: Any
    is_not_in_free_group: bool
    free_group: list[torch.Tensor]

    def _bind(self, kvcache: Any) -> None:
        self.kvcached = manager_of(kvcache)
        if self.kvcached.block_size != self.page_size:
            raise ValueError(f"the allocator's page size {self.page_size} differs from its pool's "
                             f"{self.kvcached.block_size} tokens per kvcached block")
        self.clear()

    def clear(self) -> None:
        self.kvcached.clear()  # the null block (page 0) stays; held pages go too
        self.in_prefill_pass = False  # inside the scheduler's prefill pass: its holds last until the pass ends
        self.free_pages = torch.empty((0,), dtype=torch.int64, device=self.device)
        self.release_pages = torch.empty((0,), dtype=torch.int64, device=self.device)
        self.is_not_in_free_group = True
        self.free_group = []

    def available_size(self) -> int:
        return min(self.kvcached.available_size(), self.size // self.page_size) * self.page_size

    def merge_and_sort_free(self) -> None:
        """Nothing to merge: freed pages go back to kvcached at once."""

    def get_all_free_pages(self) -> torch.Tensor:
        """SGLang's free list, empty (kvcached keeps its own). SGLang 0.5.20's idle census of a hybrid pool asks
        this where earlier releases read ``free_pages`` and ``release_pages``; its paged version reads staging
        lists that this allocator never fills."""
        return self.free_pages

    held_pages = Holds.held

    def _take_pages(self, n: int) -> torch.Tensor | None:
        ids = self.kvcached.alloc(int(n))  # held pages first
        # inside the scheduler's prefill pass the rest stays held for its next allocation (the running requests'
        # decode tokens of a mixed chunk) until the pass ends (patches.releasing_prefill_holds); else what a hold
        # over-estimated goes back at once
        if ids is None or not self.in_prefill_pass:
            self.release_held()
        if ids is None:
            return None
        return torch.tensor(ids, dtype=torch.int64, device=self.device)

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        if not self.is_not_in_free_group:
            # a copy: the caller may reuse the tensor before the group ends (SGLang 0.5.18 copies here too)
            self.free_group.append(free_index.clone())
            return
        pages = free_index if self.page_size == 1 else torch.unique(free_index // self.page_size)
        self.kvcached.free(pages.tolist())

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        self.free(free_index)  # one unique over the segment: no page-representative bookkeeping

    # The group's state is kvcached's own: SGLang's base class marks a group with a flag up to 0.5.18 and with
    # ``free_group is None`` from 0.5.19, and its ``free_group_begin`` of one release would leave ``free`` of the
    # other freeing at once inside a group.
    def free_group_begin(self) -> None:
        self.is_not_in_free_group = False
        self.free_group = []

    def free_group_end(self) -> None:
        pending, self.free_group = self.free_group, []
        self.is_not_in_free_group = True
        if pending:
            self.free(torch.cat(pending))


class KvcachedTokenToKVPoolAllocator(_KvcachedAllocatorMixin, TokenToKVPoolAllocator):
    """Page size 1: a token slot is a kvcached block."""

    def __init__(self, size: int, dtype: torch.dtype, device: str, kvcache: Any, need_sort: bool) -> None:
        BaseTokenToKVPoolAllocator.__init__(self, size, 1, dtype, device, kvcache, need_sort)
        self._bind(kvcache)

    def alloc(self, need_size: int) -> torch.Tensor | None:
        return self._take_pages(need_size)


class KvcachedPagedTokenToKVPoolAllocator(_KvcachedAllocatorMixin, PagedTokenToKVPoolAllocator):
    """Page size > 1: whole SGLang pages from kvcached; token slots laid out by SGLang's own kernels."""

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, device: str, kvcache: Any,
                 need_sort: bool) -> None:
        BaseTokenToKVPoolAllocator.__init__(self, size, page_size, dtype, device, kvcache, need_sort)
        self.num_pages = size // page_size
        self.debug_mode = False
        self._bind(kvcache)

    def alloc(self, need_size: int) -> torch.Tensor | None:
        if need_size % self.page_size:
            raise ValueError(f"alloc({need_size}) is not a multiple of the page size {self.page_size}")
        pages = self._take_pages(need_size // self.page_size)
        if pages is None:
            return None
        return (pages[:, None] * self.page_size + torch.arange(self.page_size, device=self.device)).reshape(-1)

    def free_page_ids(self, page_ids: torch.Tensor) -> None:
        """Whole pages by id (SGLang 0.5.20's paged free; its own would put them on a free list kvcached never
        reads, leaving them mapped and lost)."""
        self.free(page_ids * self.page_size)

    def _new_pages(self, n: int) -> torch.Tensor | None:
        """``n`` pages for SGLang's kernels, which read only the first ``n`` (never an empty pointer)."""
        if n == 0:
            return torch.zeros((1,), dtype=torch.int64, device=self.device)
        return self._take_pages(n)

    def alloc_extend(self, prefix_lens: torch.Tensor, prefix_lens_cpu: torch.Tensor, seq_lens: torch.Tensor,
                     seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor, extend_num_tokens: int,
                     num_new_pages: int | None = None) -> torch.Tensor | None:
        if num_new_pages is None:
            num_new_pages = get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size,
                                              prefix_lens=prefix_lens_cpu)
        pages = self._new_pages(num_new_pages)
        if pages is None:
            return None
        bs = len(prefix_lens)
        out = torch.empty((extend_num_tokens,), dtype=torch.int64, device=self.device)
        alloc_extend_kernel[(bs,)](prefix_lens, seq_lens, last_loc, pages, out, next_power_of_2(bs), self.page_size)
        return out

    def alloc_decode(self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor,
                     last_loc: torch.Tensor) -> torch.Tensor | None:
        pages = self._new_pages(get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size, decode=True))
        if pages is None:
            return None
        bs = len(seq_lens)
        out = torch.empty((bs,), dtype=torch.int64, device=self.device)
        alloc_decode_kernel[(bs,)](seq_lens, last_loc, pages, out, next_power_of_2(bs), self.page_size)
        return out

"""vLLM's scheduler block pool, drawing its blocks from kvcached's ``KVCacheManager``.

vLLM's own pool keeps every block of a preallocated cache in a free queue. Here a
block id exists physically only while kvcached holds it: a block with live tokens
(``ref_cnt > 0``) or a prefix-cached block kept for reuse. The free queue holds
only those evictable cached blocks (least recently used first); every other free
block is given back to kvcached at once, so memory follows load.

Invariants:
- a block id handed to vLLM was allocated from kvcached, and is given back
  exactly once, when its ``ref_cnt`` drops to 0 and it is not kept as cache;
- ``get_num_free_blocks()`` is what the scheduler may take right now: when vLLM
  asks it with a concrete need (see ``patches``), whatever the cached blocks here
  cannot cover is reserved in kvcached first, so another engine cannot take the
  memory between the scheduler's check and its allocation. A shortfall makes
  ``allocate_slots`` return None (the request waits or is preempted); it never raises;
- when kvcached has nothing left, ``get_new_blocks`` recycles the least recently
  used cached blocks in place (still mapped), as vLLM's own pool does;
- cached blocks are bounded by ``KVCACHED_MAX_CACHED_TOKENS`` (applied outside
  ``allocate_slots``) and are given back whole pages first, so evicting them
  actually unmaps memory; so is a pool over its ``kvctl`` limit, at each step;
- when the device is nearly full (``PageAllocator.device_tight``: its free memory under
  the reserve's upper bound plus one page), every cached block is given back, at the
  next step or, for an engine with no step coming (idle), by the pool's pressure
  thread: an engine's prefix cache must never pin memory that another engine sharing
  the device needs for live requests. The thread
  takes the pool's lock, which the scheduler holds around its calls that read or change
  cached blocks (see ``patches``), so it never evicts in the middle of one.
"""
from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

from vllm.distributed.kv_events import AllBlocksCleared
from vllm.v1.core.block_pool import BlockHashToBlockMap, BlockPool
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

from kvcached import config, mem_info
from kvcached.errors import KVCachedStateError, KVCachePoolExhausted
from kvcached.integration.common import PRESSURE_CHECK_S, device_tight_every
from kvcached.integration.vllm import interfaces, kv_alloc, settings, tp
from kvcached.utils import get_kvcached_logger

logger = get_kvcached_logger()


def _lru_order(queue: FreeKVCacheBlockQueue) -> Iterator[KVCacheBlock]:
    """The queue's blocks, least recently used first, walked lazily (vLLM's list between its fake head and tail);
    the caller changes the queue only after the walk."""
    block, tail = queue.fake_free_list_head.next_free_block, queue.fake_free_list_tail
    while block is not None and block is not tail:
        yield block
        block = block.next_free_block


class KVCachedBlockPool(BlockPool):
    """A ``BlockPool`` whose physical blocks come from kvcached (same constructor as vLLM's)."""

    def __init__(self, num_gpu_blocks: int, enable_caching: bool, hash_block_size: int, *args: Any,
                 **kwargs: Any) -> None:
        info = kv_alloc.pool_info()
        if num_gpu_blocks > info.num_blocks:
            raise KVCachePoolExhausted(
                f"vLLM's scheduler asks for {num_gpu_blocks} blocks but kvcached's KV tensors hold "
                f"{info.num_blocks}; this is a kvcached bug, please report it."
            )
        super().__init__(num_gpu_blocks, enable_caching, hash_block_size, *args, **kwargs)
        # vLLM's queue starts with every block; ours holds only evictable cached blocks.
        self.free_block_queue = FreeKVCacheBlockQueue([])
        # tensor parallel: bookkeeping here, the workers map the pages (see ``tp``)
        self.tp_changes = tp.PageChanges() if info.world_size > 1 else None
        if self.tp_changes is not None:
            self.kv = tp.scheduler_manager(info, num_gpu_blocks)
        else:
            self.kv = interfaces.get_kv_cache_manager(num_gpu_blocks, info.block_size, info.cell_size,
                                                      info.num_layers, num_kv_buffers=info.kv_factor,
                                                      group_id=info.group_id, pool_name="vllm",
                                                      reserve_null_block=True)
            # a serving step must not wait on the driver: whole-run refills, freed pages kept while the load
            # was that high within the window (memory still goes back once it has stayed down that long)
            self.kv.page_allocator.set_lazy_reserve_ms(config.lazy_reserve_ms())
        cap = kv_alloc.memory_cap()
        if cap is not None:
            # vLLM's memory flag becomes this engine's limit, set as kvctl sets one, so kvctl shows and changes it
            publisher = mem_info.start_publisher()
            mem_info.write_limit(publisher.name, cap)
            publisher.tick()  # applied before the first step, not a monitor period later
            logger.info("kvcached: this engine's KV memory is capped at %.2f GiB (kvctl can change it)", cap / 2**30)
        if self.null_block.block_id != 0 or self.kv.null_block != [0]:
            raise KVCachePoolExhausted("kvcached could not reserve block 0 as vLLM's null block.")
        self.blocks_per_page = self.kv.blocks_per_page
        self._page_count: Counter[int] = Counter({0: 1})  # blocks held from kvcached, per page
        self._held = 0  # blocks reserved in kvcached for the allocation the scheduler just checked
        self._pending_need: int | None = None
        self._allocating = False
        self._frees_batched = 0  # inside a scheduler call that frees many requests (see batched_frees)
        cached = settings.max_cached_blocks(info.block_size)
        self.max_cached_blocks = 1 << 62 if cached < 0 else cached
        self._pressure_checked = 0.0
        self.pressure_evictions = 0  # cached blocks given back because the device was nearly full
        self.lock = threading.RLock()
        self._stop_relief = threading.Event()
        self._relief: threading.Thread | None = None
        if self.tp_changes is None and enable_caching:
            self._relief = threading.Thread(target=self._relief_loop, name="kvcached-cache-relief", daemon=True)
            self._relief.start()

    # -- how many blocks the scheduler may take ---------------------------
    def expect(self, need: int) -> None:
        """The scheduler is about to compare ``need`` blocks with :meth:`get_num_free_blocks`."""
        self._pending_need = need

    def get_num_free_blocks(self) -> int:
        need, self._pending_need = self._pending_need, None
        if need is not None and need > 0 and not self._reserve(need):
            return need - 1  # a scheduling miss: allocate_slots returns None
        return self.kv.available_size() + self.free_block_queue.num_free_blocks

    def _reserve(self, need: int) -> bool:
        """Make sure ``need`` blocks can be handed out: held in kvcached or cached (evictable) here.

        Nothing is evicted now: the scheduler may be about to reuse those very cached
        blocks as prefix hits. ``get_new_blocks`` recycles cached blocks it needs.
        """
        short = need - self._held - self.free_block_queue.num_free_blocks
        if short <= 0:
            return True
        if self.kv.try_to_reserve(short):
            self._held += short
            return True
        return False

    def begin_allocation(self) -> None:
        self._allocating = True

    def end_allocation(self) -> None:
        """After ``allocate_slots``: give back unused reservations, apply the cache bound."""
        self._allocating = False
        if self._held:
            self._held = 0
            self.kv.free_reserved()
        self._bound_cache()

    @contextlib.contextmanager
    def batched_frees(self) -> Iterator[None]:
        """The cache bound once at the end instead of after every request's blocks: ``update_from_output``
        frees every request that finished in the step (a whole batch at once when outputs are the same
        length), and each bound past the limit scans the cache (on the H200, 128 finished requests with
        a 16000-token cache cost 24 ms of the step in ``_evict``: ``docs/serving_overhead.md``)."""
        self._frees_batched += 1
        try:
            yield
        finally:
            self._frees_batched -= 1
            if not self._frees_batched and not self._allocating:
                self._bound_cache()

    def _bound_cache(self) -> None:
        excess = self.free_block_queue.num_free_blocks - self.max_cached_blocks
        if excess > 0:
            self._evict(excess)

    # -- allocation --------------------------------------------------------
    def _take(self, n: int) -> list[KVCacheBlock]:
        """``n`` blocks: from kvcached, or by recycling least recently used cached blocks (as vLLM does)."""
        ids = self.kv.alloc(n)
        recycled: list[KVCacheBlock] = []
        if ids is None:
            reuse = min(n, self.free_block_queue.num_free_blocks)
            ids = self.kv.alloc(n - reuse) if n > reuse else []
            if ids is None:
                raise KVCachePoolExhausted(
                    f"kvcached could not provide {n} KV blocks that the scheduler had checked for; free memory, "
                    "raise the limit (kvctl limit) or lower the load."
                )
            recycled = self.free_block_queue.popleft_n(reuse)  # still mapped: no trip through kvcached
        self._held = max(0, self._held - len(ids))
        bpp = self.blocks_per_page
        changes = self.tp_changes
        for i in ids:
            page = i // bpp
            self._page_count[page] += 1
            if changes is not None and self._page_count[page] == 1:
                changes.touch(page)
        return [self.blocks[i] for i in ids] + recycled

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks <= 0:
            return []
        ret = self._take(num_blocks)
        if getattr(self, "_reuse_watchers", None):  # vLLM >= 0.30
            self._notify_reuse(ret)
        for block in ret:
            if self.enable_caching:
                self._maybe_evict_cached_block(block)
            if block.ref_cnt != 0:
                raise AssertionError(f"kvcached handed out block {block.block_id} that vLLM still uses.")
            block.ref_cnt = 1
            if self.metrics_collector:
                self.metrics_collector.on_block_allocated(block)
        return ret

    def _give_back(self, blocks: list[KVCacheBlock]) -> None:
        if not blocks:
            return
        bpp = self.blocks_per_page
        changes = self.tp_changes
        for b in blocks:
            page = b.block_id // bpp
            self._page_count[page] -= 1
            if changes is not None and self._page_count[page] == 0:
                changes.touch(page)
        self.kv.free([b.block_id for b in blocks])

    def take_page_changes(self) -> tuple[list[int], list[int]]:
        """Tensor parallel: pages every worker must map and may unmap since the last call."""
        assert self.tp_changes is not None
        return self.tp_changes.take(self._page_count)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        keep: list[KVCacheBlock] = []
        drop: list[KVCacheBlock] = []
        others: dict[BlockPool, list[KVCacheBlock]] = {}
        for block in ordered_blocks:
            owner = getattr(block, "pool", None)  # vLLM >= 0.30 tags blocks with their pool
            if owner is not None and owner is not self:
                others.setdefault(owner, []).append(block)
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and not block.is_null:
                if self.enable_caching and block.block_hash is not None:
                    keep.append(block)
                else:
                    drop.append(block)
        self._give_back(drop)
        self.free_block_queue.append_n(keep)
        # inside allocate_slots the scheduler may hold cached hits; in batched_frees the bound comes at its end
        if not self._allocating and not self._frees_batched:
            self._bound_cache()
        for pool, blocks in others.items():
            pool.free_blocks(blocks)

    # -- eviction ----------------------------------------------------------
    def _evict(self, want: int) -> int:
        """Give back at least ``want`` cached blocks (all if fewer), whole pages first; returns how many."""
        queue = self.free_block_queue
        if want <= 0 or queue.num_free_blocks == 0:
            return 0
        bpp = self.blocks_per_page
        by_page: dict[int, list[KVCacheBlock]] = {}
        lru: list[KVCacheBlock] = []
        chosen: list[KVCacheBlock] = []
        # Least recently used first, and only as far as needed: a page whose every block held here is cached
        # is whole and goes as soon as it is complete, so a cache of finished requests' pages is rarely walked
        # to its end (a full walk of a 1000-block cache cost ~0.2 ms a finished request: docs/serving_overhead.md).
        for block in _lru_order(queue):
            lru.append(block)
            page = block.block_id // bpp
            blocks = by_page.setdefault(page, [])
            blocks.append(block)
            if len(blocks) == self._page_count[page]:
                chosen.extend(blocks)
                if len(chosen) >= want:
                    break
        if len(chosen) < want:
            # a page that keeps a live block stays mapped whatever goes: evict no more than asked, oldest first
            taken = {b.block_id for b in chosen}
            rest = [b for b in lru if b.block_id not in taken]
            chosen.extend(rest[:want - len(chosen)])
        for block in chosen:
            queue.remove(block)
            if self.enable_caching:
                self._maybe_evict_cached_block(block)
        if getattr(self, "_reuse_watchers", None):
            self._notify_reuse(chosen)
        self._give_back(chosen)
        return len(chosen)

    def shrink_to_limit(self) -> None:
        """At a step's start: evict cached blocks while the pool holds more pages than its limit allows,
        and all of them while the device is nearly full."""
        if not self.free_block_queue.num_free_blocks:
            return
        alloc = self.kv.page_allocator
        over = int(alloc.num_in_use) - int(alloc.limit_pages)
        if over > 0:
            self._evict(over * self.blocks_per_page)
        elif self._device_tight(alloc):
            self.pressure_evictions += self._evict(self.free_block_queue.num_free_blocks)

    def relieve_pressure(self) -> int:
        """Give every cached block back if the device is nearly full; how many. Never waits: while the
        scheduler holds the pool's lock (a step is running, and will check itself) it does nothing."""
        if not self.free_block_queue.num_free_blocks or not self.lock.acquire(blocking=False):
            return 0
        try:
            if not self.free_block_queue.num_free_blocks:
                return 0
            if not self._device_tight(self.kv.page_allocator):
                return 0
            n = self._evict(self.free_block_queue.num_free_blocks)
            self.pressure_evictions += n
            return n
        finally:
            self.lock.release()

    def _relief_loop(self) -> None:
        warned = False
        while not self._stop_relief.wait(2.5 * PRESSURE_CHECK_S):
            try:
                self.relieve_pressure()
            except KVCachedStateError:
                # kvcached closed under the engine (its exit handler ran before the scheduler's shutdown): the
                # memory is unmapped already, nothing is left to give back
                return
            except Exception as exc:  # a driver error: say it once, keep the engine running
                if not warned:
                    logger.warning("kvcached: the cache-relief thread could not check the device: %s", exc)
                    warned = True

    def _device_tight(self, alloc: Any) -> bool:
        return device_tight_every(alloc, self, "_pressure_checked", PRESSURE_CHECK_S)

    def evict_blocks(self, block_ids: set[int]) -> None:
        super().evict_blocks(block_ids)
        # A block whose hash was dropped is no longer cache: give it back if nobody holds it.
        stale = [self.blocks[i] for i in block_ids
                 if self.blocks[i].ref_cnt == 0 and not self.blocks[i].is_null
                 and self.blocks[i].block_hash is None and self.blocks[i].next_free_block is not None]
        for block in stale:
            self.free_block_queue.remove(block)
        self._give_back(stale)

    def _num_in_use(self) -> int:
        """Blocks that requests hold (not the null block, cached or reserved ones)."""
        return (self.kv.num_allocated_blocks() - 1 - self.free_block_queue.num_free_blocks - self._held
                - self.kv.pending_free_blocks)

    def reset_prefix_cache(self) -> bool:
        in_use = self._num_in_use()
        if in_use > 0:
            logger.warning("Failed to reset prefix cache because %d blocks are still in use", in_use)
            return False
        self._evict(self.free_block_queue.num_free_blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.cached_block_hashes_by_block.clear()
        if getattr(self, "_reuse_watchers", None):
            self._notify_reuse([self.blocks[i] for i in list(self._reuse_watchers)])
        for block in self.blocks:
            block.reset_hash()
        if self.metrics_collector:
            self.metrics_collector.reset()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        logger.info("Successfully reset prefix cache")
        return True

    def get_usage(self) -> float:
        return max(0.0, self._num_in_use() / max(1, self.num_gpu_blocks - 1))

    def close(self) -> None:
        self._stop_relief.set()
        if self._relief is not None and self._relief is not threading.current_thread():
            self._relief.join(timeout=5)
        with self.lock:
            self.kv.close()

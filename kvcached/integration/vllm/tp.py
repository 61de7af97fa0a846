"""Tensor parallelism: the scheduler decides which pages hold blocks, every worker maps them.

With TP >= 2 vLLM's scheduler (the engine core) and its workers run in separate
processes, each worker on its own GPU. kvcached then splits its work in two:

* The scheduler's block pool keeps kvcached's bookkeeping (pages, limits, ``kvctl``,
  the ``/dev/shm`` segment) on the ``null`` backend: address space, no memory. Its
  budget is what the smallest rank's device holds, times the number of ranks, and
  its limits count the whole engine (every rank's pages).
* The pages that gained or lost their last block travel with the next step's
  ``SchedulerOutput`` (attribute ``kvcached_pages``: pages to map, pages to unmap),
  which vLLM sends to every worker. Each worker applies them before it runs the step,
  so every rank maps the same pages in the same order, with no channel of our own.
  A page to unmap stays mapped until the work already queued on that worker's stream
  has run (an event), or for good if the scheduler hands it out again meanwhile.
* When the engine goes idle the last changes go out by a collective RPC, so an idle
  engine shrinks on every rank.

A worker's mappings live and die with its process: a worker that dies leaves nothing
mapped on any rank, and the others keep only what the scheduler still holds.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch

from kvcached import config, vmm_ops
from kvcached.deferred_free import record_event
from kvcached.errors import KVCachedConfigError, KVCachedStateError
from kvcached.integration.vllm import interfaces, kv_alloc
from kvcached.utils import get_kvcached_logger

logger = get_kvcached_logger()

ATTR = "kvcached_pages"  # on SchedulerOutput: (pages to map, pages to unmap)

_lock = threading.Lock()
_worker: WorkerPages | None = None


# -- worker side -------------------------------------------------------------
class WorkerPages:
    """This rank's pages, mapped and unmapped as the scheduler says."""

    def __init__(self, info: kv_alloc.PoolInfo) -> None:
        rt = vmm_ops.runtime()
        r = config.reserve_config()
        with vmm_ops._lock:  # every page of the tensors: the scheduler hands out no more
            group = vmm_ops.get_group(info.group_id)
            # page by page: a page the scheduler frees must leave this GPU (its budget counts pages)
            self.alloc = group.take(self, group.geometry.num_pages, r.min_reserved_pages, r.max_reserved_pages,
                                    r.prealloc, max_run_pages=vmm_ops.PAGE_BY_PAGE)
        self.alloc.map_pages([0])  # block 0, vLLM's null block, lives in page 0 on every rank
        self.asynchronous = rt.choice.kind in ("cuda", "hip")
        self.device = torch.device(rt.torch_device)
        self.pending: list[tuple[Any, set[int]]] = []  # (event, pages) unmapped once the event has completed

    def apply(self, maps: Iterable[int], unmaps: Iterable[int], wait: bool = False) -> None:
        unmaps = set(unmaps)
        if unmaps:
            if self.asynchronous:
                # after every kernel this rank has queued so far, which may still read them
                self.pending.append((record_event(self.device), unmaps))
            else:
                self.alloc.free_pages(sorted(unmaps))
        fresh = []
        for page in maps:
            for _, pages in self.pending:
                if page in pages:  # handed out again before it was unmapped: keep it
                    pages.discard(page)
                    break
            else:
                fresh.append(page)
        if fresh:
            try:
                self.alloc.map_pages(sorted(fresh))
            except Exception as exc:
                raise KVCachedStateError(
                    f"kvcached (tensor parallel): this rank could not map {len(fresh)} KV pages the scheduler handed "
                    f"out ({exc}). Another process took this GPU's memory below the engine's budget; lower this "
                    "engine's limit (kvctl limit) or its neighbours' use."
                ) from exc
        self.drain(wait)

    def drain(self, wait: bool = False) -> None:
        keep = []
        for event, pages in self.pending:
            if wait:
                event.synchronize()
            if wait or event.query():
                if pages:
                    self.alloc.free_pages(sorted(pages))
            else:
                keep.append((event, pages))
        self.pending = keep

    def state(self) -> dict[str, int]:
        return {"in_use": int(self.alloc.num_in_use), "peak": int(self.alloc.peak_in_use),
                "pending": sum(len(p) for _, p in self.pending)}


def report_pool(worker: Any = None) -> dict[str, Any]:
    """Collective RPC: this rank's geometry and device size; starts its page mapper."""
    global _worker
    info = kv_alloc.pool_info()
    rt = vmm_ops.runtime()
    with _lock:
        if _worker is None:
            _worker = WorkerPages(info)
    return {"num_blocks": info.num_blocks, "block_size": info.block_size, "cell_size": info.cell_size,
            "num_layers": info.num_layers, "kv_factor": info.kv_factor, "layout": rt.layout.value,
            "page_size": rt.page_size, "device_total": int(rt.backend.mem_info()[1]),
            "memory_cap": kv_alloc.memory_cap()}


def on_step(scheduler_output: Any) -> None:
    """In ``Worker.execute_model``, before the step runs."""
    ops = getattr(scheduler_output, ATTR, None)
    if ops is None:
        return
    worker = _worker
    if worker is None:
        raise KVCachedStateError("kvcached (tensor parallel): pages arrived before this rank reported its pool.")
    worker.apply(*ops)


def apply_pages(worker: Any, maps: list[int], unmaps: list[int]) -> dict[str, int]:
    """Collective RPC of an idle engine: apply the last changes and unmap without waiting for a step."""
    pages = _worker
    if pages is None:
        return {}
    pages.apply(maps, unmaps, wait=True)
    return pages.state()


def rank_state(worker: Any = None) -> dict[str, int]:
    """Collective RPC ``kvcached_rank_state``: pages this rank holds now and at most since start, and pages
    waiting to be unmapped (for tests and tools)."""
    pages = _worker
    return pages.state() if pages is not None else {}


def reset_worker() -> None:
    global _worker
    with _lock:
        _worker = None


# -- engine-core side --------------------------------------------------------
def after_kv_caches(engine_core: Any) -> None:
    """After every worker placed its KV cache: one pool description for the scheduler's side."""
    parallel = engine_core.vllm_config.parallel_config
    world = int(parallel.world_size)
    if world <= 1 or kv_alloc.placed_here():
        # one rank, or a worker in this very process (torchrun-style launchers: every rank runs the same
        # scheduler beside its own worker): the scheduler maps its own pages, as without parallelism
        return
    if int(getattr(parallel, "pipeline_parallel_size", 1)) > 1:
        raise KVCachedConfigError(
            f"kvcached supports tensor parallelism, not pipeline parallelism (pipeline_parallel_size="
            f"{parallel.pipeline_parallel_size}); unset ENABLE_KVCACHED for this engine."
        )
    reports = engine_core.model_executor.collective_rpc("kvcached_report_pool")
    geometry = [{k: v for k, v in r.items() if k not in ("device_total", "memory_cap")} for r in reports]
    if any(g != geometry[0] for g in geometry):
        raise KVCachedConfigError(f"kvcached: the ranks placed their KV caches differently: {geometry}.")
    g = geometry[0]
    budget = min(int(r["device_total"]) for r in reports)
    kv_alloc.set_remote_pool_info(kv_alloc.PoolInfo(g["num_blocks"], g["block_size"], g["cell_size"],
                                                    g["num_layers"], 0, g["kv_factor"], world_size=world,
                                                    rank_bytes=budget, layout=g["layout"], page_size=g["page_size"]))
    caps = [int(r["memory_cap"]) for r in reports if r.get("memory_cap") is not None]
    if caps:  # vLLM's memory flags gave each rank its KV bytes: the engine's limit counts every rank
        kv_alloc.set_memory_cap(min(caps) * world)
    logger.info("kvcached: tensor parallel x%d, every rank maps the pages this scheduler hands out", world)


def scheduler_manager(info: kv_alloc.PoolInfo, num_blocks: int) -> Any:
    """The scheduler's KVCacheManager on the null backend, counting every rank's pages."""
    w = info.world_size
    if not vmm_ops.is_initialized():
        # the workers' page size and layout, whatever this process's environment says: a block's page
        # must be the same number here and on every rank
        interfaces.init_kvcached(device="null", contiguous_layout=info.layout == "contiguous",
                                 null_budget=info.rank_bytes * w, page_size=info.page_size)
    # one pretend layer set per rank: a page index is then every rank's memory behind it
    _, _, group = kv_alloc.reserve_tensors(num_blocks, info.block_size, info.cell_size, info.num_layers * w,
                                           info.kv_factor, "null")
    return interfaces.get_kv_cache_manager(num_blocks, info.block_size, info.cell_size, info.num_layers * w,
                                           num_kv_buffers=info.kv_factor, group_id=group, pool_name="vllm",
                                           reserve_null_block=True)


def attach_page_changes(scheduler: Any, output: Any) -> None:
    """After ``Scheduler.schedule``: the step's output carries the page changes to every worker."""
    pool = scheduler.kv_cache_manager.block_pool
    if getattr(pool, "tp_changes", None) is not None:
        setattr(output, ATTR, pool.take_page_changes())


class PageChanges:
    """Pages whose block count crossed zero since the last step went out (the scheduler's block pool)."""

    def __init__(self) -> None:
        self.shipped: set[int] = {0}  # what the workers hold: page 0 (the null block) from the start
        self.dirty: set[int] = set()

    def touch(self, page: int) -> None:
        self.dirty.add(page)

    def take(self, counts: Counter[int]) -> tuple[list[int], list[int]]:
        maps = sorted(p for p in self.dirty if counts[p] > 0 and p not in self.shipped)
        unmaps = sorted(p for p in self.dirty if counts[p] <= 0 and p in self.shipped)
        self.shipped.update(maps)
        self.shipped.difference_update(unmaps)
        self.dirty.clear()
        return maps, unmaps

    def pending(self) -> bool:
        return bool(self.dirty)


def flush_if_idle(engine_core: Any) -> None:
    """After a step: an engine with nothing left to run sends its last page changes now."""
    scheduler = getattr(engine_core, "scheduler", None)
    pool = getattr(getattr(scheduler, "kv_cache_manager", None), "block_pool", None)
    changes = getattr(pool, "tp_changes", None)
    # finished requests whose ids are still to be sent count as "has requests", but nothing runs for them
    # any more: a step still queued on a worker runs before this RPC there, and the unmap waits for it
    if changes is None or not changes.pending() or scheduler.get_num_unfinished_requests() > 0:
        return
    maps, unmaps = pool.take_page_changes()
    if maps or unmaps:
        engine_core.model_executor.collective_rpc("kvcached_apply_pages", args=(maps, unmaps))

"""Versioned, read-only JSON snapshots of kvcached: what it can do, its runtime, each live pool.

Snapshots carry ``schema_version`` (``kvcached.observability.v1``, the existing kvcached's
schema; fields are only ever added). A pool snapshot reads any object with a KV manager's
attributes (``page_allocator.get_page_state()`` or the ``get_num_*_pages`` queries,
``available_size()``, ``mem_size``...), so a monitor or controller can test against a double.

Block counts overlap (do not add them): ``allocated_blocks`` includes the blocks held by
``try_to_reserve`` (``reserved_blocks``), and so does ``available_blocks`` (the next alloc
takes them first). ``reserved_pages`` is something else: pages mapped ahead of demand.
Bytes are of all layers and buffers; ``virtual_per_layer_bytes`` is one layer's K and V.
The page counts come from one allocator query; the rest may be a moment apart.
For Prometheus, see :mod:`kvcached.metrics`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from kvcached.pool_registry import get_registered_kv_cache_pools

SCHEMA_VERSION = "kvcached.observability.v1"
_ASK = object()  # build_kv_cache_pool_snapshot: read manager.page_allocator


@dataclass(frozen=True)
class RuntimeSnapshot:
    schema_version: str
    engine: str
    initialized: bool
    device: str | None
    world_size: int
    pp_rank: int
    async_sched: bool
    contiguous_layout: bool
    is_worker: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class KVCachePoolSnapshot:
    schema_version: str
    pool_type: str
    integration: str | None
    pool_name: str | None
    group_id: int
    num_layers: int
    num_kv_buffers: int
    page_size_bytes: int
    block_size_bytes: int
    total_blocks: int
    available_blocks: int
    allocated_blocks: int
    reserved_blocks: int
    available_bytes: int
    allocated_bytes: int
    reserved_bytes: int
    null_block_reserved: bool
    virtual_per_layer_bytes: int
    virtual_total_bytes: int
    mapped_bytes: int
    total_pages: int | None
    free_pages: int | None
    inuse_pages: int | None
    reserved_pages: int | None
    available_physical_pages: int | None
    effective_free_pages: int | None
    in_shrink: bool
    shrink_target_blocks: int | None
    resize_target_bytes: int | None
    # added by this kvcached (None where the allocator does not say)
    peak_inuse_pages: int | None = None
    pages_mapped_total: int | None = None
    pages_unmapped_total: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def get_capabilities() -> dict[str, Any]:
    """What this kvcached exposes (JSON-serialisable)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "features": {
            "runtime_snapshot": True,
            "kv_cache_pool_snapshot": True,
            "registered_kv_cache_pool_snapshots": True,
            "read_only": True,  # snapshots change nothing; limits are kvcached.control's
            "policy_control": False,
            "memory_limit_control": True,
            "prometheus_metrics": True,
        },
        "pool_snapshot_fields": [f.name for f in fields(KVCachePoolSnapshot)],
        "runtime_snapshot_fields": [f.name for f in fields(RuntimeSnapshot)],
    }


def build_runtime_snapshot(*, engine: str, initialized: bool, device: str | None, world_size: int, pp_rank: int,
                           async_sched: bool, contiguous_layout: bool,
                           is_worker: bool | None = None) -> RuntimeSnapshot:
    return RuntimeSnapshot(SCHEMA_VERSION, engine, initialized, device, world_size, pp_rank, async_sched,
                           contiguous_layout, is_worker)


def runtime_snapshot(engine: str = "kvcached") -> RuntimeSnapshot:
    """This process's kvcached runtime (``initialized`` False before init_kvcached)."""
    from kvcached import vmm_ops

    rt = vmm_ops._runtime
    if rt is None:
        return build_runtime_snapshot(engine=engine, initialized=False, device=None, world_size=1, pp_rank=0,
                                      async_sched=False, contiguous_layout=False)
    managers = list(rt.managers)
    return build_runtime_snapshot(engine=engine, initialized=True, device=rt.device, world_size=1,
                                  pp_rank=0, async_sched=any(m.async_sched for m in managers),
                                  contiguous_layout=rt.contiguous)


def _ask(obj: Any, name: str) -> int | None:
    """``obj.name()`` (or the attribute ``obj.name``) as an int, None if obj has no such thing."""
    value = getattr(obj, name, None)
    if callable(value):
        value = value()
    return None if value is None else int(value)


def _pages(allocator: Any) -> tuple[int | None, int | None, int | None, int | None]:
    state_of = getattr(allocator, "get_page_state", None)
    if callable(state_of):  # one query: the four counts of one instant
        s = state_of()
        return int(s["total_pages"]), int(s["free_pages"]), int(s["inuse_pages"]), int(s["reserved_pages"])
    return (_ask(allocator, "get_num_total_pages"), _ask(allocator, "get_num_free_pages"),
            _ask(allocator, "get_num_inuse_pages"), _ask(allocator, "get_num_reserved_pages"))


def build_kv_cache_pool_snapshot(manager: Any, *, integration: str | None = None,
                                 allocator: Any = _ASK) -> KVCachePoolSnapshot:
    """A snapshot of a ``KVCacheManager`` or any object with its attributes (``allocator``: given by a
    manager that is not bound yet as None, else read from ``manager.page_allocator``)."""
    if allocator is _ASK:
        allocator = manager.page_allocator
    layers, buffers = _ask(manager, "num_layers") or 0, _ask(manager, "num_kv_buffers") or 0
    page_size, block_bytes = _ask(manager, "page_size") or 0, _ask(manager, "block_mem_size") or 0
    total = free = inuse = reserved = physical = None
    if allocator is not None:
        total, free, inuse, reserved = _pages(allocator)
        physical = _ask(allocator, "get_avail_physical_pages")
    if inuse is not None:
        mapped = inuse * page_size * layers * buffers
    else:
        mapped = int(manager.get_mapped_memory_size("bytes")) if allocator is not None else 0
    effective = None if None in (free, reserved, physical) else min(free, physical + reserved)  # type: ignore
    per_block = block_bytes * layers * buffers
    bound = allocator is not None
    # a negative count means nothing to a gauge (the existing kvcached saw one, #436): clamp
    available = max(int(manager.available_size()), 0) if bound else 0
    allocated = max(int(manager._get_num_alloced_blocks()), 0) if bound else 0
    held = len(getattr(manager, "reserved_blocks", None) or [])
    per_layer = (_ask(manager, "mem_size") or 0) * buffers
    return KVCachePoolSnapshot(
        SCHEMA_VERSION, "kv_cache", integration, getattr(manager, "pool_name", None), _ask(manager, "group_id") or 0,
        layers, buffers, page_size, block_bytes, _ask(manager, "num_blocks") or 0, available, allocated, held,
        available * per_block, allocated * per_block, held * per_block,
        getattr(manager, "null_block", None) is not None,
        per_layer, per_layer * layers, mapped, total, free, inuse, reserved, physical, effective,
        bool(getattr(manager, "in_shrink", False)), getattr(manager, "target_num_blocks", None),
        _ask(allocator, "get_resize_target") if bound else None,
        _ask(allocator, "peak_in_use") if bound else None, _ask(allocator, "pages_mapped_total") if bound else None,
        _ask(allocator, "pages_unmapped_total") if bound else None,
    )


def get_registered_kv_cache_pool_snapshots(*, integration: str | None = None) -> list[KVCachePoolSnapshot]:
    """Snapshots of the live registered pools (of one ``integration``), by integration, name and group."""
    out = []
    for manager, tag in get_registered_kv_cache_pools(integration=integration):
        take = getattr(manager, "observability_snapshot", None)  # the pool's own, consistent where it can be
        out.append(take(integration=tag) if take is not None else build_kv_cache_pool_snapshot(manager,
                                                                                               integration=tag))
    return sorted(out, key=lambda s: (s.integration or "", s.pool_name or "", s.group_id))


def get_registered_kv_cache_pool_snapshot_dicts(*, integration: str | None = None) -> list[dict[str, Any]]:
    return [s.to_dict() for s in get_registered_kv_cache_pool_snapshots(integration=integration)]

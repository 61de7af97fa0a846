"""Revisioned limits of single KV pools, and the split of an instance's limit over its pools.

The rules behind :mod:`kvcached.control` (which sets a whole instance's limit) and
``KVCacheManager.set_memory_limit``; the engine's monitor thread (:mod:`kvcached.mem_info`)
applies an instance limit with :func:`apply_instance_limit`. It imports nothing of
kvcached's, so every one of those may import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NO_LIMIT = -1  # a segment's limit when none is set
MAX_LIMIT = (1 << 63) - 1  # a segment holds a limit as a signed 64-bit count of bytes


def check_limit(limit_bytes: int) -> int:
    """``limit_bytes`` if a segment can hold it as a limit (NO_LIMIT lifts it), else ValueError."""
    if not isinstance(limit_bytes, int) or isinstance(limit_bytes, bool) or limit_bytes < NO_LIMIT:
        raise ValueError(f"limit must be an int number of bytes >= 0, got {limit_bytes!r}.")
    if limit_bytes > MAX_LIMIT:
        raise ValueError(f"a limit of {limit_bytes} B is too large: it must be below 2^63 B (8 EiB); to lift the "
                         "limit use 'none' (kvctl) or NO_LIMIT.")
    return limit_bytes



def check_args(limit_bytes: Any, revision: Any) -> tuple[int | None, int]:
    """``(limit_bytes, revision)`` checked: an int of bytes >= 0 (or None), an int revision >= 0."""
    if limit_bytes is not None:
        if not isinstance(limit_bytes, int) or isinstance(limit_bytes, bool) or limit_bytes < 0:
            raise ValueError(f"limit_bytes must be an int number of bytes >= 0, or None to lift the limit; "
                             f"got {limit_bytes!r}.")
        check_limit(limit_bytes)
    if not isinstance(revision, int) or isinstance(revision, bool) or not 0 <= revision < MAX_LIMIT:
        raise ValueError(f"revision must be an int in [0, 2^63 - 1), got {revision!r}; each new decision takes a "
                         "higher one.")
    return limit_bytes, revision


# When pools disagree, the report names the most telling status.
_PRECEDENCE = ("conflict", "stale", "pending", "deferred", "applied")
REASONS = {
    "deferred": "inuse_capacity_above_limit",
    "conflict": "revision_reused_with_different_limit",
    "stale": "revision_older_than_current",
    "pending": "not_applied_by_the_engine_yet",
    "unavailable": "no_registered_kv_cache_pool",
}


@dataclass
class PoolLimit:
    """The revisioned limit a pool holds (``KVCacheManager._memory_limit``)."""

    limit_bytes: int | None = None  # as asked for; None: no limit
    effective_bytes: int | None = None  # whole page groups, at most the pool's capacity
    revision: int = -1  # -1: none set yet


def pool_capacity(pool: Any) -> int:
    """Bytes of every page group a pool can address (all layers, K and V)."""
    return max(0, int(pool.mem_size) * int(pool.num_layers) * int(pool.num_kv_buffers))


def split_limit(limit: int | None, pools: list[Any]) -> list[tuple[Any, int | None]]:
    """``limit`` shared by capacity (clamped to their sum; the last pool takes the rounding), pools in
    (name, group) order so that every caller splits alike."""
    ordered = sorted(pools, key=lambda p: (str(getattr(p, "pool_name", "") or ""), int(getattr(p, "group_id", 0))))
    if limit is None:
        return [(p, None) for p in ordered]
    caps = [pool_capacity(p) for p in ordered]
    total = sum(caps)
    if total <= 0:
        raise ValueError("the registered KV pools have no capacity to split a limit over.")
    left = whole = min(limit, total)
    shares = []
    for i, (pool, cap) in enumerate(zip(ordered, caps, strict=True)):
        share = left if i == len(ordered) - 1 else min(left, whole * cap // total)
        shares.append((pool, share))
        left -= share
    return shares


# -- one pool (a KVCacheManager; called under its control lock) ----------------------
def pool_state(manager: Any, status: str | None = None) -> dict[str, Any]:
    """What ``KVCacheManager.memory_limit_state`` returns (bytes: all layers, K and V)."""
    held: PoolLimit = manager._memory_limit
    bundle = manager.page_group_bytes
    alloc = manager._allocator
    in_use = int(alloc.num_in_use) if alloc is not None else 0
    mapped = int(alloc.mapped_bytes) if alloc is not None else 0
    cap_pages = min(int(alloc.limit_pages), manager.num_pages) if alloc is not None else 0
    eff = held.effective_bytes
    if status is None:
        # met once the mapped memory fits: a page freed inside a run of pages mapped together stays
        # mapped (reserved) until its whole run is free, so in-use pages alone can look done too early
        status = "deferred" if eff is not None and max(mapped, in_use * bundle) > eff else "applied"
    return {
        "status": status,
        "reason": REASONS.get(status, ""),
        "pool_name": str(manager.pool_name or ""),
        "group_id": manager.group_id,
        "limit_bytes": held.limit_bytes,
        "effective_limit_bytes": eff,
        "current_capacity_bytes": cap_pages * bundle,
        "revision": held.revision,
        "mapped_bytes": mapped,
        "remaining_bytes": None if eff is None else max(0, eff - mapped),
        "overage_bytes": 0 if eff is None else max(0, mapped - eff),
    }


def _apply(manager: Any, limit: int | None, revision: int) -> None:
    pages = None if limit is None else min(limit // manager.page_group_bytes, manager.num_pages)
    # the allocator unmaps its reserve above the cap at once, and in-use pages as they are freed
    manager._set_limit("ipc", pages)
    manager._memory_limit = PoolLimit(limit, None if pages is None else pages * manager.page_group_bytes, revision)


def set_pool_limit(manager: Any, limit: int | None, revision: int) -> dict[str, Any]:
    """The revision rules of one pool: older is stale, the same with another limit a conflict."""
    held: PoolLimit = manager._memory_limit
    if revision < held.revision:
        return pool_state(manager, "stale")
    if revision == held.revision:
        return pool_state(manager, None if limit == held.limit_bytes else "conflict")
    _apply(manager, limit, revision)
    return pool_state(manager)


def apply_pool_limit(manager: Any, limit: int | None, revision: int) -> None:
    """The engine's own (re)split of its instance limit: any share, never an older revision than the pool's."""
    if revision >= manager._memory_limit.revision:
        _apply(manager, limit, revision)


def apply_instance_limit(managers: list[Any], limit: int | None, revision: int) -> None:
    """Split and apply without the revision checks (the segment's writer made them)."""
    for manager, share in split_limit(limit, managers) if managers else []:
        with manager._control_lock:
            apply_pool_limit(manager, share, revision)



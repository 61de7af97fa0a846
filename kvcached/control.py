"""Revisioned memory limits for live KV pools, for an external controller.

``set_instance_memory_limit(limit_bytes, revision=r)`` splits one limit for the whole
engine instance over its live pools (in proportion to their capacity, clamped to the sum)
and reports, per pool and in all, whether it is ``applied`` (the pool already fits),
``deferred`` (more is in use: nothing is taken from a request; the pool maps no new
page and shrinks as blocks are freed), ``stale`` (an older revision than the one held:
nothing changed) or ``conflict`` (the held revision with another limit: nothing changed).
Revisions never go backwards, so a controller that lost a race cannot undo a newer
decision. ``limit_bytes=None`` lifts the limit.

In the engine's process the pools are those of :mod:`kvcached.pool_registry`. From any
other process, ``name=`` (a segment as ``kvctl list`` shows it) sets the limit through the
engine's ``/dev/shm`` segment, under the same revision rules, and waits (``timeout``) for
the engine to apply it (``pending`` when it did not). ``kvctl limit`` is a revision too:
it takes the next one, so a controller acting on an older view is then ``stale``.
Per pool: ``KVCacheManager.set_memory_limit`` / ``memory_limit_state``.
"""

from __future__ import annotations

import time
from typing import Any

from kvcached import mem_info
from kvcached.limits import _PRECEDENCE, REASONS, check_args, split_limit
from kvcached.pool_registry import get_registered_kv_cache_pools


# -- the whole instance ----------------------------------------------------------------
def _summary(status: str, limit: int | None, revision: int, pools: list[dict[str, Any]]) -> dict[str, Any]:
    mapped = sum(int(p.get("mapped_bytes") or 0) for p in pools)
    effective = None if limit is None else sum(int(p.get("effective_limit_bytes") or 0) for p in pools)
    return {
        "status": status,
        "reason": REASONS.get(status, ""),
        "limit_bytes": limit,
        "effective_limit_bytes": effective,
        "revision": revision,
        "mapped_bytes": mapped,
        "remaining_bytes": None if effective is None else max(0, effective - mapped),
        "overage_bytes": 0 if effective is None else max(0, mapped - effective),
        "pools": pools,
    }


def _worst(states: list[dict[str, Any]]) -> str:
    found = {str(s.get("status")) for s in states}
    return next((s for s in _PRECEDENCE if s in found), "applied")


def set_instance_memory_limit(limit_bytes: int | None, *, revision: int, name: str | None = None,
                              timeout: float = 2.0) -> dict[str, Any]:
    """Set this engine instance's KV memory limit (all pools) as revision ``revision``; see the module doc."""
    limit, revision = check_args(limit_bytes, revision)
    if name is not None:
        return _set_in_segment(name, limit, revision, timeout)
    pools = [m for m, _ in get_registered_kv_cache_pools()]
    if not pools:
        return {**_summary("unavailable", limit, revision, []), "effective_limit_bytes": 0}

    def apply() -> list[dict[str, Any]]:
        return [pool.set_memory_limit(share, revision=revision) for pool, share in split_limit(limit, pools)]

    pub = mem_info.publisher()
    if pub is None:  # no segment (no pool bound yet): the pools' own revisions decide
        states = apply()
        return _summary(_worst(states), limit, revision, states)
    outcome, states = pub.apply_revisioned_limit(limit, revision, apply)
    if states is None:  # refused by the segment's revision: report what the pools hold
        states = [pool.memory_limit_state() for pool in pools]
        return {**_summary(outcome, limit, revision, states), "revision": pub.limit_revision()}
    return _summary(_worst(states), limit, revision, states)


def _set_in_segment(name: str, limit: int | None, revision: int, timeout: float) -> dict[str, Any]:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout < float("inf"):
        raise ValueError(f"timeout must be a number of seconds >= 0, got {timeout!r}.")
    outcome, info = mem_info.write_limit_revision(name, mem_info.NO_LIMIT if limit is None else limit, revision)
    if outcome in ("stale", "conflict"):
        return {**_summary(outcome, limit, revision, info.pools), "revision": info.limit_revision, "name": name}
    deadline = time.monotonic() + timeout
    while info.applied_revision < revision and time.monotonic() < deadline:
        time.sleep(mem_info.PERIOD / 4)
        info = mem_info.read_segment(name)
    if info.limit_revision > revision:  # a newer decision arrived meanwhile
        return {**_summary("stale", limit, revision, info.pools), "revision": info.limit_revision, "name": name}
    status = _worst(info.pools) if info.applied_revision >= revision else "pending"
    return {**_summary(status, limit, revision, info.pools), "name": name}


def instance_memory_limit_state(name: str | None = None) -> dict[str, Any]:
    """The limit this instance holds now (``name``: another process's segment), as the setter reports it."""
    if name is not None:
        info = mem_info.read_segment(name)
        limit = None if info.limit < 0 else info.limit
        status = _worst(info.pools) if info.applied_revision >= info.limit_revision else "pending"
        return {**_summary(status, limit, info.limit_revision, info.pools), "name": name}
    pools = [m for m, _ in get_registered_kv_cache_pools()]
    if not pools:
        return {**_summary("unavailable", None, -1, []), "effective_limit_bytes": 0}
    states = [pool.memory_limit_state() for pool in pools]
    limits = [s.get("limit_bytes") for s in states]
    total = None if any(v is None for v in limits) else sum(limits)
    return _summary(_worst(states), total, max(int(s.get("revision", -1)) for s in states), states)

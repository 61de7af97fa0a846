"""The live KV pools of this process, for :mod:`kvcached.control` and :mod:`kvcached.observability`.

Every ``KVCacheManager`` registers itself when made and leaves at ``close``; the engine
integrations register theirs again with their name (``"vllm"``, ``"sglang"``), which
tags them. The registry holds weak references only: it never keeps a pool alive. Any
object with a KV manager's attributes may be registered (a controller's test double).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

_lock = threading.Lock()
_pools: dict[int, tuple[weakref.ref, str | None]] = {}


def check_integration(integration: str | None) -> str | None:
    if integration is not None and (not isinstance(integration, str) or not integration):
        raise ValueError(f"integration must be a non-empty name such as 'vllm' or None, got {integration!r}.")
    return integration


def register_kv_cache_pool(manager: Any, *, integration: str | None = None) -> None:
    """Add ``manager`` (again: the latest ``integration`` tag wins); it leaves when collected."""
    check_integration(integration)
    key = id(manager)

    def gone(ref: weakref.ref) -> None:
        with _lock:
            if key in _pools and _pools[key][0] is ref:
                del _pools[key]

    ref = weakref.ref(manager, gone)
    with _lock:
        _pools[key] = (ref, integration)


def unregister_kv_cache_pool(manager: Any) -> None:
    """Remove ``manager`` (closed); nothing happens if it is not registered."""
    with _lock:
        entry = _pools.get(id(manager))
        if entry is not None and entry[0]() is manager:
            del _pools[id(manager)]


def clear_registered_kv_cache_pools(*, integration: str | None = None) -> None:
    """Forget every pool, or those of one ``integration`` (its shutdown)."""
    check_integration(integration)
    with _lock:
        for key in [k for k, (_, tag) in _pools.items() if integration is None or tag == integration]:
            del _pools[key]


def get_registered_kv_cache_pools(*, integration: str | None = None) -> list[tuple[Any, str | None]]:
    """``(manager, integration)`` of every live registered pool, in registration order."""
    check_integration(integration)
    with _lock:
        entries = list(_pools.values())
    out = []
    for ref, tag in entries:
        manager = ref()
        if manager is not None and (integration is None or tag == integration):
            out.append((manager, tag))
    return out

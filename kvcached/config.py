"""Every ``KVCACHED_*`` environment variable, parsed and validated in one place.

Values are read when asked for (not frozen at import) so that a process, or a
test, can change them before ``init_kvcached``. A bad value raises
:class:`KVCachedConfigError` naming the variable, the value and what is accepted.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvcached.errors import KVCachedConfigError

MiB = 1 << 20
BASE_PAGE = 2 * MiB  # every backend's mapping granularity divides this
# Upper bounds that keep byte counts far inside the native core's 64-bit sizes.
MAX_PAGE_SIZE_MB = 1024
MAX_HOST_MEM_LIMIT_MB = 1 << 26  # 64 TiB
MAX_RESERVED_PAGES = 1 << 20

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _raw(name: str) -> str | None:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    return value.strip()


def env_bool(name: str, default: bool | None) -> bool | None:
    value = _raw(name)
    if value is None:
        return default
    low = value.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise KVCachedConfigError(
        f"{name}={value!r} is not a boolean; use one of true/false, 1/0, yes/no, on/off."
    )


def env_int(name: str, default: int, *, minimum: int | None = None, maximum: int | None = None) -> int:
    value = _raw(name)
    if value is None:
        return default
    try:
        parsed = int(value)
    except ValueError:
        raise KVCachedConfigError(f"{name}={value!r} is not an integer.") from None
    if minimum is not None and parsed < minimum:
        raise KVCachedConfigError(f"{name}={parsed} must be at least {minimum}.")
    if maximum is not None and parsed > maximum:
        raise KVCachedConfigError(f"{name}={parsed} must be at most {maximum}.")
    return parsed


def env_float(name: str, default: float, *, low: float, high: float) -> float:
    value = _raw(name)
    if value is None:
        return default
    try:
        parsed = float(value)
    except ValueError:
        raise KVCachedConfigError(f"{name}={value!r} is not a number.") from None
    if not (low <= parsed <= high):
        raise KVCachedConfigError(f"{name}={parsed} must lie in [{low}, {high}].")
    return parsed


def page_size() -> int:
    """Bytes of one page of one layer's K (or V): ``KVCACHED_PAGE_SIZE_MB``, default 2."""
    mb = env_int("KVCACHED_PAGE_SIZE_MB", 2, minimum=1, maximum=MAX_PAGE_SIZE_MB)
    if (mb * MiB) % BASE_PAGE:
        raise KVCachedConfigError(
            f"KVCACHED_PAGE_SIZE_MB={mb} must be a multiple of 2 (MiB): GPU drivers map "
            "memory in 2 MiB granules."
        )
    return mb * MiB


def page_size_chosen() -> bool:
    """True when ``KVCACHED_PAGE_SIZE_MB`` is set (the page size is then the user's, never fitted)."""
    return _raw("KVCACHED_PAGE_SIZE_MB") is not None


def backend_override() -> str | None:
    """``KVCACHED_BACKEND``: force ``cuda``, ``hip`` or ``host``; unset = from the device."""
    value = _raw("KVCACHED_BACKEND")
    if value is None:
        return None
    low = value.lower()
    if low not in ("cuda", "hip", "host"):
        raise KVCachedConfigError(
            f"KVCACHED_BACKEND={value!r} is not one of cuda, hip, host (or unset it)."
        )
    return low


def contiguous_layout_override() -> bool | None:
    """``KVCACHED_CONTIGUOUS_LAYOUT``: True/False when set, None for the backend default."""
    return env_bool("KVCACHED_CONTIGUOUS_LAYOUT", None)


@dataclass(frozen=True)
class ReserveConfig:
    min_reserved_pages: int
    max_reserved_pages: int
    prealloc: bool


def reserve_config() -> ReserveConfig:
    lo = env_int("KVCACHED_MIN_RESERVED_PAGES", 5, minimum=0, maximum=MAX_RESERVED_PAGES)
    hi = env_int("KVCACHED_MAX_RESERVED_PAGES", 10, minimum=0, maximum=MAX_RESERVED_PAGES)
    if lo > hi:
        raise KVCachedConfigError(
            f"KVCACHED_MIN_RESERVED_PAGES={lo} exceeds KVCACHED_MAX_RESERVED_PAGES={hi}; "
            "the minimum must not be larger than the maximum."
        )
    prealloc = env_bool("KVCACHED_PAGE_PREALLOC_ENABLED", True)
    return ReserveConfig(lo, hi, bool(prealloc))


def host_memory_limit() -> int:
    """Physical budget of the host backend, ``KVCACHED_HOST_MEM_LIMIT_MB`` (default 4096)."""
    return env_int("KVCACHED_HOST_MEM_LIMIT_MB", 4096, minimum=1, maximum=MAX_HOST_MEM_LIMIT_MB) * MiB


def host_shm_name() -> str | None:
    """``KVCACHED_HOST_SHM_NAME``: the /dev/shm segment whose budget host-backend processes share.

    Processes naming the same segment share one physical budget, as engines on one
    GPU share its memory (the native core reads it; unset = one per user and device).
    """
    return _raw("KVCACHED_HOST_SHM_NAME")


def gpu_utilization() -> float:
    """Largest fraction of device memory the pool may map, ``KVCACHED_GPU_UTILIZATION``."""
    return env_float("KVCACHED_GPU_UTILIZATION", 0.95, low=0.01, high=1.0)


def lazy_reserve_ms() -> int:
    """``KVCACHED_LAZY_RESERVE_MS`` (serving engines; default 2000, 0 turns it off): pages freed past the
    reserve stay mapped while the load reached them within this many milliseconds, the reserve refills in
    whole runs, so a serving step rarely waits on the driver (see ``PageAllocator.set_lazy_reserve_ms``)."""
    return env_int("KVCACHED_LAZY_RESERVE_MS", 2000, minimum=0, maximum=3_600_000)


def max_cached_tokens() -> int:
    """Tokens kept as evictable prefix cache, ``KVCACHED_MAX_CACHED_TOKENS`` (<0: unlimited)."""
    return env_int("KVCACHED_MAX_CACHED_TOKENS", 16000)


def sanity_check() -> bool:
    return bool(env_bool("KVCACHED_SANITY_CHECK", False))


def kernel_checks() -> bool:
    """``KVCACHED_KERNEL_CHECKS``: the kernels check block ids, lengths, offsets, slots and
    fp8 scales on the device before each launch (one host sync per call; a debug mode)."""
    return bool(env_bool("KVCACHED_KERNEL_CHECKS", False))


def log_level() -> str:
    value = (_raw("KVCACHED_LOG_LEVEL") or "INFO").upper()
    if value not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise KVCachedConfigError(
            f"KVCACHED_LOG_LEVEL={value!r} is not one of DEBUG, INFO, WARNING, ERROR, CRITICAL."
        )
    return value


def kvcached_enabled() -> bool:
    """``ENABLE_KVCACHED``: the engines' plugins install kvcached's hooks only when it is true."""
    return bool(env_bool("ENABLE_KVCACHED", False))


MAX_IPC_NAME = 100


def ipc_name_override() -> str | None:
    """``KVCACHED_IPC_NAME``: this engine's /dev/shm segment, used exactly as given (kvctl finds it
    by that name), so a name that would need changing is refused rather than changed."""
    value = _raw("KVCACHED_IPC_NAME")
    if value is None:
        return None
    bad = sorted({ch for ch in value if not (ch.isascii() and (ch.isalnum() or ch in "_-"))})
    if bad or len(value) > MAX_IPC_NAME:
        problem = f"holds {''.join(bad)!r}" if bad else f"has {len(value)} characters"
        raise KVCachedConfigError(
            f"KVCACHED_IPC_NAME={value!r} {problem}; use at most {MAX_IPC_NAME} of A-Z, a-z, 0-9, '_' and '-', "
            "e.g. kvcached_engine_a (kvctl finds a segment by exactly this name)."
        )
    return value


def nixl_any_transport() -> bool:
    """``KVCACHED_NIXL_ANY_TRANSPORT``: let vLLM's NixlConnector register kvcached's KV memory whatever
    transport NIXL uses. Off by default: a transport that resolves physical pages when the memory is
    registered (RDMA, CUDA IPC) never sees the pages kvcached maps later (docs/pd_disaggregation.md)."""
    return bool(env_bool("KVCACHED_NIXL_ANY_TRANSPORT", False))

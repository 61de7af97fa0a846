"""Which vLLM versions kvcached's hooks are written for.

The hooks reach into vLLM V1 internals (block pool, KV allocation, worker memory
probe) that change between minor releases, so any version outside the range is
refused with an error rather than run without kvcached.
"""

from __future__ import annotations

from kvcached.integration.common import check_range, release

__all__ = ["check_vllm_version", "installed_vllm_version", "release"]

# [MIN_VERSION, MAX_VERSION_EXCLUSIVE): the V1 internals ``adapters`` has an adapter for. A newer
# vLLM is refused until it has been run (docs/vllm.md: which versions ran where).
MIN_VERSION = (0, 24, 0)
MAX_VERSION_EXCLUSIVE = (0, 33, 0)
SUPPORTED_RANGE = ">=0.24.0,<0.33.0"


def check_vllm_version(version: str) -> tuple[int, ...]:
    """The release tuple of ``version``; :class:`KVCachedConfigError` unless it is in :data:`SUPPORTED_RANGE`."""
    return check_range("vLLM", "vllm", version, MIN_VERSION, MAX_VERSION_EXCLUSIVE, SUPPORTED_RANGE)


def installed_vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))

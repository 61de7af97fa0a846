"""Which vLLM versions kvcached's hooks are written for.

The hooks reach into vLLM V1 internals (block pool, KV allocation, worker memory
probe) that change between minor releases, so any version outside the range is
refused with an error rather than run without kvcached.
"""

from __future__ import annotations

from kvcached.errors import KVCachedConfigError

# [MIN_VERSION, MAX_VERSION_EXCLUSIVE): the V1 internals ``adapters`` has an adapter for. A newer
# vLLM is refused until it has been run (see README: which versions ran where).
MIN_VERSION = (0, 24, 0)
MAX_VERSION_EXCLUSIVE = (0, 33, 0)
SUPPORTED_RANGE = ">=0.24.0,<0.33.0"


def release(version: str) -> tuple[int, ...]:
    """``0.32.0``, ``0.32.1+cpu``, ``0.32.0rc1.dev5`` -> (0, 32, 0...); ValueError if unreadable."""
    head = version.split("+", 1)[0]
    parts: list[int] = []
    for piece in head.split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) != len(piece):  # "0rc1": a pre-release of that number ends the release part
            break
    if len(parts) < 2:
        raise ValueError(version)
    while len(parts) < 3:
        parts.append(0)
    return tuple(parts[:3])


def check_vllm_version(version: str) -> tuple[int, ...]:
    """The release tuple of ``version``; :class:`KVCachedConfigError` unless it is in :data:`SUPPORTED_RANGE`."""
    try:
        release_ = release(str(version))
    except ValueError:
        raise KVCachedConfigError(
            f"kvcached cannot read the vLLM version {version!r}; it supports vLLM {SUPPORTED_RANGE}. "
            "Install a supported vLLM or unset ENABLE_KVCACHED."
        ) from None
    if not (MIN_VERSION <= release_ < MAX_VERSION_EXCLUSIVE):
        raise KVCachedConfigError(
            f"kvcached does not support vLLM {version}: its hooks are written for vLLM {SUPPORTED_RANGE}. "
            f"Install a supported vLLM (pip install 'vllm{SUPPORTED_RANGE}'), or unset ENABLE_KVCACHED to run "
            "vLLM without kvcached."
        )
    return release_


def installed_vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))

"""What kvcached chooses under vLLM: layout, attention backend, and this engine's memory cap.

Pure decisions from environment variables, the platform and vLLM's cache config;
no hooks here, so every other module of the integration may import it.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from kvcached import config
from kvcached import utils as kv_utils
from kvcached.errors import KVCachedConfigError
from kvcached.log import get_kvcached_logger

logger = get_kvcached_logger()

BACKEND_NAME = "KVCACHED"
BACKEND_PATH = "kvcached.integration.vllm.backend.KVCachedAttentionBackend"
# names under which vLLM may hand our backend back (vLLM < 0.32 registers it as CUSTOM)
BACKEND_ALIASES = {BACKEND_NAME}


def attention_backend_choice() -> str:
    """``KVCACHED_ATTENTION_BACKEND``: ``auto`` (default), ``kvcached`` (force ours) or ``vllm`` (never ours)."""
    value = (os.environ.get("KVCACHED_ATTENTION_BACKEND") or "auto").strip().lower()
    aliases = {"auto": "auto", "kvcached": "kvcached", "triton": "kvcached", "vllm": "vllm", "off": "vllm"}
    if value not in aliases:
        raise KVCachedConfigError(
            f"KVCACHED_ATTENTION_BACKEND={value!r} is not one of auto, kvcached, vllm."
        )
    return aliases[value]


def max_cached_blocks(block_size: int) -> int:
    """Blocks of evictable prefix cache ``KVCACHED_MAX_CACHED_TOKENS`` allows: -1 unlimited, 0 none.

    A positive bound below one block keeps one block: 0 would turn the prefix cache off,
    which only ``0`` asks for. Read through ``kvcached.utils`` (the name users patch).
    """
    tokens = int(kv_utils.MAX_CACHED_TOKENS)
    if tokens < 0:
        return -1
    blocks = tokens // block_size
    if tokens and not blocks:
        logger.warning("KVCACHED_MAX_CACHED_TOKENS=%d is below one block of %d tokens; flooring max cached blocks "
                       "to 1 so that the prefix cache stays on (0 turns it off)", tokens, block_size)
        return 1
    return blocks


def is_rocm() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_rocm())


def contiguous_layout() -> bool:
    """The layout kvcached uses under vLLM: ``KVCACHED_CONTIGUOUS_LAYOUT`` when set; else contiguous.

    On ROCm the default is contiguous only because our stride-aware backend is then
    chosen automatically; with ``KVCACHED_ATTENTION_BACKEND=vllm`` it stays per-layer.
    """
    explicit = config.contiguous_layout_override()
    if explicit is not None:
        return explicit
    if is_rocm():
        return attention_backend_choice() != "vllm"
    return True


def wants_kvcached_backend(selected: Any, selector: Any) -> bool:
    if getattr(selector, "use_mla", False) or getattr(selector, "use_sparse", False):
        return False
    choice = attention_backend_choice()
    if selected is not None and getattr(selected, "name", None) in BACKEND_ALIASES:
        return True
    if choice == "kvcached":
        return True
    return choice == "auto" and is_rocm() and contiguous_layout()


def _default_utilization(cache_config: Any) -> float | None:
    for f in dataclasses.fields(type(cache_config)) if dataclasses.is_dataclass(cache_config) else ():
        if f.name == "gpu_memory_utilization" and f.default is not dataclasses.MISSING:
            default = getattr(f.default, "default", f.default)  # pydantic dataclasses wrap it in a FieldInfo
            return float(default) if isinstance(default, (int, float)) else None
    return None


def memory_flag(cache_config: Any) -> str | None:
    """Which of vLLM's memory flags the user set: ``kv_cache_memory_bytes``, ``gpu_memory_utilization`` or None.

    vLLM keeps no record of whether ``--gpu-memory-utilization`` was given, so a value
    equal to vLLM's default counts as not given (documented in README, "Use with vLLM").
    """
    if getattr(cache_config, "kv_cache_memory_bytes", None):
        return "kv_cache_memory_bytes"
    util = getattr(cache_config, "gpu_memory_utilization", None)
    default = _default_utilization(cache_config)
    if util is not None and default is not None and abs(float(util) - default) > 1e-9:
        return "gpu_memory_utilization"
    return None

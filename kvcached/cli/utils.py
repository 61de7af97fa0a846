"""Shared-memory helpers of the kvcached CLI (``kvctl``, ``kvtop``), on kvcached's module path."""

from __future__ import annotations

import os

from kvcached import mem_info
from kvcached.mem_info import MemInfo
from kvcached.utils import SHM_DIR, format_size, parse_size

MemInfoStruct = MemInfo  # kvcached's name: .total_size (the limit), .used_size, .prealloc_size


def get_ipc_path(ipc_name: str) -> str:
    return mem_info.segment_path(ipc_name)


def get_ipc_name(ipc_path: str) -> str:
    return os.path.basename(ipc_path)


# These take the segment's name as kvctl shows it; a path raises ValueError instead of being
# cut to its base name, which would act on a file the caller did not name.
def get_kv_cache_limit(ipc_name: str) -> MemInfo | None:
    """The segment of ``ipc_name`` (limit, used, prealloc...), or None if there is none."""
    try:
        return mem_info.read_segment(ipc_name)
    except FileNotFoundError:
        return None


def update_kv_cache_limit(ipc_name: str, kv_cache_limit: int) -> MemInfo | None:
    """Set the KV memory limit (bytes, all layers, K and V) of a running instance.

    The engine applies it within a second. A limit below what is in use is kept:
    the pool shrinks to it as blocks are freed. Returns None if there is no such segment.
    """
    try:
        return mem_info.write_limit(ipc_name, int(kv_cache_limit))
    except FileNotFoundError:
        return None


def refresh_seconds(value: float | str) -> float:
    """A refresh interval in seconds: a finite number > 0, else ValueError saying so."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise ValueError(f"refresh interval must be a positive number of seconds, e.g. 0.5 or 2; got {value!r}.")
    return seconds


def refresh_arg(text: str) -> float:
    """``refresh_seconds`` for argparse: a bad value is a usage error (exit 2), not a traceback."""
    import argparse

    try:
        return refresh_seconds(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def delete_kv_cache_segment(ipc_name: str) -> bool:
    return mem_info.delete_segment(ipc_name)


def list_kv_cache_segments() -> list[str]:
    return mem_info.list_segments()


_format_size = format_size

__all__ = [
    "SHM_DIR", "MemInfoStruct", "get_ipc_path", "get_ipc_name", "get_kv_cache_limit", "update_kv_cache_limit",
    "delete_kv_cache_segment", "list_kv_cache_segments", "format_size", "parse_size",
]

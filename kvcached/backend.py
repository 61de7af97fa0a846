"""Which native backend a device string means: ``cuda``, ``hip`` or ``host`` (and ``null``, internal)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvcached import config
from kvcached.errors import KVCachedConfigError


@dataclass(frozen=True)
class BackendChoice:
    kind: str  # cuda | hip | host | null (address space only: a TP scheduler's bookkeeping)
    index: int  # device ordinal (0 for host and null)

    @property
    def torch_device(self) -> str:
        """The device string torch uses for tensors of this backend."""
        return "cpu" if self.kind in ("host", "null") else f"cuda:{self.index}"


def _torch_is_hip() -> bool:
    import torch

    return bool(getattr(torch.version, "hip", None))


def parse_device(device: Any) -> tuple[str, int]:
    """``'cuda'``, ``'cuda:1'``, ``'hip:0'``, ``'cpu'`` or a ``torch.device`` -> (type, index)."""
    text = str(device).strip().lower()
    if text == "null":  # the scheduler side of a tensor-parallel engine (integration/vllm/tp.py)
        return "null", 0
    kind, _, idx = text.partition(":")
    if kind not in ("cuda", "hip", "cpu"):
        raise KVCachedConfigError(
            f"device {device!r} is not understood; use 'cuda', 'cuda:N', 'hip:N' or 'cpu'."
        )
    if not idx:
        return kind, 0
    if not idx.isdigit():
        raise KVCachedConfigError(f"device {device!r} has a bad index {idx!r}; use e.g. 'cuda:0'.")
    if kind == "cpu" and int(idx) != 0:
        raise KVCachedConfigError(f"device {device!r}: the host backend has only 'cpu' (index 0).")
    return kind, int(idx)


def choose_backend(device: Any) -> BackendChoice:
    """Backend for ``device``: ``cpu`` -> host; a GPU -> cuda, or hip on a ROCm build of torch.

    ``KVCACHED_BACKEND=cuda|hip|host`` overrides the choice.
    """
    kind, index = parse_device(device)
    if kind == "null":
        return BackendChoice("null", 0)
    override = config.backend_override()
    if override is not None:
        return BackendChoice(override, 0 if override == "host" else index)
    if kind == "cpu":
        return BackendChoice("host", 0)
    if kind == "hip" or _torch_is_hip():
        return BackendChoice("hip", index)
    return BackendChoice("cuda", index)

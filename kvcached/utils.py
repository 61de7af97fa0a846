"""Process-wide constants and helpers on the kvcached module path its users know.

``PAGE_SIZE``, ``CONTIGUOUS_LAYOUT`` and ``DEFAULT_IPC_NAME`` are computed when
first read (module ``__getattr__``), not at import: a bad ``KVCACHED_*`` value
then raises :class:`KVCachedConfigError` where it is used instead of making
``import kvcached.utils`` itself fail. ``from kvcached.utils import PAGE_SIZE``
works as before; it reads the value at that moment.

The /dev/shm names (``SHM_DIR``, ``DEFAULT_IPC_NAME``...) belong to
:mod:`kvcached.mem_info` and the logger to :mod:`kvcached.log`; they are
re-exported here, where kvcached's users import them from.
"""

from __future__ import annotations

from typing import Any

from kvcached import config
from kvcached.log import get_kvcached_logger
from kvcached.mem_info import SHM_DIR, SHM_PREFIX, get_default_ipc_name, sanitize_ipc_name

__all__ = ["SHM_DIR", "SHM_PREFIX", "align_to", "align_up_to_page", "default_contiguous_layout", "format_size",
           "get_default_ipc_name", "get_kvcached_logger", "get_page_size", "is_hip_torch", "normalize_gpu_device",
           "parse_size", "sanitize_ipc_name"]


def get_page_size() -> int:
    """Bytes of one page of one layer's K (or V): ``KVCACHED_PAGE_SIZE_MB`` (default 2 MiB)."""
    return config.page_size()


def is_hip_torch() -> bool:
    import torch

    return bool(getattr(torch.version, "hip", None))


def default_contiguous_layout(backend_kind: str | None = None) -> bool:
    """``KVCACHED_CONTIGUOUS_LAYOUT`` when set; otherwise contiguous except on HIP.

    ``backend_kind`` is the backend in use (``cuda``, ``hip``, ``host``); None
    means "guess from torch" (a ROCm build of torch means HIP).
    """
    explicit = config.contiguous_layout_override()
    if explicit is not None:
        return explicit
    if backend_kind is None:
        backend_kind = "hip" if is_hip_torch() else "cuda"
    # vendor ROCm attention kernels ignore strides, so they misread the strided
    # per-layer views of the contiguous layout (FACTS.md); per-layer is safe there.
    return backend_kind != "hip"


def __getattr__(name: str) -> Any:
    if name == "PAGE_SIZE":
        return get_page_size()
    if name == "CONTIGUOUS_LAYOUT":
        return default_contiguous_layout()
    if name == "DEFAULT_IPC_NAME":
        return get_default_ipc_name()
    if name == "SANITY_CHECK":
        return config.sanity_check()
    if name == "GPU_UTILIZATION":
        return config.gpu_utilization()
    if name == "MAX_CACHED_TOKENS":
        return config.max_cached_tokens()
    raise AttributeError(f"module 'kvcached.utils' has no attribute {name!r}")


def normalize_gpu_device(device: Any) -> str:
    """``hip[:N]`` -> ``cuda[:N]`` (torch addresses AMD GPUs as cuda); anything else as a string."""
    dev = str(device)
    if dev.lower().startswith("hip"):
        return "cuda" + dev[3:]
    return dev


def align_to(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def align_up_to_page(n_cells: int, cell_size: int) -> int:
    """Round ``n_cells`` up to whole pages of ``cell_size``-byte cells."""
    per_page = get_page_size() // cell_size
    return align_to(n_cells, per_page)


def format_size(num_bytes: float) -> str:
    size = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024:
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{size:.2f} TiB"


_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10,
    "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
    "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
    "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40,
}


def parse_size(text: str) -> int:
    """``2G``, ``512M``, ``1.5GiB``, ``1048576`` -> bytes (binary units). ValueError if not a size."""
    s = str(text).strip().lower().replace("_", "").replace(",", "")
    i = len(s)
    while i > 0 and s[i - 1].isalpha():
        i -= 1
    number, unit = s[:i].strip(), s[i:]
    if unit not in _SIZE_UNITS or not number:
        raise ValueError(f"cannot read {text!r} as a size; use e.g. 2G, 512M, 1.5GiB or a byte count.")
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a size; use e.g. 2G, 512M, 1.5GiB or a byte count.") from None
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"size {text!r} must be a finite number >= 0.")
    return int(value * _SIZE_UNITS[unit])

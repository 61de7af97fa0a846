"""Process-wide constants and helpers on the kvcached module path its users know.

``PAGE_SIZE``, ``CONTIGUOUS_LAYOUT`` and ``DEFAULT_IPC_NAME`` are computed when
first read (module ``__getattr__``), not at import: a bad ``KVCACHED_*`` value
then raises :class:`KVCachedConfigError` where it is used instead of making
``import kvcached.utils`` itself fail. ``from kvcached.utils import PAGE_SIZE``
works as before; it reads the value at that moment.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from kvcached import config

SHM_DIR = "/dev/shm"
SHM_PREFIX = "kvcached_"

_ipc_name_cache: str | None = None


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


def sanitize_ipc_name(name: str) -> str:
    """Keep a /dev/shm name to ``[A-Za-z0-9_-]`` and 100 characters."""
    clean = "".join(ch if ch.isalnum() or ch in "_-" else "-" for ch in name)
    return clean[:100]


def _engine_tag() -> str:
    # Only engines actually loaded in this process count: an installed but
    # unused vLLM must not rename the demo's segment.
    if "vllm" in sys.modules:
        return "vLLM"
    if "sglang" in sys.modules:
        return "SGLang"
    return "proc"


def _segment_owned_by_other_live_process(name: str) -> bool:
    from kvcached import mem_info

    try:
        info = mem_info.read_segment(name)
    except FileNotFoundError:
        return False
    except ValueError:  # someone else's file (or another kvcached version's): not ours to take
        return True
    return info.pid != os.getpid() and mem_info.pid_alive(info.pid)


def get_default_ipc_name() -> str:
    """``KVCACHED_IPC_NAME`` when set, else ``kvcached_<engine>_<pgid>`` (suffixed if taken).

    Two engines started from one script share a process group, so a name held
    by another live process gets ``_1``, ``_2``... The choice is made once per
    process so the segment keeps its name for the process's life.
    """
    global _ipc_name_cache
    explicit = config.ipc_name_override()
    if explicit:
        return sanitize_ipc_name(explicit)
    if _ipc_name_cache is not None:
        return _ipc_name_cache
    try:
        group = os.getpgid(0)
    except OSError:
        group = os.getpid()
    base = f"{SHM_PREFIX}{_engine_tag()}_{group}"
    name = base
    for i in range(1, 1000):
        if not _segment_owned_by_other_live_process(name):
            break
        name = f"{base}_{i}"
    _ipc_name_cache = name
    return name


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


class _ColorFormatter(logging.Formatter):
    _COLORS = {logging.DEBUG: "\033[36m", logging.INFO: "\033[32m", logging.WARNING: "\033[33m",
               logging.ERROR: "\033[31m", logging.CRITICAL: "\033[35m"}

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return f"{self._COLORS.get(record.levelno, '')}{text}\033[0m"


def get_kvcached_logger(name: str = "kvcached") -> logging.Logger:
    """A logger with one stderr handler, level from ``KVCACHED_LOG_LEVEL``.

    The first call (at import of the modules that log) raises KVCachedConfigError
    for a bad ``KVCACHED_LOG_LEVEL``, as every other variable does, instead of
    logging at a level the user did not ask for.
    """
    logger = logging.getLogger(name)
    if not logger.handlers:
        level = config.log_level()
        handler = logging.StreamHandler()
        fmt = f"[{name}][%(levelname)s][%(asctime)s][%(filename)s:%(lineno)d] %(message)s"
        use_color = handler.stream.isatty() and os.environ.get("NO_COLOR") is None
        cls = _ColorFormatter if use_color else logging.Formatter
        handler.setFormatter(cls(fmt, datefmt="%Y-%m-%d %H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False
    return logger

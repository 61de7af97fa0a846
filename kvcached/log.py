"""kvcached's logger (``kvcached.utils.get_kvcached_logger`` re-exports it).

A leaf module (it imports only :mod:`kvcached.config`), so that any module can log
without importing :mod:`kvcached.utils` and its helpers.
"""

from __future__ import annotations

import logging
import os

from kvcached import config


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

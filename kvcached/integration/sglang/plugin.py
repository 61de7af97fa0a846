"""The ``sglang.srt.plugins`` entry point: ``ENABLE_KVCACHED=true`` is all a user sets.

SGLang (>= 0.5.12) calls every general plugin early in each of its processes (the
engine or server, then each scheduler process before it builds its pools). With
kvcached enabled, :func:`register` checks the SGLang version and installs the hooks.

SGLang logs an exception raised by a plugin and goes on without it, which would be a
silent run without kvcached; so a refusal (unsupported version, bad setting) leaves
the process with ``SystemExit`` and the reason instead.
"""

from __future__ import annotations

from kvcached import config
from kvcached.errors import KVCachedConfigError


def register() -> None:
    if not config.kvcached_enabled():
        return
    from kvcached.integration.sglang import patches

    try:
        patches.apply()
    except KVCachedConfigError as exc:
        raise SystemExit(f"kvcached: {exc}") from exc

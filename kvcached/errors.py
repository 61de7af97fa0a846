"""Exceptions raised by kvcached. Every one says what was wrong and what to do."""

from __future__ import annotations


class KVCachedError(RuntimeError):
    """Base class of every kvcached error."""


class KVCachedConfigError(KVCachedError, ValueError):
    """Misconfiguration the user must fix (bad env value, page/block mismatch...)."""


class KVCachePoolExhausted(KVCachedError):
    """The pool cannot hand out the requested blocks (limit or physical memory)."""


class KVCachedStateError(KVCachedError):
    """A call made in the wrong state: before init, after shutdown, twice..."""

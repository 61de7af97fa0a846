"""What every engine integration shares: reading an engine's version, refusing one outside
the range its hooks were written for, and shutting kvcached down at the process's exit."""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable
from typing import Any

from kvcached.errors import KVCachedConfigError
from kvcached.utils import get_kvcached_logger

logger = get_kvcached_logger()


def triton_kernels() -> Any:
    """``kvcached.kernels`` for an engine's attention backend, imported on first use; in Triton's interpreter
    when there is no GPU (an engine's CPU build: slow, but the same code path, which the CPU tests check)."""
    import os

    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import kvcached.kernels as kernels

    return kernels


def fresh_group_id() -> int:
    """The lowest KV group id with no tensors yet: each engine (or pool) in a process gets a group of its own,
    so a second one starts clean."""
    from kvcached import vmm_ops

    group_id = 0
    while vmm_ops.kv_tensors_created(group_id):
        group_id += 1
    return group_id


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


def check_range(engine: str, package: str, version: str, low: tuple[int, ...], high: tuple[int, ...],
                spec: str) -> tuple[int, ...]:
    """The release tuple of ``version``; :class:`KVCachedConfigError` unless ``low <= it < high`` (``spec``)."""
    try:
        release_ = release(str(version))
    except ValueError:
        raise KVCachedConfigError(
            f"kvcached cannot read the {engine} version {version!r}; it supports {engine} {spec}. "
            f"Install a supported {engine} or unset ENABLE_KVCACHED."
        ) from None
    if not (low <= release_ < high):
        raise KVCachedConfigError(
            f"kvcached does not support {engine} {version}: its hooks are written for {engine} {spec}. "
            f"Install a supported {engine} (pip install '{package}{spec}'), or unset ENABLE_KVCACHED to run "
            f"{engine} without kvcached."
        )
    return release_


def shutdown_at_exit(shutdown: Callable[[], object]) -> Callable[[], None]:
    """An atexit hook that runs ``shutdown`` and, the process exiting anyway, logs a failure instead of a traceback."""

    def hook() -> None:
        try:
            shutdown()
        except Exception as exc:
            logger.warning("kvcached shutdown at exit failed: %s", exc)

    return hook


def wrap_once(owner: Any, name: str, make: Callable[[Any], Any], marker: str = "_kvcached") -> None:
    """``owner.name = make(original)`` once: the wrapper carries ``marker``, so applying again (a second engine in
    the process, a re-imported plugin) never stacks wrappers."""
    original = getattr(owner, name)
    if getattr(original, marker, False):
        return
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, marker, True)
    setattr(owner, name, wrapper)


def same_signature(original: Callable[..., Any], body: str, names: dict[str, Any]) -> Callable[..., Any]:
    """A wrapper of ``original`` with its exact parameters (and defaults), whose ``body`` calls it as ``CALL``: every
    argument passed on as the original takes it (by position; keyword-only ones by name). Forwarding through
    ``*args, **kwargs`` packs the arguments into a new tuple and dict at every call: ~0.5 us with the eight keyword
    arguments vLLM's scheduler passes, against ~0.04 us here, on hooks called for every request in every step
    (``benchmarks/bench_scheduler.py``). ``body`` may use ``self`` (the first parameter, the instance) and
    ``names``; its own names start with ``_kvc_`` so no parameter of any version shadows them. Versions differ in
    parameters, so the source is made from the installed one's; where there is no signature to read, the wrapper
    forwards ``*args, **kwargs``."""
    if not callable(original):
        raise TypeError(f"same_signature wraps a method, got {original!r}.")
    if "CALL" not in body or not body.strip():
        raise ValueError("same_signature: the body must call the original as CALL (a body that never calls it "
                         "replaces the method: write that as a function of its own).")
    try:
        sig: inspect.Signature | None = inspect.signature(original)
    except (TypeError, ValueError):  # nothing to mirror: the plain forwarding, still correct
        sig = None
    first = next(iter(sig.parameters.values()), None) if sig is not None else None
    if first is None or first.kind not in (first.POSITIONAL_ONLY, first.POSITIONAL_OR_KEYWORD):
        params, args = ["self", "*args", "**kwargs"], ["self", "*args", "**kwargs"]
        sig = None
    else:
        # the first parameter is the instance, passed by position: named self here, whatever its name there
        params, args = ["self"], ["self"]
        star = False
        for p in list(sig.parameters.values())[1:]:
            if p.kind is p.VAR_POSITIONAL:
                params.append(f"*{p.name}")
                args.append(f"*{p.name}")
                star = True
            elif p.kind is p.VAR_KEYWORD:
                params.append(f"**{p.name}")
                args.append(f"**{p.name}")
            elif p.kind is p.KEYWORD_ONLY:
                if not star:
                    params.append("*")
                    star = True
                params.append(p.name)
                args.append(f"{p.name}={p.name}")
            else:
                params.append(p.name)
                args.append(p.name)
        positional_only = [p for p in sig.parameters.values() if p.kind is p.POSITIONAL_ONLY]
        if positional_only:
            params.insert(len(positional_only), "/")
    lines = body.strip("\n").splitlines()
    indent = min(len(ln) - len(ln.lstrip()) for ln in lines if ln.strip())
    call = f"_kvc_original({', '.join(args)})"
    name = getattr(original, "__name__", "wrapper")
    if not name.isidentifier():
        name = "wrapper"
    src = f"def {name}({', '.join(params)}):\n" + "".join(
        f"    {ln[indent:].replace('CALL', call)}\n" for ln in lines)
    scope = {**names, "_kvc_original": original}
    exec(compile(src, f"<kvcached wrapper of {getattr(original, '__qualname__', name)}>", "exec"), scope)  # noqa: S102
    fn = scope[name]
    if sig is not None:  # from the signature read, which a decorator's __wrapped__ may have given
        ps = list(sig.parameters.values())
        fn.__defaults__ = tuple(p.default for p in ps if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                                and p.default is not p.empty) or None
        fn.__kwdefaults__ = {p.name: p.default for p in ps if p.kind is p.KEYWORD_ONLY
                             and p.default is not p.empty} or None
    return functools.update_wrapper(fn, original)


PRESSURE_CHECK_S = 0.1  # how often an engine's cache may read the device's free memory (one driver call)


def device_tight_every(alloc: Any, holder: Any, attr: str, period: float) -> bool:
    """``alloc.device_tight()`` on the device's free memory read again now, at most once every ``period`` seconds
    per ``holder`` (its ``attr`` keeps the time of the last read; False in between): an engine asks on every step
    or idle pass, and other processes change the free memory without telling it. The device's free memory, not
    what the pool could obtain: that counts its own reserve, which an idle engine keeps full, so its cache would
    never yield (seen on the H200: docs/coserving.md)."""
    now = time.monotonic()
    if now - getattr(holder, attr, 0.0) < period:
        return False
    setattr(holder, attr, now)
    alloc.refresh_mem_info()
    return bool(alloc.device_tight())

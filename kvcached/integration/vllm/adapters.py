"""Where vLLM's internals differ between the supported versions: one adapter per hook point, keyed by version.

Supported: vLLM 0.24.0 up to (not including) 0.33.0 (``version.SUPPORTED_RANGE``).

KV allocation (both model runners: the older ``gpu_model_runner.GPUModelRunner``, which the
CPU runner subclasses, and the newer ``vllm/v1/worker/gpu/`` one, the default for dense
models on GPUs):

* 0.24 - 0.28 (``RESHAPE``): vLLM allocates raw buffers, then reshapes them to the backend's
  ``get_kv_cache_shape``. Hooked: ``GPUModelRunner._allocate_kv_cache_tensors`` and
  ``_reshape_kv_cache_tensors``; ``gpu.attn_utils._allocate_kv_cache`` and ``_reshape_kv_cache``.
  Views come from :func:`kv_alloc.build_views`.
* 0.29 - 0.32 (``VIEWS``): one ``allocate_kv_cache`` builds every view. Hooked: that name in
  ``gpu_model_runner`` and ``gpu.attn_utils``; views from :func:`kv_alloc.allocate_kv_cache`.

Attention backend name: 0.32 registers new names (``KVCACHED``); older versions only
override ``CUSTOM``, so there ``KVCACHED`` is registered as ``CUSTOM`` and the name
``KVCACHED`` is resolved to it (:func:`register_attention_backend`).

Block pool: 0.30+ adds ``_reuse_watchers`` and ``KVCacheBlock.pool`` (read with ``getattr``
in ``block_pool``).

Every other hook (worker memory probe, scheduler, attention selection) has the same
shape across the range and lives in :mod:`patches`.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

from kvcached.errors import KVCachedConfigError
from kvcached.integration.vllm import kv_alloc
from kvcached.utils import get_kvcached_logger

logger = get_kvcached_logger()

RESHAPE = "reshape"  # vLLM 0.24 - 0.28
VIEWS = "views"  # vLLM 0.29 - 0.32
_GENERATIONS = (((0, 24, 0), (0, 29, 0), RESHAPE), ((0, 29, 0), (0, 33, 0), VIEWS))


def generation(release: tuple[int, ...]) -> str:
    for low, high, name in _GENERATIONS:
        if low <= release < high:
            return name
    raise KVCachedConfigError(f"no kvcached adapter for vLLM {'.'.join(map(str, release))}.")


def _mark(fn: Any) -> Any:
    fn._kvcached = True
    return fn


def _hooked(fn: Any) -> bool:
    return bool(getattr(fn, "_kvcached", False))


def _require(owner: Any, name: str, version: str) -> Any:
    fn = getattr(owner, name, None)
    if fn is None:
        raise KVCachedConfigError(
            f"vLLM {version} has no {getattr(owner, '__name__', owner)}.{name}, which kvcached's adapter for this "
            "version hooks; please report it, and unset ENABLE_KVCACHED meanwhile."
        )
    return fn


class _Placeholder(dict):
    """Stands in for vLLM's raw KV buffers: kvcached builds the views itself, so nothing is allocated here."""

    def __init__(self, device: Any) -> None:
        super().__init__()
        self.device = device


# -- 0.24 - 0.28 ---------------------------------------------------------------
def _install_reshape_old_runner(gmr: Any, version: str) -> None:
    runner = gmr.GPUModelRunner
    alloc = _require(runner, "_allocate_kv_cache_tensors", version)
    reshape = _require(runner, "_reshape_kv_cache_tensors", version)
    if _hooked(alloc):
        return

    @functools.wraps(alloc)
    def _allocate_kv_cache_tensors(self: Any, kv_cache_config: Any) -> Any:
        if kv_alloc.plain():
            return alloc(self, kv_cache_config)
        return _Placeholder(self.device)

    @functools.wraps(reshape)
    def _reshape_kv_cache_tensors(self: Any, raw: Any, kernel_block_sizes: list[int]) -> Any:
        if not isinstance(raw, _Placeholder):
            return reshape(self, raw, kernel_block_sizes)
        skip = set(getattr(self, "shared_kv_cache_layers", {})) | set(getattr(self, "runner_only_attn_layers", ()))
        return kv_alloc.build_views(itertools.chain.from_iterable(self.attn_groups), kernel_block_sizes,
                                    self.cache_config.cache_dtype, self.kv_cache_config, raw.device, skip)

    runner._allocate_kv_cache_tensors = _mark(_allocate_kv_cache_tensors)
    runner._reshape_kv_cache_tensors = _mark(_reshape_kv_cache_tensors)
    uniform = getattr(runner, "use_uniform_kv_cache", None)
    if uniform is not None:
        # the cross-layer buffer for KV connectors is one dense torch allocation: never with kvcached
        runner.use_uniform_kv_cache = staticmethod(_mark(lambda *a, **k: False))


def _install_reshape_new_runner(attn_utils: Any, version: str) -> None:
    alloc = _require(attn_utils, "_allocate_kv_cache", version)
    reshape = _require(attn_utils, "_reshape_kv_cache", version)
    if _hooked(alloc):
        return

    @functools.wraps(alloc)
    def _allocate_kv_cache(kv_cache_config: Any, shared_layers: Any, device: Any) -> Any:
        if kv_alloc.plain():
            return alloc(kv_cache_config, shared_layers, device)
        return _Placeholder(device)

    @functools.wraps(reshape)
    def _reshape_kv_cache(attn_groups: Any, kv_cache_raw_tensors: Any, cache_dtype: str,
                          kernel_block_sizes: list[int], shared_kv_cache_layers: dict[str, str],
                          kv_cache_config: Any = None) -> Any:
        if not isinstance(kv_cache_raw_tensors, _Placeholder):
            return reshape(attn_groups=attn_groups, kv_cache_raw_tensors=kv_cache_raw_tensors,
                           cache_dtype=cache_dtype, kernel_block_sizes=kernel_block_sizes,
                           shared_kv_cache_layers=shared_kv_cache_layers, kv_cache_config=kv_cache_config)
        views = kv_alloc.build_views(attn_groups, kernel_block_sizes, cache_dtype, kv_cache_config,
                                     kv_cache_raw_tensors.device, shared_kv_cache_layers)
        for layer, target in shared_kv_cache_layers.items():
            views[layer] = views[target]
        return views

    attn_utils._allocate_kv_cache = _mark(_allocate_kv_cache)
    attn_utils._reshape_kv_cache = _mark(_reshape_kv_cache)


# -- 0.29 - 0.32 ---------------------------------------------------------------
def _install_views(module: Any, version: str) -> None:
    original = _require(module, "allocate_kv_cache", version)
    if _hooked(original):
        return
    kv_alloc.vllm_allocate_kv_cache = original

    @functools.wraps(original)
    def allocate_kv_cache(*args: Any, **kwargs: Any) -> Any:
        return kv_alloc.allocate_kv_cache(*args, **kwargs)

    module.allocate_kv_cache = _mark(allocate_kv_cache)


def _new_runner_attn_utils() -> Any:
    try:
        import vllm.v1.worker.gpu.attn_utils as attn_utils
    except ImportError:  # a build without the newer runner (or one that cannot import it here)
        return None
    return attn_utils


def _install_profiling_cache(gmr: Any) -> None:
    """CUDA-graph memory profiling builds a throw-away minimal KV cache: keep vLLM's own for it."""
    runner_cls = gmr.GPUModelRunner
    minimal = getattr(runner_cls, "_init_minimal_kv_cache_for_profiling", None)
    if minimal is None or _hooked(minimal):
        return

    @functools.wraps(minimal)
    def init_minimal_kv_cache_for_profiling(self: Any, *args: Any, **kwargs: Any) -> Any:
        with kv_alloc.plain_allocation():
            return minimal(self, *args, **kwargs)

    runner_cls._init_minimal_kv_cache_for_profiling = _mark(init_minimal_kv_cache_for_profiling)


def register_attention_backend(name: str, path: str) -> None:
    """Make ``attention_backend=name`` select ``path`` on every supported vLLM."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from kvcached.integration.vllm import settings

    if hasattr(AttentionBackendEnum, "register"):  # 0.32: a name of its own
        if name not in AttentionBackendEnum.__members__:
            register_backend(name, path)
        return
    register_backend(AttentionBackendEnum.CUSTOM, path)
    settings.BACKEND_ALIASES.add("CUSTOM")
    meta = type(AttentionBackendEnum)
    getitem = meta.__getitem__
    if _hooked(getitem):
        return

    @functools.wraps(getitem)
    def __getitem__(cls: Any, key: Any) -> Any:
        if cls is AttentionBackendEnum and isinstance(key, str) and key.upper() == name:
            return cls.CUSTOM
        return getitem(cls, key)

    meta.__getitem__ = _mark(__getitem__)


def _install_zeroer(module: Any) -> None:
    """vLLM's block zeroer reads a layer's block stride as its page size (see :mod:`kv_zero`)."""
    if getattr(module, "KVBlockZeroer", None) is not None and not _hooked(module.KVBlockZeroer):
        from kvcached.integration.vllm.kv_zero import SlotZeroer

        module.KVBlockZeroer = _mark(SlotZeroer)


def install_kv_allocation(version: str, release: tuple[int, ...]) -> str:
    """Hook KV allocation in both model runners of this vLLM version; returns the adapter's name."""
    import vllm.v1.worker.gpu_model_runner as gmr

    gen = generation(release)
    attn_utils = _new_runner_attn_utils()
    if gen == RESHAPE:
        _install_reshape_old_runner(gmr, version)
        if attn_utils is not None:
            _install_reshape_new_runner(attn_utils, version)
    else:
        _install_views(gmr, version)
        if attn_utils is not None and hasattr(attn_utils, "allocate_kv_cache"):
            _install_views(attn_utils, version)
    _install_profiling_cache(gmr)
    _install_zeroer(gmr)
    try:
        import vllm.v1.worker.gpu.model_runner as new_runner
    except ImportError:
        new_runner = None
    if new_runner is not None:
        _install_zeroer(new_runner)
    logger.debug("kvcached: vLLM %s KV allocation hooked (%s adapter)", version, gen)
    return gen

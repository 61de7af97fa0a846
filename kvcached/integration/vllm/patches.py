"""The hooks that put kvcached under a vLLM 0.32 V1 engine (applied once per process).

Hook points (all in vLLM's installed source):
- ``vllm/v1/worker/gpu_model_runner.py``: the module's ``allocate_kv_cache`` (called by
  ``GPUModelRunner.initialize_kv_cache_tensors``; ``CPUModelRunner`` inherits it) is
  replaced by :func:`kv_alloc.allocate_kv_cache`;
- ``Worker.determine_available_memory`` (``gpu_worker.py``, ``cpu_worker.py``): reports the
  virtual capacity instead of a profiled free-memory figure, so no
  ``--gpu-memory-utilization`` tuning is needed;
- ``vllm/v1/core/kv_cache_coordinator.py``: its ``BlockPool`` becomes
  :class:`KVCachedBlockPool`; ``KVCacheCoordinator.get_num_blocks_to_allocate`` tells
  the pool what the scheduler is about to check, ``KVCacheManager.allocate_slots``
  gives back what that check reserved but did not use, and
  ``KVCacheManager.new_step_starts`` lets the pool follow a lowered limit;
- the platform's ``get_attn_backend_cls``: picks the kvcached Triton backend when
  asked for by name (``KVCACHED``), forced by ``KVCACHED_ATTENTION_BACKEND=kvcached``,
  or automatically on ROCm with the contiguous layout.
"""

from __future__ import annotations

import atexit
import functools
import os
import threading
from typing import Any

from kvcached import config
from kvcached.errors import KVCachedConfigError
from kvcached.utils import get_kvcached_logger

logger = get_kvcached_logger()

BACKEND_NAME = "KVCACHED"
BACKEND_PATH = "kvcached.integration.vllm.backend.KVCachedAttentionBackend"

_lock = threading.Lock()
_applied = False


def attention_backend_choice() -> str:
    """``KVCACHED_ATTENTION_BACKEND``: ``auto`` (default), ``kvcached`` (force ours) or ``vllm`` (never ours)."""
    value = (os.environ.get("KVCACHED_ATTENTION_BACKEND") or "auto").strip().lower()
    aliases = {"auto": "auto", "kvcached": "kvcached", "triton": "kvcached", "vllm": "vllm", "off": "vllm"}
    if value not in aliases:
        raise KVCachedConfigError(
            f"KVCACHED_ATTENTION_BACKEND={value!r} is not one of auto, kvcached, vllm."
        )
    return aliases[value]


def _is_rocm() -> bool:
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
    if _is_rocm():
        return attention_backend_choice() != "vllm"
    return True


def _wants_kvcached_backend(selected: Any, selector: Any) -> bool:
    if getattr(selector, "use_mla", False) or getattr(selector, "use_sparse", False):
        return False
    choice = attention_backend_choice()
    if selected is not None and getattr(selected, "name", None) == BACKEND_NAME:
        return True
    if choice == "kvcached":
        return True
    return choice == "auto" and _is_rocm() and contiguous_layout()


def _patch_attention_selection() -> None:
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(BACKEND_NAME, BACKEND_PATH)
    cls = type(current_platform)
    original = cls.get_attn_backend_cls
    if getattr(original, "_kvcached", False):
        return

    @functools.wraps(original)
    def get_attn_backend_cls(selected_backend: Any, attn_selector_config: Any, *args: Any, **kwargs: Any) -> str:
        if _wants_kvcached_backend(selected_backend, attn_selector_config):
            logger.info("kvcached: using the kvcached Triton attention backend")
            return BACKEND_PATH
        return original(selected_backend, attn_selector_config, *args, **kwargs)

    get_attn_backend_cls._kvcached = True  # type: ignore[attr-defined]
    cls.get_attn_backend_cls = staticmethod(get_attn_backend_cls)


def _patch_worker_side() -> None:
    import vllm.v1.worker.gpu_model_runner as gmr
    import vllm.v1.worker.gpu_worker as gw

    from kvcached.integration.vllm import kv_alloc

    kv_alloc.vllm_allocate_kv_cache = gmr.allocate_kv_cache
    gmr.allocate_kv_cache = kv_alloc.allocate_kv_cache

    # CUDA-graph memory profiling builds a throw-away minimal KV cache: keep vLLM's own for it.
    runner_cls = gmr.GPUModelRunner
    minimal = getattr(runner_cls, "_init_minimal_kv_cache_for_profiling", None)
    if minimal is not None and not getattr(minimal, "_kvcached", False):
        @functools.wraps(minimal)
        def init_minimal_kv_cache_for_profiling(self: Any, *args: Any, **kwargs: Any) -> Any:
            with kv_alloc.plain_allocation():
                return minimal(self, *args, **kwargs)

        init_minimal_kv_cache_for_profiling._kvcached = True  # type: ignore[attr-defined]
        runner_cls._init_minimal_kv_cache_for_profiling = init_minimal_kv_cache_for_profiling

    # vLLM refuses to start when free device memory is below --gpu-memory-utilization,
    # which is the normal state of a second engine on a shared GPU; KV memory is elastic
    # here, so start with what is free instead.
    request = gw.request_memory
    if not getattr(request, "_kvcached", False):
        @functools.wraps(request)
        def request_memory(init_snapshot: Any, *args: Any, **kwargs: Any) -> int:
            try:
                return request(init_snapshot, *args, **kwargs)
            except ValueError as exc:
                logger.info("kvcached: starting with the %d B free on the device (%s)",
                            int(init_snapshot.free_memory), exc)
                return int(init_snapshot.free_memory)

        request_memory._kvcached = True  # type: ignore[attr-defined]
        gw.request_memory = request_memory

    workers = [gw.Worker]
    try:
        import vllm.v1.worker.cpu_worker as cw

        workers.append(cw.CPUWorker)
    except ImportError:  # a GPU build without the CPU worker
        pass
    for worker_cls in workers:
        original = worker_cls.__dict__.get("determine_available_memory")
        if original is None or getattr(original, "_kvcached", False):
            continue

        def make(orig: Any) -> Any:
            @functools.wraps(orig)
            def determine_available_memory(self: Any) -> int:
                try:
                    orig(self)  # keeps vLLM's warm-up / profiling run; its KV figure is not used
                except ValueError as exc:  # "no memory left for the KV cache": ours is virtual
                    logger.info("kvcached: ignoring vLLM's KV memory estimate (%s)", exc)
                kv_alloc.ensure_initialized(self.device, contiguous_layout())
                num_layers = len(self.model_runner.get_kv_cache_spec())
                return kv_alloc.capacity_bytes(max(1, num_layers))

            determine_available_memory._kvcached = True  # type: ignore[attr-defined]
            return determine_available_memory

        worker_cls.determine_available_memory = make(original)


def _patch_scheduler_side() -> None:
    import vllm.v1.core.kv_cache_coordinator as coord
    import vllm.v1.core.kv_cache_manager as kvm

    from kvcached.integration.vllm.block_pool import KVCachedBlockPool

    coord.BlockPool = KVCachedBlockPool

    base = coord.KVCacheCoordinator
    count = base.get_num_blocks_to_allocate

    @functools.wraps(count)
    def get_num_blocks_to_allocate(self: Any, *args: Any, **kwargs: Any) -> int:
        need = count(self, *args, **kwargs)
        if isinstance(self.block_pool, KVCachedBlockPool):
            self.block_pool.expect(need)
        return need

    base.get_num_blocks_to_allocate = get_num_blocks_to_allocate

    allocate = kvm.KVCacheManager.allocate_slots

    @functools.wraps(allocate)
    def allocate_slots(self: Any, *args: Any, **kwargs: Any) -> Any:
        pool = self.block_pool
        if not isinstance(pool, KVCachedBlockPool):
            return allocate(self, *args, **kwargs)
        pool.begin_allocation()
        try:
            return allocate(self, *args, **kwargs)
        finally:
            pool.end_allocation()

    kvm.KVCacheManager.allocate_slots = allocate_slots

    step = kvm.KVCacheManager.new_step_starts

    @functools.wraps(step)
    def new_step_starts(self: Any) -> None:
        pool = self.block_pool
        if isinstance(pool, KVCachedBlockPool):
            pool.shrink_to_limit()
        step(self)

    kvm.KVCacheManager.new_step_starts = new_step_starts

    import vllm.v1.core.sched.scheduler as sched

    shutdown = sched.Scheduler.shutdown

    @functools.wraps(shutdown)
    def scheduler_shutdown(self: Any) -> None:
        try:
            shutdown(self)
        finally:
            pool = getattr(getattr(self, "kv_cache_manager", None), "block_pool", None)
            if isinstance(pool, KVCachedBlockPool):
                pool.close()  # unmap this engine's KV memory now, not at process exit

    sched.Scheduler.shutdown = scheduler_shutdown


def _patch_cpu_executor() -> None:
    """Keep the worker inside the engine-core process on vLLM's CPU build (TP=1).

    The CPU platform switches a single worker to the multiprocess executor, which
    would put the KV tensors in another process than the scheduler's block pool.
    """
    try:
        from vllm.platforms.cpu import CpuPlatform
    except ImportError:
        return
    original = CpuPlatform.check_and_update_config
    if getattr(original, "_kvcached", False):
        return

    @functools.wraps(original)
    def check_and_update_config(vllm_config: Any) -> None:
        original(vllm_config)
        parallel = vllm_config.parallel_config
        if parallel.world_size == 1 and parallel.distributed_executor_backend == "mp":
            logger.info("kvcached: running the CPU worker in the engine-core process (uniprocess executor)")
            parallel.distributed_executor_backend = "uni"

    check_and_update_config._kvcached = True  # type: ignore[attr-defined]
    CpuPlatform.check_and_update_config = staticmethod(check_and_update_config)


def _shutdown_at_exit() -> None:
    from kvcached.integration.vllm import interfaces

    try:
        interfaces.shutdown_kvcached()
    except Exception as exc:  # exiting anyway: say why instead of a traceback
        logger.warning("kvcached shutdown at exit failed: %s", exc)


def apply() -> None:
    """Install every hook (idempotent)."""
    global _applied
    with _lock:
        if _applied:
            return
        attention_backend_choice()  # a bad value fails now, not deep inside the engine
        _patch_attention_selection()
        _patch_cpu_executor()
        _patch_worker_side()
        _patch_scheduler_side()
        atexit.register(_shutdown_at_exit)
        _applied = True
        logger.info("kvcached: vLLM hooks installed (layout %s)",
                    "contiguous" if contiguous_layout() else "per-layer")

"""The hooks that put kvcached under a vLLM V1 engine (0.24 - 0.32; applied once per process).

Hook points (all in vLLM's installed source):
- KV allocation in both model runners: version-keyed, see :mod:`adapters`;
- ``Worker.determine_available_memory`` (``gpu_worker.py``, ``cpu_worker.py``): reports the
  virtual capacity instead of a profiled free-memory figure; when the user gave
  ``--kv-cache-memory-bytes`` or ``--gpu-memory-utilization``, vLLM's own figure becomes
  this engine's kvcached limit (see :func:`settings.memory_flag`);
- ``vllm/v1/core/kv_cache_coordinator.py``: its ``BlockPool`` becomes
  :class:`KVCachedBlockPool`; ``KVCacheCoordinator.get_num_blocks_to_allocate`` tells
  the pool what the scheduler is about to check, ``KVCacheManager.allocate_slots``
  gives back what that check reserved but did not use, and
  ``KVCacheManager.new_step_starts`` lets the pool follow a lowered limit;
- the platform's ``get_attn_backend_cls``: picks the kvcached Triton backend when
  asked for by name (``KVCACHED``), forced by ``KVCACHED_ATTENTION_BACKEND=kvcached``,
  or automatically on ROCm with the contiguous layout;
- ``KVConnectorFactory.create_connector``: a NIXL connector gets its KV regions cut to
  kvcached's blocks and its transports checked (:mod:`nixl_compat`).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import math
import threading
from typing import Any

from kvcached.integration.common import same_signature, wrap_once
from kvcached.integration.vllm import settings
from kvcached.utils import get_kvcached_logger

logger = get_kvcached_logger()

_get_max_cached_blocks = settings.max_cached_blocks  # the existing kvcached's name and module

_lock = threading.Lock()
_applied = False


def _patch_attention_selection() -> None:
    from vllm.platforms import current_platform

    from kvcached.integration.vllm import adapters

    adapters.register_attention_backend(settings.BACKEND_NAME, settings.BACKEND_PATH)
    cls = type(current_platform)
    original = cls.get_attn_backend_cls
    if getattr(original, "_kvcached", False):
        return

    @functools.wraps(original)
    def get_attn_backend_cls(selected_backend: Any, attn_selector_config: Any, *args: Any, **kwargs: Any) -> str:
        if settings.wants_kvcached_backend(selected_backend, attn_selector_config):
            logger.info("kvcached: using the kvcached Triton attention backend")
            return settings.BACKEND_PATH
        return original(selected_backend, attn_selector_config, *args, **kwargs)

    get_attn_backend_cls._kvcached = True  # type: ignore[attr-defined]
    cls.get_attn_backend_cls = staticmethod(get_attn_backend_cls)


def _patch_worker_side() -> None:
    import vllm.v1.worker.gpu_worker as gw

    from kvcached.integration.vllm import kv_alloc

    # vLLM refuses to start when free device memory is below --gpu-memory-utilization,
    # which is the normal state of a second engine on a shared GPU; KV memory is elastic
    # here, so the engine starts and its share stays what the flag asked for.
    def elastic(request: Any) -> Any:
        def request_memory(init_snapshot: Any, cache_config: Any, *args: Any, **kwargs: Any) -> int:
            try:
                return request(init_snapshot, cache_config, *args, **kwargs)
            except ValueError as exc:
                asked = math.ceil(init_snapshot.total_memory * cache_config.gpu_memory_utilization)
                logger.info("kvcached: starting with %d B free of the %d B asked for; KV memory is elastic (%s)",
                            int(init_snapshot.free_memory), asked, exc)
                return asked

        return request_memory

    wrap_once(gw, "request_memory", elastic)

    from vllm.platforms import current_platform

    workers = [gw.Worker]
    if current_platform.is_cpu():
        # only there: importing vLLM's CPU worker replaces torch.cuda.Event process-wide
        import vllm.v1.worker.cpu_worker as cw

        workers.append(cw.CPUWorker)
    for worker_cls in workers:
        original = worker_cls.__dict__.get("determine_available_memory")
        if original is None or getattr(original, "_kvcached", False):
            continue

        def make(orig: Any) -> Any:
            @functools.wraps(orig)
            def determine_available_memory(self: Any) -> int:
                flag = settings.memory_flag(self.cache_config)
                try:
                    planned = orig(self)  # keeps vLLM's warm-up / profiling run
                except (ValueError, AssertionError) as exc:
                    # "no memory left for the KV cache", or another engine's memory moved during the
                    # profile: ours is virtual, so only a user-given budget makes this fatal
                    if flag is not None:
                        raise
                    logger.info("kvcached: ignoring vLLM's KV memory estimate (%s)", exc)
                    planned = None
                kv_alloc.ensure_initialized(self.device, settings.contiguous_layout())
                num_layers = len(self.model_runner.get_kv_cache_spec())
                capacity = kv_alloc.capacity_bytes(max(1, num_layers))
                if flag is not None and planned is not None:
                    kv_alloc.set_memory_cap(max(0, min(int(planned), capacity)))
                    logger.info("kvcached: --%s gives this engine %d B of KV memory", flag.replace("_", "-"),
                                int(planned))
                return capacity

            determine_available_memory._kvcached = True  # type: ignore[attr-defined]
            return determine_available_memory

        worker_cls.determine_available_memory = make(original)


def _patch_scheduler_side() -> None:
    import vllm.v1.core.kv_cache_coordinator as coord
    import vllm.v1.core.kv_cache_manager as kvm

    from kvcached.integration.vllm.block_pool import KVCachedBlockPool

    coord.BlockPool = KVCachedBlockPool

    # Both run for every request in every step: wrappers with vLLM's own parameters (same_signature), not
    # *args/**kwargs, whose re-packing cost more than the hooks themselves (benchmarks/bench_scheduler.py).
    ours = {"_kvc_pool_type": KVCachedBlockPool}
    base = coord.KVCacheCoordinator
    base.get_num_blocks_to_allocate = same_signature(base.get_num_blocks_to_allocate, """
        _kvc_need = CALL
        if isinstance(self.block_pool, _kvc_pool_type):
            self.block_pool.expect(_kvc_need)
        return _kvc_need
    """, ours)
    kvm.KVCacheManager.allocate_slots = same_signature(kvm.KVCacheManager.allocate_slots, """
        _kvc_pool = self.block_pool
        if not isinstance(_kvc_pool, _kvc_pool_type):
            return CALL
        _kvc_pool.begin_allocation()
        try:
            return CALL
        finally:
            _kvc_pool.end_allocation()
    """, ours)

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

    # The scheduler's calls that read or change cached blocks run under the pool's lock, so the pool's
    # pressure thread (KVCachedBlockPool.relieve_pressure) can give an idle engine's cache back between them.
    # The two that free finished requests bound the cache once, at their end.
    for name in ("schedule", "update_from_output", "finish_requests", "reset_prefix_cache"):
        if hasattr(sched.Scheduler, name):
            _under_pool_lock(sched.Scheduler, name, batch_frees=name in ("update_from_output", "finish_requests"))


def _under_pool_lock(owner: Any, name: str, batch_frees: bool = False) -> None:
    from kvcached.integration.vllm.block_pool import KVCachedBlockPool

    def under_lock(original: Any) -> Any:
        def locked(self: Any, *args: Any, **kwargs: Any) -> Any:
            pool = getattr(getattr(self, "kv_cache_manager", None), "block_pool", None)
            lock = getattr(pool, "lock", None) if isinstance(pool, KVCachedBlockPool) else None
            if lock is None:
                return original(self, *args, **kwargs)
            with lock, (pool.batched_frees() if batch_frees else contextlib.nullcontext()):
                return original(self, *args, **kwargs)

        return locked

    wrap_once(owner, name, under_lock, marker="_kvcached_locked")


def _run_after(owner: Any, name: str, hook: Any) -> None:
    """``owner.name`` then ``hook(self, result)``, once; the original's result is returned unchanged."""
    def then_hook(original: Any) -> Any:
        def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            hook(self, result)
            return result

        return wrapped

    wrap_once(owner, name, then_hook, marker="_kvcached_after")


def _patch_tensor_parallel() -> None:
    """The hooks of :mod:`tp`: pool reports after the KV caches exist, page changes on every step's output,
    applied by each worker before its step, flushed when the engine goes idle. Inert at TP = 1."""
    import vllm.v1.core.sched.scheduler as sched
    import vllm.v1.engine.core as core
    import vllm.v1.worker.gpu_worker as gpu_worker

    from kvcached.integration.vllm import tp

    _run_after(core.EngineCore, "_initialize_kv_caches", lambda engine, _: tp.after_kv_caches(engine))
    _run_after(sched.Scheduler, "schedule", tp.attach_page_changes)
    _run_after(core.EngineCore, "post_step", lambda engine, _: tp.flush_if_idle(engine))

    def pages_first(execute: Any) -> Any:
        def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            tp.on_step(scheduler_output)
            return execute(self, scheduler_output, *args, **kwargs)

        return execute_model

    wrap_once(gpu_worker.Worker, "execute_model", pages_first)
    # by name, as collective_rpc("kvcached_rank_state") reaches them from any client without pickled code
    gpu_worker.Worker.kvcached_report_pool = tp.report_pool
    gpu_worker.Worker.kvcached_apply_pages = tp.apply_pages
    gpu_worker.Worker.kvcached_rank_state = tp.rank_state


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


def apply() -> None:
    """Install every hook (idempotent)."""
    global _applied
    with _lock:
        if _applied:
            return
        settings.attention_backend_choice()  # a bad value fails now, not deep inside the engine
        from kvcached.integration.vllm import adapters
        from kvcached.integration.vllm.version import check_vllm_version, installed_vllm_version

        version = installed_vllm_version()
        adapter = adapters.install_kv_allocation(version, check_vllm_version(version))
        _patch_attention_selection()
        _patch_cpu_executor()
        _patch_worker_side()
        _patch_scheduler_side()
        _patch_tensor_parallel()
        from kvcached.integration.vllm import nixl_compat

        nixl_compat.install()
        from kvcached.integration.common import shutdown_at_exit
        from kvcached.integration.vllm import interfaces

        atexit.register(shutdown_at_exit(interfaces.shutdown_kvcached))
        _applied = True
        logger.info("kvcached: vLLM %s hooks installed (%s adapter, layout %s)", version, adapter,
                    "contiguous" if settings.contiguous_layout() else "per-layer")

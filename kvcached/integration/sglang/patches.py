"""The hooks that put kvcached under an SGLang engine (0.5.17 - 0.5.23; applied once per process).

Hook points (all in SGLang's installed source):
- ``HybridReqToTokenPool.mamba_pool_cls`` and ``_init_mamba_pool``: a hybrid model's Mamba states and their slot
  allocator are kvcached's (:mod:`mamba`); ``Req.init_next_round_input`` in a prefill pass first holds the slots
  the pass will allocate for the request (SGLang asserts on one it cannot get), and a request whose slots cannot
  be had is matched without the copy-on-write of a cached state and not admitted;
- ``sglang/srt/mem_cache/kv_cache_configurator.py`` builds every KV pool and allocator
  from names it imported: ``MHATokenToKVPool`` / ``MLATokenToKVPool`` /
  ``TokenToKVPoolAllocator`` / ``PagedTokenToKVPoolAllocator`` there become kvcached's
  (:mod:`pools`, :mod:`allocator`), which covers plain MHA/GQA and MLA models and the
  full-attention pool of hybrid linear-attention (Mamba/GDN) models with MHA; after
  ``_init_pools`` a pool or allocator that is not kvcached's (SWA, DSA, FP4, NPU,
  hierarchical or unified pools...) is an error, never a run without kvcached, and so,
  before it, is a feature that reads KV rows as dense under the contiguous layout;
- ``KVCacheConfigurator._profile_available_bytes``: on a GPU the KV budget is
  ``--mem-fraction-static`` of the device less what this process holds through torch,
  not the free memory that other engines' KV pages happen to leave;
- ``RadixCache.cache_finished_req`` and ``MambaRadixCache.cache_finished_req`` (0.5.17 - 0.5.20; from 0.5.21 the
  radix caches' ``on_release``, see :func:`finished_hook`; a hybrid cache's copy of a running request's state:
  ``cache_unfinished_req``, from 0.5.22 ``checkpoint``, see :func:`unfinished_hook`): the evictable prefix cache is
  bounded by ``KVCACHED_MAX_CACHED_TOKENS`` (as vLLM's prefix cache is), so evicted pages unmap;
  while the device is nearly full (``PageAllocator.device_tight``: another engine sharing
  it may be waiting for memory) all of it goes, there and in ``Scheduler.on_idle``, so an
  idle engine's cache yields too (vLLM's block pool does the same: docs/coserving.md);
- ``SchedulerInvariantChecker._report_leak``: SGLang's idle check that free + cached
  tokens equal the pool size does not hold when free means "can be mapped now" (a kvctl
  limit or another engine lowers it); kvcached checks every freed id itself;
- ``ScheduleBatch.check_decode_mem``: where the next decode step fits, its pages are held in
  kvcached until ``prepare_for_decode`` allocates them (another engine cannot take them in between;
  if it already has, the check fails and SGLang retracts, as for a full pool);
- ``PrefillAdder.add_one_req`` / ``add_chunked_req``: a prefill's pages are held in kvcached when the request is
  admitted (what this engine's radix cache must give up for them is evicted then, not at the allocation), and
  ``Scheduler._get_new_batch_prefill_raw`` gives back what a pass held but did not allocate: between SGLang's
  admission and ``prepare_for_extend`` another engine cannot take them, which SGLang would meet with "Prefill
  out of memory" (an error that stops the engine); a request whose pages cannot be had is not admitted (it
  waits), and an engine with nothing running asks again at every pass (SGLang would not: see
  :func:`releasing_prefill_holds`);
- ``attention_registry.ATTENTION_BACKENDS`` and ``server_args.ATTENTION_BACKEND_CHOICES``
  gain ``kvcached``: the Triton backend of :mod:`backend`, chosen with ``--attention-backend``.
"""

from __future__ import annotations

import atexit
import functools
import threading
from typing import Any

from kvcached import config
from kvcached.errors import KVCachedConfigError
from kvcached.integration.common import PRESSURE_CHECK_S, device_tight_every, wrap_once
from kvcached.utils import get_kvcached_logger

logger = get_kvcached_logger()

_lock = threading.Lock()
_applied = False
GiB = 1 << 30


def kv_budget_bytes(total: int, fraction: float, reserved: int) -> int:
    """This engine's KV budget on a shared device: ``fraction`` of it less what the process already holds."""
    if not 0 < fraction <= 1:
        raise KVCachedConfigError(f"--mem-fraction-static must be in (0, 1], got {fraction!r}.")
    budget = int(total * fraction) - int(reserved)
    if budget <= 0:
        raise KVCachedConfigError(
            f"--mem-fraction-static={fraction} of {total} B leaves no KV memory after the {reserved} B this engine "
            "holds already (weights, activations); raise --mem-fraction-static."
        )
    return budget


def _patch_pool_classes() -> None:
    import sglang.srt.mem_cache.kv_cache_configurator as cfg

    from kvcached.integration.sglang import allocator, pools

    cfg.MHATokenToKVPool = pools.KvcachedMHATokenToKVPool
    cfg.MLATokenToKVPool = pools.KvcachedMLATokenToKVPool
    cfg.TokenToKVPoolAllocator = allocator.KvcachedTokenToKVPoolAllocator
    cfg.PagedTokenToKVPoolAllocator = allocator.KvcachedPagedTokenToKVPoolAllocator
    _patch_mamba_pool()

    def checked_init_pools(original: Any) -> Any:
        def _init_pools(self: Any, *args: Any, **kwargs: Any) -> Any:
            check_layout_features(pools.contiguous_layout(), cfg.get_memory(), cfg.get_disagg(), cfg.get_spec())
            result = original(self, *args, **kwargs)
            check_pools(result.token_to_kv_pool, result.token_to_kv_pool_allocator)
            check_state_pool(getattr(result, "req_to_token_pool", None))
            return result

        return _init_pools

    def device_share(profile: Any) -> Any:
        def _profile_available_bytes(self: Any, pre_model_load_memory: int) -> int:
            if not str(self.device).startswith(("cuda", "hip")):
                return profile(self, pre_model_load_memory)
            import torch

            budget = kv_budget_bytes(int(torch.cuda.get_device_properties(self.gpu_id).total_memory),
                                     float(cfg.get_schedule().mem_fraction_static),
                                     int(torch.cuda.memory_reserved(self.gpu_id)))
            if self.mambaish_config is not None:  # SGLang's own split between Mamba states and KV
                budget = int(self._handle_max_mamba_cache(budget / GiB) * GiB)
            logger.info("kvcached: SGLang KV budget %d B (--mem-fraction-static of the device)", budget)
            return budget

        return _profile_available_bytes

    wrap_once(cfg.KVCacheConfigurator, "_init_pools", checked_init_pools)
    wrap_once(cfg.KVCacheConfigurator, "_profile_available_bytes", device_share)


def dense_row_features(memory: Any, disagg: Any, spec: Any = None) -> list[str]:
    """The SGLang features on in these argument groups that copy a pool's rows as dense (pointer + slot x row
    bytes): the hierarchical cache, PD disaggregation and (``spec`` given) speculative decoding's KV copy."""
    return [what for what, on in (
        ("the hierarchical cache (--enable-hierarchical-cache)", getattr(memory, "enable_hierarchical_cache", False)),
        ("prefill/decode disaggregation", getattr(disagg, "disaggregation_mode", "null") not in (None, "null")),
        ("speculative decoding (its KV copy)", getattr(spec, "speculative_algorithm", None) is not None),
    ) if on]


def check_layout_features(contiguous: bool, memory: Any, disagg: Any, spec: Any) -> None:
    """KVCachedConfigError for SGLang features that address KV rows as dense (pointer + slot x row bytes, from
    ``data_ptrs`` / ``get_contiguous_buf_infos``), which the contiguous layout's strided views are not."""
    if not contiguous:
        return
    uses = dense_row_features(memory, disagg, spec)
    if uses:
        raise KVCachedConfigError(
            f"{uses[0]} reads SGLang's KV rows as dense, which kvcached's contiguous layout is not; use the "
            "per-layer layout (unset KVCACHED_CONTIGUOUS_LAYOUT: the default under SGLang)."
        )


def check_pools(pool: Any, token_allocator: Any) -> None:
    """KVCachedConfigError unless both come from kvcached (the model needs a pool kvcached lacks)."""
    from kvcached.integration.sglang import pools

    if not isinstance(token_allocator, _kvcached_allocators()):
        raise KVCachedConfigError(
            f"this SGLang configuration uses {type(token_allocator).__name__} over {type(pool).__name__}, which "
            "kvcached does not provide (it covers MHA/GQA and MLA pools with page size 1 or more, and hybrid "
            "linear attention's MHA pool). Unset ENABLE_KVCACHED for this model or option."
        )
    pools.manager_of(pool)


def _patch_mamba_pool() -> None:
    """Hybrid models' Mamba states come from kvcached (:mod:`mamba`): SGLang's ``HybridReqToTokenPool`` builds
    its state pool from ``mamba_pool_cls`` and then a slot allocator, which becomes kvcached's."""
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

    from kvcached.integration.sglang import mamba

    HybridReqToTokenPool.mamba_pool_cls = mamba.KvcachedMambaPool

    def with_kvcached_slots(original: Any) -> Any:
        def _init_mamba_pool(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            if isinstance(self.mamba_pool, mamba.KvcachedMambaPool):
                self.mamba_allocator = mamba.KvcachedMambaSlotAllocator(self.mamba_pool, self.device)
            return result

        return _init_mamba_pool

    wrap_once(HybridReqToTokenPool, "_init_mamba_pool", with_kvcached_slots)


def check_state_pool(req_to_token_pool: Any, server_args: Any = None) -> None:
    """KVCachedConfigError if a hybrid model's Mamba states are not kvcached's (a pool class SGLang chose
    instead of ``mamba_pool_cls``): their memory would be a static share beside kvcached's; or if the server
    arguments (``server_args``, else the engine's) name a feature or kernel that reads them as dense rows
    (:func:`check_state_readers`)."""
    from kvcached.integration.sglang import mamba

    pool = getattr(req_to_token_pool, "mamba_pool", None)
    if pool is None:
        return
    if not isinstance(pool, mamba.KvcachedMambaPool) or not isinstance(
            getattr(req_to_token_pool, "mamba_allocator", None), mamba.KvcachedMambaSlotAllocator):
        raise KVCachedConfigError(
            f"this SGLang configuration keeps Mamba states in {type(pool).__name__}, which kvcached does not "
            "provide. Unset ENABLE_KVCACHED for this model or option."
        )
    if server_args is None:
        from sglang.srt.runtime_context import get_server_args

        server_args = get_server_args()
    check_state_readers(server_args)


# Kernels that take the state slot's stride (SGLang's own list for its strided page-major states); ``cutedsl``
# only for MLA hybrids (KDA), whose cutedsl kernels are stride-safe.
STRIDED_STATE_KERNELS = {"linear_attn_decode_backend": {"triton", "flashinfer"},
                         "linear_attn_prefill_backend": {"triton", "flashkda"},
                         "mamba_backend": {"triton"}}


def uses_mla(server_args: Any) -> bool:
    """Whether the model runs SGLang's MLA backend: a method of ``ServerArgs`` up to 0.5.18, a function of
    ``sglang.srt.arg_groups.model_override_base`` from 0.5.19 (reading only the method, 0.5.19+ saw no MLA model
    and refused ``cutedsl`` for KDA hybrids)."""
    method = getattr(server_args, "use_mla_backend", None)
    if method is not None:
        return bool(method())
    try:
        from sglang.srt.arg_groups.model_override_base import use_mla_backend
    except ImportError:  # up to 0.5.18 the method above is the only form: arguments without it name no MLA model
        return False
    return bool(use_mla_backend(server_args))


def check_state_readers(server_args: Any) -> None:
    """KVCachedConfigError for what would read kvcached's Mamba states, whose slots are strided, as dense rows
    (pointer + slot x slot bytes): the hierarchical cache's and PD disaggregation's state transfers, in either
    layout, and kernels that are not stride-aware."""
    uses = dense_row_features(server_args, server_args)  # speculative decoding: refused by the pool itself
    if uses:
        raise KVCachedConfigError(
            f"{uses[0]} copies a hybrid model's Mamba states as dense rows, which kvcached's state slots are not; "
            "turn it off or unset ENABLE_KVCACHED for this model."
        )
    for arg, allowed in STRIDED_STATE_KERNELS.items():
        chosen = getattr(server_args, arg, None)
        if arg.startswith("linear_attn"):
            chosen = chosen or getattr(server_args, "linear_attn_backend", None)
            # asked only here: from 0.5.19 the answer builds the model's configuration
            if chosen not in allowed | {None} and uses_mla(server_args):
                allowed = allowed | {"cutedsl"}
        if chosen not in allowed | {None}:
            flag = "--" + arg.replace("_", "-")
            raise KVCachedConfigError(
                f"{flag}={chosen} reads Mamba states as dense rows; kvcached's state slots are strided, which "
                f"only {sorted(allowed)} read. Pass {flag} triton (or unset ENABLE_KVCACHED)."
            )


def state_slots_of(req_to_token_pool: Any) -> Any:
    """kvcached's Mamba slot allocator behind ``req_to_token_pool``, or None (not a hybrid model's pool)."""
    from kvcached.integration.sglang import mamba

    slots = getattr(req_to_token_pool, "mamba_allocator", None)
    return slots if isinstance(slots, mamba.KvcachedMambaSlotAllocator) else None


def state_slots_needed(req_to_token_pool: Any, req: Any) -> int:
    """Mamba slots a prefill pass allocates for ``req``: its state slot (taken by the copy-on-write of a cached
    prefix's state, or else by ``HybridReqToTokenPool.alloc``) and its ping-pong track slots."""
    kv = getattr(req, "kv", None)
    state = kv if hasattr(kv, "mamba_pool_idx") else req  # SGLang 0.5.19 moved them under ``req.kv``
    need = 1 if state.mamba_pool_idx is None else 0
    if req_to_token_pool.enable_mamba_extra_buffer and state.mamba_ping_pong_track_buffer is None:
        need += 1 if req_to_token_pool.enable_mamba_extra_buffer_lazy else (
            req_to_token_pool.mamba_ping_pong_track_buffer_size)
    return need


def radix_of(cache: Any) -> Any:
    """The radix cache behind SGLang's streaming-session wrapper (``--enable-streaming-session`` around a cache
    without sessions of its own), else ``cache``."""
    from sglang.srt.session.streaming_session import StreamingSession

    return cache.inner if isinstance(cache, StreamingSession) else cache


def state_copies(tree_cache: Any) -> int:
    """1 where the radix cache copies a request's state into a slot of its own after the request's prefill
    (``cache_unfinished_req`` of SGLang's hybrid radix caches, in the result processing, outside the pass)."""
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    tree_cache = radix_of(tree_cache)
    if isinstance(tree_cache, UnifiedRadixCache):
        return int(tree_cache.supports_mamba() and not tree_cache.disable)
    return int(isinstance(tree_cache, mamba_radix_caches()) and not tree_cache.disable)


@functools.cache  # read on every idle pass and finished request: a failing import searches sys.path each time
def mamba_radix_caches() -> tuple[type, ...]:
    """SGLang's ``MambaRadixCache`` where the release has one: 0.5.21 removed its module, and hybrid models get the
    ``UnifiedRadixCache`` (with a Mamba component) instead."""
    name = "sglang.srt.mem_cache.mamba_radix_cache"
    try:
        from sglang.srt.mem_cache.mamba_radix_cache import MambaRadixCache
    except ModuleNotFoundError as exc:
        if exc.name != name:  # a dependency of a module that is there: not the release's removal
            raise
        return ()
    return (MambaRadixCache,)


def finished_hook(radix_cache_cls: type) -> str:
    """The radix cache's method that SGLang's ``release_kv_cache`` calls last for a finished (or aborted, or
    retracted) request, after its KV went into the tree and its lock on the tree was dropped: 0.5.17 - 0.5.20 call
    ``cache_finished_req``, which does all of it; 0.5.21 split that into ``insert_req``, ``free_kv_row`` and
    ``unpin``, and calls ``on_release`` after them."""
    return "cache_finished_req" if hasattr(radix_cache_cls, "cache_finished_req") else "on_release"


def unfinished_hook(radix_cache_cls: type) -> str:
    """The radix cache's method that inserts a running request's prefix (and, in a hybrid model's cache, copies its
    Mamba state into the tree: the copy a promised slot is held for): ``cache_unfinished_req`` up to 0.5.21;
    0.5.22 calls ``checkpoint`` for running and finished requests alike (a finished one's state is donated, not
    copied)."""
    return "cache_unfinished_req" if hasattr(radix_cache_cls, "cache_unfinished_req") else "checkpoint"


def holding_state_slots(original: Any) -> Any:
    """``Req.init_next_round_input`` that, in a prefill pass, first holds the Mamba slots the pass will allocate
    for the request (the copy-on-write of a cached state is the first, inside this very call): SGLang asserts on
    a slot it cannot get. Where they cannot be had, even after this engine's radix cache gives up cached states,
    the request is matched without the copy and marked; ``add_one_req`` then does not admit it (it waits)."""

    def init_next_round_input(self: Any, tree_cache: Any = None, cow_mamba: Any = None) -> Any:
        pool = getattr(tree_cache, "req_to_token_pool", None)
        slots = state_slots_of(pool)
        self._kvcached_no_state_slot = False
        if slots is not None and slots.in_prefill_pass:
            need = state_slots_needed(pool, self) + state_copies(tree_cache)
            if need and not slots.hold(slots.held_slots + need):
                evicted = tree_cache.supports_mamba()
                if evicted:
                    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

                    tree_cache.evict(EvictParams(num_tokens=0, mamba_num=need))
                if not slots.hold(slots.held_slots + need, after_eviction=evicted):
                    self._kvcached_no_state_slot = True
                    cow_mamba = False
        return original(self, tree_cache, cow_mamba)

    return init_next_round_input


def evictable(cache: Any) -> tuple[int, int] | None:
    """(cached tokens, cached Mamba states) that ``cache`` could evict now; None for a cache kvcached does not
    bound (SGLang's hybrid and unified radix caches are not ``RadixCache`` subclasses)."""
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    cache = radix_of(cache)
    if isinstance(cache, (*mamba_radix_caches(), UnifiedRadixCache)):  # a unified cache without Mamba counts 0 states
        return cache.full_evictable_size(), cache.mamba_evictable_size()
    if isinstance(cache, RadixCache):
        return cache.evictable_size(), 0
    return None


def yield_if_tight(cache: Any) -> int:
    """Evict the whole evictable radix cache of a kvcached engine (with a hybrid model's cached Mamba states)
    while the device is nearly full; the tokens evicted. Reads the device at most every PRESSURE_CHECK_S (the
    scheduler calls this on every idle pass)."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    cache = radix_of(cache)  # one cache, one pressure reading: the scheduler's (wrapper) and its own (bound)
    alloc = getattr(cache, "token_to_kv_pool_allocator", None)
    sizes = evictable(cache)
    if sizes is None or not isinstance(alloc, _kvcached_allocators()):
        return 0
    n, states = sizes
    if n + states <= 0 or not device_tight_every(alloc.kvcached.page_allocator, cache, "_kvcached_pressure_checked",
                                                 PRESSURE_CHECK_S):
        return 0
    cache.evict(EvictParams(num_tokens=n, mamba_num=states))
    return n


def _patch_radix_cache() -> None:
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    def bounded(original: Any) -> Any:
        def finished(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            # after the request's lock on its nodes is released: only unlocked (evictable) prefixes go (a hybrid
            # model's evicted leaves take their Mamba states with them)
            bound = config.max_cached_tokens()
            cached = evictable(self)[0]
            if bound >= 0 and cached > bound:
                self.evict(EvictParams(num_tokens=cached - bound))
            yield_if_tight(self)
            return result

        return finished

    # SGLang builds UnifiedRadixCache for hybrid models (0.5.17-0.5.19) and for every model from 0.5.19;
    # MambaRadixCache when a release (up to 0.5.20) or a configuration picks it
    for cls in (RadixCache, *mamba_radix_caches(), UnifiedRadixCache):
        wrap_once(cls, finished_hook(cls), bounded)
    for cls in (*mamba_radix_caches(), UnifiedRadixCache):
        # 0.5.21's finished-request insert donates the request's own state (no copy, no slot taken); its
        # on_release ends the promise, inserted or not, as cache_finished_req's end did before
        for name in (unfinished_hook(cls), finished_hook(cls)):
            wrap_once(cls, name, fulfilling_state_copy, marker="_kvcached_promise")
    wrap_once(Scheduler, "on_idle", yield_on_idle)
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor

    wrap_once(SchedulerBatchResultProcessor, "process_batch_result_prefill", fulfilling_after_prefill,
              marker="_kvcached_promise")


def fulfilling_after_prefill(original: Any) -> Any:
    """``process_batch_result_prefill`` after which no request of the batch keeps a promised slot: the radix cache's
    copies of their states are made there, or skipped where SGLang does not call the cache for a request
    (``skip_radix_cache_insert``, a streaming session's own cache), which would otherwise keep the slot held for
    the request's whole life."""

    def process_batch_result_prefill(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, batch, *args, **kwargs)
        finally:
            slots = state_slots_of(getattr(self, "req_to_token_pool", None))
            if slots is not None and slots.promised:
                slots.fulfil(*getattr(batch, "reqs", ()))

    return process_batch_result_prefill


def fulfilling_state_copy(original: Any) -> Any:
    """A hybrid radix cache's ``cache_unfinished_req`` or :func:`finished_hook` after which the request's promised slot
    is no longer kept: the copy took it (an allocation takes held slots first) or, for a finished request, was not
    made."""

    def cache_req(self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        slots = state_slots_of(self.req_to_token_pool)
        if slots is None:
            return original(self, req, *args, **kwargs)
        slots.copying = True
        try:
            return original(self, req, *args, **kwargs)
        finally:
            slots.copying = False
            slots.fulfil(req)

    return cache_req


def yield_on_idle(original: Any) -> Any:
    """``Scheduler.on_idle`` that first gives the radix cache back on a nearly full device."""
    warned = []

    def on_idle(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            yield_if_tight(getattr(self, "tree_cache", None))
        except Exception as exc:  # a driver error must not stop the engine: say it once
            if not warned:
                logger.warning("kvcached: could not check the device for the radix cache: %s", exc)
                warned.append(exc)
        return original(self, *args, **kwargs)

    return on_idle


def _patch_decode_check() -> None:
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    wrap_once(ScheduleBatch, "check_decode_mem", holding_decode_check)


def holding_decode_check(original: Any) -> Any:
    """``ScheduleBatch.check_decode_mem`` that, where the next decode step fits, holds its pages in kvcached until
    ``prepare_for_decode`` allocates them. Without the hold another engine on the device could take them in
    between and SGLang's allocation would raise "Decode out of memory"; with it, pages that cannot be had make
    the check fail, and SGLang retracts requests (or aborts the last one) as for a full pool."""

    def check_decode_mem(self: Any, selected_indices: Any = None) -> bool:
        fits = original(self, selected_indices)
        alloc = getattr(self, "token_to_kv_pool_allocator", None)
        if not fits or not isinstance(alloc, _kvcached_allocators()):
            return fits
        tokens = self.new_tokens_required_next_decode(selected_indices)
        return alloc.hold(-(-tokens // alloc.page_size))

    return check_decode_mem


def _patch_prefill_admission() -> None:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.schedule_policy import PrefillAdder
    from sglang.srt.managers.scheduler import Scheduler

    wrap_once(Req, "init_next_round_input", holding_state_slots)
    wrap_once(PrefillAdder, "add_one_req", holding_admission)
    wrap_once(PrefillAdder, "add_chunked_req", holding_chunk)
    wrap_once(Scheduler, "_get_new_batch_prefill_raw", releasing_prefill_holds)


def hold_prefill(adder: Any, req: Any, new_tokens: int) -> bool:
    """Hold in kvcached the pages of everything ``adder`` admitted so far plus ``new_tokens`` of ``req``; where
    kvcached cannot give them all, this engine's radix cache gives up the rest now (least recently used,
    never a locked prefix nor ``req``'s own). False if they cannot be had even so."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    alloc = adder.token_to_kv_pool_allocator
    page = adder.page_size
    # SGLang's own upper bound of a pass's allocation: each admitted request's paged extend plus one page
    pages = -(-(admitted_tokens(adder) + new_tokens) // page)
    if alloc.hold(pages):
        return True
    cache = adder.tree_cache
    if cache is None or cache.evictable_size() <= 0:
        return False
    with adder._lock_node(req.last_node):  # its cached prefix is the request's own: not to be evicted for it
        cache.evict(EvictParams(num_tokens=(pages - alloc.held_pages) * page))
    return alloc.hold(pages, after_eviction=True)


def prefix_tokens(req: Any) -> int:
    """The tokens of ``req``'s matched prefix: ``len(req.prefix_indices)`` up to 0.5.21; 0.5.22 keeps only the
    length, ``req.prefix_len``."""
    indices = getattr(req, "prefix_indices", None)
    return req.prefix_len if indices is None else len(indices)


def admitted_tokens(adder: Any) -> int:
    """The tokens ``adder`` counts against what is free now for the pass's allocation (its admitted requests' paged
    extends, a page each, and a mixed chunk's decode tokens): ``cur_rem_token_offset`` up to 0.5.20; 0.5.21 moved
    the adder's memory accounting into the allocator's ``PrefillBudget`` (``memory_budget.current_offset``)."""
    budget = getattr(adder, "memory_budget", None)
    return adder.cur_rem_token_offset if budget is None else budget.current_offset


def holding_admission(original: Any) -> Any:
    """``PrefillAdder.add_one_req`` that first holds the request's pages (see :func:`hold_prefill`); where they
    cannot be had the request is not admitted (``NO_TOKEN``: it waits, as for a full pool)."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    def add_one_req(self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(req, "_kvcached_no_state_slot", False):  # see holding_state_slots
            return AddReqResult.NO_TOKEN
        if isinstance(self.token_to_kv_pool_allocator, _kvcached_allocators()):
            extend = self.ceil_paged_tokens(len(req.full_untruncated_fill_ids) - prefix_tokens(req))
            if not hold_prefill(self, req, extend + self.page_size):
                return AddReqResult.NO_TOKEN
        result = original(self, req, *args, **kwargs)
        promise_state_copy(self, req, held=True)
        return result

    return add_one_req


def promise_state_copy(adder: Any, req: Any, held: bool) -> None:
    """Where ``adder`` admitted ``req`` and its radix cache will copy the request's state after this prefill, keep
    a slot held for that copy past the pass; ``held``: holding_state_slots held it already, else it is held now."""
    cache = getattr(adder, "tree_cache", None)
    slots = state_slots_of(getattr(cache, "req_to_token_pool", None))
    if slots is None or not state_copies(cache) or not adder.can_run_list or adder.can_run_list[-1] is not req:
        return
    if held or slots.hold(slots.held_slots + 1):
        slots.promise(req)


def holding_chunk(original: Any) -> Any:
    """``PrefillAdder.add_chunked_req`` (the next chunk of a request SGLang must continue) that holds the chunk's
    pages once SGLang has sized it from what is available: from then on no other engine can take them."""

    def add_chunked_req(self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, req, *args, **kwargs)
        if isinstance(self.token_to_kv_pool_allocator, _kvcached_allocators()):
            hold_prefill(self, req, 0)  # the chunk is in the adder's offset already
        promise_state_copy(self, req, held=False)  # the radix cache copies the state at every chunk's end
        return result

    return add_chunked_req


def releasing_prefill_holds(original: Any) -> Any:
    """``Scheduler._get_new_batch_prefill_raw`` during which holds last from one allocation to the next (with
    ``--enable-mixed-chunk`` the pass allocates the prefill, then the running requests' decode tokens, which the
    admissions' holds count), and that gives back what it held and did not allocate (a pass that admitted
    nothing, or an error): no page stays held past the pass. An engine with nothing running tries its waiting
    requests again at every pass, however SGLang marked its batch."""

    def _get_new_batch_prefill_raw(self: Any, *args: Any, **kwargs: Any) -> Any:
        alloc = getattr(self, "token_to_kv_pool_allocator", None)
        if not isinstance(alloc, _kvcached_allocators()):
            return original(self, *args, **kwargs)
        running = kwargs.get("running_batch", args[1] if len(args) > 1 else None)
        if running is not None and running.batch_is_full and running.is_empty() and self.waiting_queue:
            # SGLang marks the batch full when a request does not fit, and only a running request's end clears
            # it: with nothing running that never comes, yet here memory comes back without this engine (another
            # engine frees it, a kvctl limit is raised), so an idle engine asks again at every pass
            running.batch_is_full = False
        slots = state_slots_of(getattr(self, "req_to_token_pool", None))
        alloc.in_prefill_pass = True
        if slots is not None:
            slots.in_prefill_pass = True
        try:
            return original(self, *args, **kwargs)
        finally:
            alloc.in_prefill_pass = False
            if slots is not None:
                slots.in_prefill_pass = False
            try:
                alloc.release_held()
            finally:
                if slots is not None:
                    slots.release_held()

    return _get_new_batch_prefill_raw


def _register_attention_backend() -> None:
    """``--attention-backend kvcached`` (also ``--prefill-`` / ``--decode-attention-backend``): SGLang's
    argument choices and its backend registry. Plugins load before SGLang parses its arguments."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    from kvcached.integration.sglang.backend import NAME, create

    if NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([NAME])
    if NAME not in ATTENTION_BACKENDS:
        register_attention_backend(NAME)(create)


def _patch_leak_check() -> None:
    from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker

    def counted_by_kvcached(original: Any) -> Any:
        def _report_leak(self: Any, pool_name: str, token_msg: str) -> None:
            if isinstance(getattr(self, "token_to_kv_pool_allocator", None), _kvcached_allocators()):
                logger.debug("kvcached: SGLang's %s count check skipped (free = mappable now): %s", pool_name,
                             token_msg)
                return
            original(self, pool_name, token_msg)

        return _report_leak

    wrap_once(SchedulerInvariantChecker, "_report_leak", counted_by_kvcached)


def _kvcached_allocators() -> tuple[type, ...]:
    from kvcached.integration.sglang import allocator

    return allocator.KvcachedTokenToKVPoolAllocator, allocator.KvcachedPagedTokenToKVPoolAllocator


def apply() -> str:
    """Install every hook (idempotent); returns the SGLang version. KVCachedConfigError outside the range."""
    global _applied
    from kvcached.integration.sglang.version import check_sglang_version, installed_sglang_version

    version = installed_sglang_version()
    with _lock:
        if _applied:
            return version
        check_sglang_version(version)
        _patch_pool_classes()
        _patch_radix_cache()
        _patch_leak_check()
        _patch_decode_check()
        _patch_prefill_admission()
        _register_attention_backend()
        from kvcached.integration.common import shutdown_at_exit
        from kvcached.integration.sglang import interfaces

        atexit.register(shutdown_at_exit(interfaces.shutdown_kvcached))
        _applied = True
    logger.info("kvcached: SGLang %s hooks installed", version)
    return version

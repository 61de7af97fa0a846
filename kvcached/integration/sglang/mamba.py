"""SGLang's Mamba state pool (hybrid models' per-request recurrent states) in kvcached's memory.

A hybrid model (Qwen3-Next, Nemotron-H, Falcon-H1, Granite-4.0-H...) keeps, besides its
attention layers' KV, one slot of recurrent state per request for every Mamba/linear-attention
layer: conv windows and an SSM state, tens of MiB a slot over the layers. SGLang allocates
``max_mamba_cache_size`` slots up front; here they are slots of a kvcached group laid out by
:class:`kvcached.layout.StateSlots` (slot-major, SGLang's envelope order), and a slot's pages
are mapped while SGLang holds the slot. The state tensors keep SGLang's shapes
``[layers, slots, *shape]`` with a slot stride of the slot's bytes, as under SGLang's own
``--enable-page-major-kv-layout``, whose strided slots its kernels read.

Refused with an error (their buffers are not the two state arrays, or they address slots as
dense rows): speculative decoding, ReplaySSM rings, SGLang's own envelope layout, the memory
saver, custom memory pools, NPU and CPU-AMX state layouts, more than one rank. The int8
checkpoint pool (``--enable-int8-mamba-checkpoint``) stays SGLang's memory.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
from sglang.srt.mem_cache import memory_pool
from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator
from sglang.srt.mem_cache.memory_pool import MambaPool

from kvcached import vmm_ops
from kvcached.errors import KVCachedConfigError
from kvcached.integration.common import fresh_group_id
from kvcached.integration.sglang import interfaces
from kvcached.integration.sglang.allocator import Holds
from kvcached.integration.sglang.pools import _refuse, _single_rank, contiguous_layout
from kvcached.kv_cache_manager import KVCacheManager
from kvcached.layout import Layout, StateSlots, state_views

GiB = 1 << 30


def _state_views(arrays: tuple[tuple[tuple[int, ...], torch.dtype], ...], layers: int, num_slots: int,
                 device: Any) -> tuple[list[torch.Tensor], KVCacheManager]:
    """Views ``[layers, num_slots, *shape]`` of each state array in a fresh kvcached group, and its manager
    (a block is a slot; block 0, SGLang's dummy slot for padded requests, is always mapped)."""
    interfaces.init_kvcached(device=str(device), contiguous_layout=contiguous_layout())
    slots = StateSlots(arrays, layers, vmm_ops.runtime().page_size)
    geom = slots.geometry(num_slots)
    group_id = fresh_group_id()
    raw = vmm_ops.create_kv_tensors(geom.num_pages * geom.page_size, 1, str(device), slots.cells, 1, group_id,
                                    layout=Layout.CONTIGUOUS)
    manager = interfaces.get_kv_cache_manager(num_slots, 1, slots.cell_bytes, slots.cells, reserve_null_block=True,
                                              num_kv_buffers=1, group_id=group_id,
                                              pool_name=f"sglang-mamba{group_id}", layout=Layout.CONTIGUOUS)
    return state_views(raw[0], slots, num_slots), manager


class KvcachedMambaPool(MambaPool):
    """SGLang's ``MambaPool`` whose conv and temporal states are views into kvcached's virtual memory."""

    def __init__(self, *, size: int, cache_params: Any, mamba_layer_ids: list[int], device: str,
                 **kwargs: Any) -> None:
        for name in ("enable_memory_saver", "envelope_layout", "enable_linear_replayssm",
                     "enable_linear_replayssm_spec"):
            if kwargs.get(name):
                _refuse("Mamba", f"{name}=True")
        if kwargs.get("speculative_num_draft_tokens") is not None:
            _refuse("Mamba", "speculative decoding (its per-draft state buffers)")
        if getattr(memory_pool, "_is_npu", False) or (getattr(memory_pool, "_is_cpu", False)
                                                      and getattr(memory_pool, "_cpu_has_amx_support", False)):
            _refuse("Mamba", "the NPU or CPU-AMX state layout")
        _single_rank("Mamba")
        self.kvcached_manager: KVCacheManager | None = None
        # SGLang's constructor with one slot builds everything but the states (a few MiB, dropped below)
        super().__init__(size=0, cache_params=cache_params, mamba_layer_ids=mamba_layer_ids, device=device,
                         **kwargs)
        if self.enable_custom_mem_pool:
            _refuse("Mamba", "a custom memory pool (NVLink disaggregation)")
        shape, dtype = cache_params.shape, cache_params.dtype
        arrays = (*((tuple(int(d) for d in s), dtype.conv) for s in shape.conv),
                  (tuple(int(d) for d in shape.temporal), dtype.temporal))
        views, self.kvcached_manager = _state_views(arrays, len(mamba_layer_ids), size + 1, device)
        self.size = size
        self.mamba_cache = dataclasses.replace(self.mamba_cache, conv=views[:-1], temporal=views[-1])
        self.mem_usage = self.mamba_cache.mem_usage_bytes() / GiB  # virtual: what SGLang would have allocated

    def _dense_only(self, what: str) -> Any:
        raise KVCachedConfigError(
            f"SGLang's {what} reads Mamba states as dense rows, which kvcached's state slots are not; unset "
            "ENABLE_KVCACHED for this configuration (PD disaggregation or a hierarchical cache of a hybrid model)."
        )

    def get_contiguous_buf_infos(self) -> Any:
        return self._dense_only("transfer of state buffers")


class KvcachedMambaSlotAllocator(Holds, MambaSlotAllocator):
    """SGLang's Mamba slot free list, drawn from the pool's :class:`KVCacheManager`: a slot handed out is
    mapped, a freed one is unmapped once no slot on its pages is left (and the device's work on it has run).

    ``alloc`` returns None when memory cannot be had now (another engine holds it, or a ``kvctl`` limit),
    as SGLang's own allocator does when its slots run out. SGLang asserts on that at admission, so
    the hooks hold an admitted request's slots first (:meth:`hold`, see ``patches``).
    """

    def __init__(self, pool: KvcachedMambaPool, device: str) -> None:
        if pool.kvcached_manager is None:
            raise KVCachedConfigError("the Mamba pool has no kvcached manager; build it as KvcachedMambaPool.")
        self.kvcached = pool.kvcached_manager
        self._in_use: set[int] = set()
        self.in_prefill_pass = False  # set by the scheduler's prefill pass (patches): holds last until it ends
        # admitted requests a slot is held for past the pass: the copy of their state that SGLang's radix cache
        # takes after their prefill (a request that goes away without it drops out by itself)
        self._promised: weakref.WeakSet[Any] = weakref.WeakSet()
        self.copying = False  # inside the radix cache's copy (patches): it may take a promised slot
        super().__init__(size=pool.size, device=device)

    def available_size(self) -> int:
        """Slots an ``alloc`` could have now: held ones, but those promised to a copy that this ``alloc`` may not
        take, and what kvcached can map (advisory)."""
        return max(0, int(self.kvcached.available_size()) - min(self._spared(), self.held))

    def alloc_group_begin(self, num_reqs: int) -> None:
        # SGLang takes a slot for every waiting request here; kvcached holds one only for each request it
        # admits (mapping memory for the whole queue would take it from the other engines)
        self._alloc_iter = None

    def alloc_group_end(self) -> None:
        self._alloc_iter = None

    def _do_alloc(self, need_size: int) -> torch.Tensor | None:
        # held slots first, but the promised ones only for the radix cache's copy: in a pass too, where a running
        # request's lazy track slot (a mixed chunk's decode) would take one promised in the pass before, whose
        # copy (that batch's result, processed after this pass under overlap scheduling) then finds none
        ids = self.kvcached.alloc(int(need_size), spare_reserved=self._spared())
        if ids is None:
            return None
        self._in_use.update(ids)
        return torch.tensor(ids, dtype=torch.int64, device=self.device)

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        # -1: no slot (a lazy ping-pong track buffer's unused half), which SGLang's streaming session frees as it is
        ids = [int(i) for i in free_index.flatten().tolist() if i != -1]
        if not ids:
            return
        bad = [i for i in ids if i not in self._in_use]
        if bad or len(set(ids)) != len(ids):
            raise ValueError(f"Mamba slots {sorted(set(bad) or ids)[:8]} are freed twice or were never handed out; "
                             "nothing was freed.")
        self.kvcached.free(ids)
        self._in_use.difference_update(ids)

    held_slots = Holds.held

    def promise(self, req: Any) -> None:
        """Keep one held slot for ``req`` past the prefill pass (see :meth:`release_held`)."""
        self._promised.add(req)

    def fulfil(self, *reqs: Any) -> None:
        """``reqs``' radix cache copies are made (or will not be): their slots are no longer kept (outside a pass,
        a slot a copy did not take goes back now)."""
        for req in reqs:
            self._promised.discard(req)
        if not self.in_prefill_pass:
            self.release_held()

    @property
    def promised(self) -> int:
        return len(self._promised)

    def _spared(self) -> int:
        """Held slots an ``alloc`` must leave: all promised ones, but inside the radix cache's copy."""
        return 0 if self.copying else self.promised

    def release_held(self) -> None:
        """Give back what the prefill pass held and did not allocate, but a slot for each request promised one:
        SGLang's radix cache copies an admitted request's state after its prefill (``cache_unfinished_req``,
        outside the pass) into a slot it asserts it gets."""
        if self.held > self.promised:
            self.kvcached.free_reserved(keep=self.promised)

    @property
    def free_slots(self) -> torch.Tensor:
        """The slots SGLang does not hold (SGLang's invariant checker reads this)."""
        free = [i for i in range(1, self.size + 1) if i not in self._in_use]
        return torch.tensor(free, dtype=torch.int64, device=self.device)

    def clear(self) -> None:
        self._alloc_iter = None
        self.kvcached.clear()  # held slots go too
        self._in_use.clear()
        self._promised = weakref.WeakSet()
        self.copying = False

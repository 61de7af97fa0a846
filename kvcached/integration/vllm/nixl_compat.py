"""vLLM's NixlConnector (prefill/decode disaggregation) over kvcached's KV tensors, vLLM 0.32.

What the connector derives from the KV tensors (``NixlBaseConnectorWorker.register_kv_caches`` in
``vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py``):

* memory registered with NIXL: for every layer view, its *storage*, ``[storage.data_ptr(),
  + storage.nbytes())``, one registration per distinct storage;
* per region (one per layer): base ``view.data_ptr()``, block stride ``view.stride(0)`` bytes,
  block length the layer's page size; block ``b``'s descriptor is ``(base + b * stride, length)``.
  The stride and length are taken as they are only when the storage is exactly ``num_blocks``
  block strides long (``0 <= storage - num_blocks * stride < stride``); otherwise it splits the
  view into segments of ``num_blocks * stride`` bytes, and fails when the view is not whole segments.

kvcached's views sit on its virtual tensors, mostly longer than vLLM's blocks (they hold the device's
share rounded up to whole pages; vLLM plans on it rounded down). In the contiguous layout (layers of a
block side by side) that fails the check above and vLLM refuses to register ("cannot be partitioned");
in the per-layer layout the descriptors are right but each registration covers the whole virtual
tensor. :func:`exact_views` gives the connector the same views over storages cut to the bytes the
blocks occupy: contiguous, one region ``[t, t + N * L * page)``; per-layer, one ``[t_l, t_l + N * page)``
per layer. Descriptors then match :mod:`kvcached.layout` block for block (tests/e2e/test_nixl_registration.py).

Virtual memory: the regions are registered once, at start-up, when most pages are not mapped yet
(every unmapped page reads kvcached's shared zero page, so registration itself succeeds). A
transport that resolves virtual to physical pages at registration (RDMA through nvidia-peermem or
dma-buf, UCX ``cuda_ipc``, ``gdr_copy``, ``knem``) keeps the zero page and never sees the pages
kvcached maps later: transfers would move the wrong bytes (nixl issue 1126: a remap under
registered memory; openucx/ucx PR 11283: ``cuda_ipc`` exports only the first physical chunk of a
VMM range). So the registration is refused unless NIXL runs UCX over transports that resolve the
address at each transfer (:data:`PER_TRANSFER_TRANSPORTS`), or vLLM stages through host buffers
(``kv_buffer_device: cpu``: then only vLLM's own static host buffers are registered), or the user
sets ``KVCACHED_NIXL_ANY_TRANSPORT=true``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any

import torch

from kvcached import config, vmm_ops
from kvcached.errors import KVCachedConfigError
from kvcached.integration.common import release, wrap_once
from kvcached.utils import get_kvcached_logger

logger = get_kvcached_logger()

# The connector code this module was written against and tested with (its register_kv_caches changes often).
MIN_VERSION, MAX_VERSION_EXCLUSIVE = (0, 32, 0), (0, 33, 0)
NIXL_MODULES = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"  # also the older "...v1.nixl_connector"
WORKER_MODULE = NIXL_MODULES + ".base_worker"
# UCX transports that read or write through the virtual address when a transfer runs: sockets, the
# kernel's cross-memory attach, the loopback, and the CUDA copy engine (GPU memory over tcp stages through it).
PER_TRANSFER_TRANSPORTS = frozenset({"tcp", "cma", "self", "cuda_copy"})


def check_vllm_version(version: str) -> None:
    """KVCachedConfigError unless the NIXL connector of vLLM ``version`` is the one kvcached was tested with."""
    try:
        rel = release(str(version))
    except ValueError:
        rel = None
    if rel is None or not MIN_VERSION <= rel < MAX_VERSION_EXCLUSIVE:
        raise KVCachedConfigError(
            f"kvcached supports vLLM's NixlConnector on vLLM 0.32 only (this is vLLM {version}): the connector "
            "derives NIXL regions from the KV tensors differently in other versions. Install vllm 0.32, or unset "
            "ENABLE_KVCACHED for prefill/decode disaggregation."
        )


def check_transport(backends: list[str], ucx_tls: str | None) -> None:
    """KVCachedConfigError unless NIXL's transports see pages kvcached maps after registration (module docstring)."""
    if config.nixl_any_transport():
        return
    tls = [t.strip().lower() for t in (ucx_tls or "").split(",") if t.strip()]
    if list(backends) == ["UCX"] and tls and set(tls) <= PER_TRANSFER_TRANSPORTS:
        return
    raise KVCachedConfigError(
        f"kvcached's KV memory is mapped page by page while vLLM runs, but NIXL (backends {list(backends)}, "
        f"UCX_TLS={ucx_tls or 'unset: every transport'}) registers it once, and RDMA or CUDA IPC transports keep "
        "the pages that were mapped at registration, so transfers would move stale bytes. Use one of: "
        f"UCX_TLS made of {', '.join(sorted(PER_TRANSFER_TRANSPORTS))} (e.g. tcp,cma,self for host memory, "
        "tcp,cuda_copy for GPU memory); host staging (kv_buffer_device \"cpu\" in --kv-transfer-config); or "
        "KVCACHED_NIXL_ANY_TRANSPORT=true if your transport resolves addresses at each transfer."
    )


def _end_byte(view: torch.Tensor) -> int:
    """One past the last byte of its storage that ``view`` reaches."""
    last = view.storage_offset()
    if view.numel():
        last += sum((n - 1) * s for n, s in zip(view.shape, view.stride(), strict=True)) + 1
    return last * view.element_size()


def _kvcached_storages() -> set[int]:
    """Start addresses of this process's virtual KV tensors."""
    if not vmm_ops.is_initialized():
        return set()
    return {t.data_ptr() for g in vmm_ops.runtime().groups.values() for t in g.tensors}


def exact_views(kv_caches: Mapping[str, Any]) -> dict[str, Any]:
    """The same views (shape, strides, dtype, address), each kvcached storage cut to its blocks' last byte.

    Views that are not over kvcached's virtual tensors are returned as they are.
    """
    owned = _kvcached_storages()
    ends: dict[int, int] = {}
    for view in kv_caches.values():
        if isinstance(view, torch.Tensor) and (ptr := view.untyped_storage().data_ptr()) in owned:
            ends[ptr] = max(ends.get(ptr, 0), _end_byte(view))
    cut: dict[int, Any] = {}
    out: dict[str, Any] = {}
    for name, view in kv_caches.items():
        ptr = view.untyped_storage().data_ptr() if isinstance(view, torch.Tensor) else None
        if ptr not in ends:
            out[name] = view
            continue
        if ptr not in cut:
            cut[ptr] = view.untyped_storage()[0:ends[ptr]]  # a view of the storage, keeps it alive
        out[name] = torch.empty(0, dtype=view.dtype, device=view.device).set_(
            cut[ptr], view.storage_offset(), view.shape, view.stride())
    return out


def _install_register_hook() -> None:
    import importlib

    def hooked(original: Any) -> Any:
        def register_kv_caches(self: Any, kv_caches: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            views = exact_views(kv_caches)
            if any(views[name] is not kv_caches[name] for name in views):
                if not getattr(self, "use_host_buffer", False):  # host staging registers vLLM's own buffers
                    check_transport(list(getattr(self, "nixl_backends", ["UCX"])), os.environ.get("UCX_TLS"))
                logger.info("kvcached: NIXL registers %d KV regions cut to vLLM's %d blocks",
                            len({v.untyped_storage().data_ptr() for v in views.values()}), self.num_blocks)
            return original(self, views, *args, **kwargs)

        return register_kv_caches

    wrap_once(importlib.import_module(WORKER_MODULE).NixlBaseConnectorWorker, "register_kv_caches", hooked)


def uses_nixl(connector: Any) -> bool:
    """Is ``connector`` (or one inside a MultiConnector) vLLM's NIXL connector?"""
    if any(c.__module__.startswith(NIXL_MODULES) for c in type(connector).__mro__):
        return True
    return any(uses_nixl(c) for c in getattr(connector, "_connectors", ()) or ())


def install() -> None:
    """Wrap vLLM's KV connector factory: a NIXL connector made under kvcached is checked and hooked."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:  # a vLLM without KV connectors: nothing to hook
        return
    create = KVConnectorFactory.__dict__["create_connector"].__func__
    if getattr(create, "_kvcached", False):
        return

    @functools.wraps(create)
    def create_connector(cls: Any, *args: Any, **kwargs: Any) -> Any:
        connector = create(cls, *args, **kwargs)
        if uses_nixl(connector):
            from kvcached.integration.vllm.version import installed_vllm_version

            check_vllm_version(installed_vllm_version())
            _install_register_hook()
        return connector

    create_connector._kvcached = True  # type: ignore[attr-defined]
    KVConnectorFactory.create_connector = classmethod(create_connector)

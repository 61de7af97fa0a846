"""kvcached.integration.vllm.nixl_compat without vLLM: the transport rule, the version gate, the cut views."""

from __future__ import annotations

import pytest
import torch

from kvcached import vmm_ops
from kvcached.errors import KVCachedConfigError
from kvcached.integration.vllm import nixl_compat
from kvcached.layout import KVGeometry, KVSpec, Layout, mla_view

PAGE = 2 << 20


@pytest.mark.parametrize("tls", ["tcp", "tcp,cma,self", " TCP , cuda_copy "])
def test_per_transfer_transports_pass(monkeypatch: pytest.MonkeyPatch, tls: str) -> None:
    monkeypatch.delenv("KVCACHED_NIXL_ANY_TRANSPORT", raising=False)
    nixl_compat.check_transport(["UCX"], tls)


@pytest.mark.parametrize(("backends", "tls"), [
    (["UCX"], None), (["UCX"], ""), (["UCX"], "rc,tcp"), (["UCX"], "cuda_ipc,cuda_copy"), (["UCX"], "^rc"),
    (["UCX"], "sm"), (["UCX"], "all"), (["LIBFABRIC"], "tcp"), (["UCX", "GDS"], "tcp")])
def test_transports_that_resolve_at_registration_are_refused(monkeypatch: pytest.MonkeyPatch, backends, tls) -> None:
    monkeypatch.delenv("KVCACHED_NIXL_ANY_TRANSPORT", raising=False)
    with pytest.raises(KVCachedConfigError, match="KVCACHED_NIXL_ANY_TRANSPORT"):
        nixl_compat.check_transport(backends, tls)
    monkeypatch.setenv("KVCACHED_NIXL_ANY_TRANSPORT", "1")
    nixl_compat.check_transport(backends, tls)
    monkeypatch.setenv("KVCACHED_NIXL_ANY_TRANSPORT", "maybe")
    with pytest.raises(KVCachedConfigError, match="not a boolean"):
        nixl_compat.check_transport(backends, tls)


@pytest.mark.parametrize("version", ["0.32.0", "0.32.3+cpu", "0.32.1rc1.dev4"])
def test_tested_vllm_passes(version: str) -> None:
    nixl_compat.check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.31.9", "0.33.0", "0.24.0", "1.0.0", "dev", ""])
def test_other_vllm_is_refused(version: str) -> None:
    with pytest.raises(KVCachedConfigError, match="vLLM 0.32 only"):
        nixl_compat.check_vllm_version(version)


@pytest.mark.parametrize("layout", [Layout.CONTIGUOUS, Layout.PER_LAYER])
def test_cut_views_end_at_the_last_block(layout: Layout) -> None:
    """Views of the first ``n`` blocks (as vLLM makes them) get storages of exactly those blocks' bytes."""
    layers, n, block = 3, 40, 64 << 10
    vmm_ops.init_kvcached("cpu", PAGE, layout is Layout.CONTIGUOUS)
    try:
        raws = vmm_ops.create_kv_tensors(8 * PAGE, 1, "cpu", layers, 1)
        geom = KVGeometry(KVSpec(layers, 8 * PAGE // block, 1, 1, block, torch.uint8, 1), layout, PAGE)
        views = {f"l{i}": mla_view(raws, geom, i)[:n].view(torch.float32) for i in range(layers)}
        plain = torch.zeros(4)
        cut = nixl_compat.exact_views({**views, "plain": plain})
        assert cut["plain"] is plain
        want = [n * layers * block] if layout is Layout.CONTIGUOUS else [n * block] * layers
        assert sorted({cut[k].untyped_storage().nbytes() for k in views}) == sorted(set(want))
        assert raws[0].numel() > want[0]  # the virtual tensor is longer: something was cut
        for name, view in views.items():
            new = cut[name]
            assert (new.data_ptr(), new.shape, new.stride()) == (view.data_ptr(), view.shape, view.stride())
            assert new.untyped_storage().data_ptr() == view.untyped_storage().data_ptr()
        # the same bytes: written through one, read through the other (block 0 is on a mapped page)
        vmm_ops.map_to_kv_tensors([0])
        cut["l1"][0].fill_(7.0)
        assert torch.equal(views["l1"][0], torch.full_like(views["l1"][0], 7.0))
        assert not views["l0"][0].any() and not views["l2"][0].any()
    finally:
        vmm_ops.shutdown_kvcached()


def test_views_without_kvcached_pass_through() -> None:
    t = torch.zeros(8)
    out = nixl_compat.exact_views({"a": t, "b": [t]})
    assert out["a"] is t and out["b"][0] is t

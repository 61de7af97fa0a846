"""vLLM 0.32's NixlConnector registering kvcached's KV tensors (host backend, both layouts).

The connector is vLLM's own (made by its factory, worker role); only NIXL's agent is replaced, by a
recorder, so every registered region and every block descriptor can be checked against
:mod:`kvcached.layout`. Where NIXL is installed (``.venv-nixl``, see scripts/dev.sh) a real agent
also moves blocks between two kvcached pools with the descriptors the connector computed.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

bw = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker",
                         reason="vLLM's NIXL connector is not importable")

from vllm.config import KVTransferConfig, ModelConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvcached import vmm_ops  # noqa: E402
from kvcached.errors import KVCachedConfigError  # noqa: E402
from kvcached.integration.vllm import interfaces, kv_alloc, nixl_compat  # noqa: E402
from kvcached.integration.vllm.version import installed_vllm_version, release  # noqa: E402
from kvcached.kv_cache_manager import KVCacheManager  # noqa: E402
from kvcached.layout import KVGeometry, KVSpec  # noqa: E402

if not nixl_compat.MIN_VERSION <= release(installed_vllm_version()) < nixl_compat.MAX_VERSION_EXCLUSIVE:
    pytest.skip(f"the connector code driven here is vLLM 0.32's, this is {installed_vllm_version()}",
                allow_module_level=True)

LAYERS, BLOCK, N = 2, 128, 40  # vLLM's 40 blocks, fewer than kvcached's virtual tensors hold
NIXL_OVERLAY = Path(__file__).resolve().parents[2] / ".venv-nixl"


class NoNixl:
    """The agent calls the connector makes while registering, doing nothing."""

    def __init__(self, name: str, config: object = None) -> None:
        self.name = name

    def get_reg_descs(self, ranges, mem_type=None):
        return list(ranges)

    def register_memory(self, descs, backends=None):
        return descs

    def get_xfer_descs(self, blocks, mem_type=None):
        return blocks

    def prep_xfer_dlist(self, agent, descs, *args, **kwargs):
        return 1

    def get_agent_metadata(self):
        return b""

    def release_dlist_handle(self, handle):
        pass

    def release_xfer_handle(self, handle):
        pass

    def deregister_memory(self, descs, *args, **kwargs):
        pass


def recording(base: type) -> type:
    class Recording(base):  # type: ignore[misc, valid-type]
        def __init__(self, name: str, config: object = None) -> None:
            super().__init__(name, config)
            self.registered: list[tuple[int, int]] = []  # (start, length) handed to get_reg_descs
            self.block_descs: list[np.ndarray] = []  # each array handed to get_xfer_descs

        def get_reg_descs(self, ranges, mem_type=None):
            if isinstance(ranges, list):  # the connector's call (NIXL calls it again with its own descriptor list)
                self.registered += [(int(r[0]), int(r[1])) for r in ranges]
            return super().get_reg_descs(ranges, mem_type)

        def get_xfer_descs(self, blocks, mem_type=None):
            if isinstance(blocks, np.ndarray):
                self.block_descs.append(blocks.copy())
            return super().get_xfer_descs(blocks, mem_type)

    return Recording


def _real_nixl() -> type | None:
    if importlib.util.find_spec("nixl") is None and NIXL_OVERLAY.is_dir():
        sys.path.append(str(NIXL_OVERLAY))
    try:
        from nixl._api import nixl_agent
    except ImportError:
        return None
    return nixl_agent


@pytest.fixture
def vllm_config(tiny_model: str) -> VllmConfig:
    model = ModelConfig(model=tiny_model, skip_tokenizer_init=True, dtype="float32")
    cfg = VllmConfig(model_config=model, kv_transfer_config=KVTransferConfig(
        kv_connector="NixlConnector", kv_role="kv_both", kv_buffer_device="cpu"))
    cfg.cache_config.kv_cache_layout = KVCacheLayout.LBHNC.name  # what the engine core resolves for NIXL
    return cfg


@pytest.fixture
def env(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """kvcached on the host backend in the layout ``request.param``; vLLM's connector factory hooked."""
    from vllm.platforms import current_platform

    monkeypatch.setenv("KVCACHED_CONTIGUOUS_LAYOUT", str(request.param == "contiguous").lower())
    monkeypatch.setenv("KVCACHED_HOST_MEM_LIMIT_MB", "64")
    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "0")
    monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", "0")
    monkeypatch.setenv("KVCACHED_IPC_NAME", f"kvcached_e2e_nixl_{os.getpid()}")
    monkeypatch.setenv("UCX_TLS", "tcp,cma,self")
    monkeypatch.delenv("KVCACHED_NIXL_ANY_TRANSPORT", raising=False)
    # a single worker outside a distributed run, and no CPU pinning of the test process
    monkeypatch.setattr(bw, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(bw, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(type(current_platform), "discover_numa_topology", lambda *a: [], raising=False)
    # the hooks go again when the test ends
    monkeypatch.setattr(KVConnectorFactory, "create_connector", KVConnectorFactory.__dict__["create_connector"])
    base = bw.NixlBaseConnectorWorker
    monkeypatch.setattr(base, "register_kv_caches", base.__dict__["register_kv_caches"])
    nixl_compat.install()
    made: list = []
    yield SimpleNamespace(layout=request.param, made=made, monkeypatch=monkeypatch)
    for connector in made:
        connector.shutdown()  # deregisters before kvcached unmaps
    interfaces.shutdown_kvcached()
    kv_alloc.reset()


def _kv_cache_config(spec: FullAttentionSpec) -> KVCacheConfig:
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    page = spec.page_size_bytes
    tensor = KVCacheTensor(size=LAYERS * N * page, layers=names, layer_stride=N * page, block_stride=page, offset=0)
    return KVCacheConfig(num_blocks=N, kv_cache_tensors=[tensor], kv_cache_groups=[KVCacheGroupSpec(names, spec)])


def _engine(vllm_config: VllmConfig, env: SimpleNamespace, agent: type) -> SimpleNamespace:
    """kvcached's KV views placed as vLLM 0.32 places them, and a worker-role NixlConnector over them."""
    model = vllm_config.model_config
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=model.get_total_num_kv_heads(),
                             head_size=model.get_head_size(), dtype=torch.float32)
    kcfg = _kv_cache_config(spec)
    caches = kv_alloc.allocate_kv_cache(kcfg, torch.device("cpu"), KVCacheLayout.LBHNC)
    group_id = max(vmm_ops.runtime().groups)
    env.monkeypatch.setattr(bw, "NixlWrapper", recording(agent))
    connector = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.WORKER, kcfg)
    env.made.append(connector)
    return SimpleNamespace(caches=caches, group_id=group_id, page=spec.page_size_bytes, connector=connector,
                           worker=connector.connector_worker)


def _expected(engine: SimpleNamespace, layout: str) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Block descriptors (region by region, block by block) and registered ranges, from kvcached.layout."""
    group = vmm_ops.get_group(engine.group_id)
    per_page = group.geometry.page_size // engine.page
    spec = KVSpec(LAYERS, group.geometry.num_pages * per_page, BLOCK, 1, engine.page // BLOCK, torch.uint8, 1)
    geom = KVGeometry(spec, layout, group.geometry.page_size)
    rows, spans = [], []
    for layer in range(LAYERS):  # vLLM's region order is model-layer order, as kvcached's slots
        for block in range(N):
            tensor, offset = geom.block_byte_offset(layer, 0, block)
            start = group.tensors[tensor].data_ptr() + offset
            rows.append((start, spec.block_bytes, 0))
            spans.append((start, start + spec.block_bytes))
    merged: list[list[int]] = []  # the blocks' bytes, as disjoint ranges
    for start, end in sorted(spans):
        assert not merged or start >= merged[-1][1], "two blocks overlap"
        if merged and start == merged[-1][1]:
            merged[-1][1] = end
        else:
            merged.append([start, end])
    return np.array(rows, dtype=np.uint64), [(s, e - s) for s, e in merged]


@pytest.mark.parametrize("env", ["contiguous", "per_layer"], indirect=True)
def test_regions_and_descriptors_are_the_blocks_bytes(vllm_config, env) -> None:
    engine = _engine(vllm_config, env, NoNixl)
    engine.connector.register_kv_caches(engine.caches)
    agent = engine.worker.nixl_wrapper
    rows, ranges = _expected(engine, env.layout)
    # registered: exactly the bytes of vLLM's blocks, one range per kvcached tensor
    assert sorted(agent.registered) == ranges
    assert len(ranges) == (1 if env.layout == "contiguous" else LAYERS)
    # the local descriptors prepared at registration: every block of every layer
    np.testing.assert_array_equal(agent.block_descs[0], rows)
    np.testing.assert_array_equal(engine.worker.src_blocks_data, rows)
    # the connector keeps views of the same bytes as the engine's
    for name, view in engine.caches.items():
        kept = engine.worker.device_kv_caches[name]
        assert (kept.data_ptr(), kept.shape, kept.stride()) == (view.data_ptr(), view.shape, view.stride())


@pytest.mark.parametrize("env", ["contiguous", "per_layer"], indirect=True)
def test_kvcached_views_as_they_are_do_not_fit_the_connector(vllm_config, env) -> None:
    """Why the hook exists: without it vLLM refuses the contiguous layout and over-registers the per-layer one."""
    engine = _engine(vllm_config, env, NoNixl)
    unhooked = bw.NixlBaseConnectorWorker.register_kv_caches.__wrapped__
    if env.layout == "contiguous":
        with pytest.raises(AssertionError, match="cannot be partitioned"):
            unhooked(engine.worker, engine.caches)
        return
    unhooked(engine.worker, engine.caches)
    whole = vmm_ops.get_group(engine.group_id).geometry.tensor_bytes
    assert [n for _, n in engine.worker.nixl_wrapper.registered] == [whole] * LAYERS
    assert whole > N * engine.page


@pytest.mark.parametrize("env", ["contiguous"], indirect=True)
def test_transports_that_pin_pages_are_refused(vllm_config, env) -> None:
    env.monkeypatch.delenv("UCX_TLS")
    engine = _engine(vllm_config, env, NoNixl)
    with pytest.raises(KVCachedConfigError, match="UCX_TLS=unset"):
        engine.connector.register_kv_caches(engine.caches)
    assert engine.worker.nixl_wrapper.registered == []
    env.monkeypatch.setenv("KVCACHED_NIXL_ANY_TRANSPORT", "true")
    engine.connector.register_kv_caches(engine.caches)
    assert len(engine.worker.nixl_wrapper.registered) == 1


@pytest.mark.parametrize("env", ["contiguous"], indirect=True)
def test_connector_outside_the_tested_vllm_is_refused(vllm_config, env) -> None:
    import kvcached.integration.vllm.version as version

    env.monkeypatch.setattr(version, "installed_vllm_version", lambda: "0.31.0")
    with pytest.raises(KVCachedConfigError, match="vLLM 0.31.0"):
        _engine(vllm_config, env, NoNixl)


def _transfer(reader, src, pairs: list[tuple[int, int]]) -> None:
    """``reader`` READs ``src``'s blocks into its own, every layer: (src block, own block) pairs."""
    agent, remote = reader.worker.nixl_wrapper, src.worker.nixl_wrapper
    name = agent.add_remote_agent(remote.get_agent_metadata())
    rows = [(region * N + mine, region * N + theirs) for region in range(LAYERS) for theirs, mine in pairs]
    local = agent.get_xfer_descs(reader.worker.src_blocks_data[[r[0] for r in rows]], "DRAM")
    far = agent.get_xfer_descs(src.worker.src_blocks_data[[r[1] for r in rows]], "DRAM")
    handle = agent.initialize_xfer("READ", local, far, name)
    assert agent.transfer(handle) in ("PROC", "DONE")
    deadline = time.monotonic() + 20
    while (state := agent.check_xfer_state(handle)) == "PROC" and time.monotonic() < deadline:
        time.sleep(0.005)
    agent.release_xfer_handle(handle)
    assert state == "DONE"


@pytest.mark.parametrize("env", ["contiguous", "per_layer"], indirect=True)
def test_real_nixl_moves_blocks_mapped_after_registration(vllm_config, env) -> None:
    """Prefill and decode pools registered before any page is mapped; blocks allocated (pages mapped) after;
    the decode side READs with the connector's descriptors over UCX tcp/cma and gets exactly the blocks."""
    agent = _real_nixl()
    if agent is None:
        pytest.skip("NIXL is not installed (bash scripts/dev.sh setup puts nixl 1.5.1 in .venv-nixl)")
    prefill, decode = _engine(vllm_config, env, agent), _engine(vllm_config, env, agent)
    for side in (prefill, decode):
        side.connector.register_kv_caches(side.caches)
        side.pool = KVCacheManager(N, BLOCK, side.page // BLOCK, LAYERS, num_kv_buffers=1, group_id=side.group_id,
                                   reserve_null_block=True)
    sent, got = prefill.pool.alloc(5), decode.pool.alloc(6)
    pairs = list(zip(sent, reversed(got[:5]), strict=True))  # reversed: each block lands somewhere else
    gen = torch.Generator().manual_seed(0)
    for view in prefill.caches.values():
        view[sent] = torch.randn(view[sent].shape, generator=gen)
    _transfer(decode, prefill, pairs)
    for name in prefill.caches:
        for theirs, mine in pairs:
            assert torch.equal(decode.caches[name][mine], prefill.caches[name][theirs]), (name, theirs, mine)
        assert not decode.caches[name][got[5]].any()  # allocated, not transferred: still zero
    for side in (prefill, decode):
        side.pool.close()


@pytest.mark.slow
def test_engine_registers_kvcached_blocks_with_nixl(tiny_model: str) -> None:
    """A real engine (vLLM's CPU build) with ENABLE_KVCACHED and a NixlConnector: the plugin's hook gives NIXL
    vLLM's blocks in kvcached's default (contiguous) layout, and the engine generates."""
    if _real_nixl() is None:
        pytest.skip("NIXL is not installed (bash scripts/dev.sh setup puts nixl 1.5.1 in .venv-nixl)")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from harness import engine_env, run_engine
    from tiny_model import PROMPTS

    # 1027 MiB: each layer's share is not whole pages, so the virtual tensors (rounded up) hold more blocks than
    # vLLM plans (rounded down), as on a GPU; with a share of whole pages they would match and vLLM would accept them
    env = engine_env(ENABLE_KVCACHED="true", KVCACHED_IPC_NAME=f"kvcached_e2e_nixl_{os.getpid()}",
                     KVCACHED_HOST_MEM_LIMIT_MB="1027", UCX_TLS="tcp,cma,self")
    env["PYTHONPATH"] += os.pathsep + str(NIXL_OVERLAY)
    transfer = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    result = run_engine({"model": tiny_model, "prompts": PROMPTS, "max_tokens": 8,
                         "kv_transfer_config": transfer}, env)
    assert result["pool"] == "KVCachedBlockPool" and all(len(t) == 8 for t in result["tokens"])
    nixl, layers = result["nixl"], 2
    page = nixl["block_len"][0]
    assert nixl["block_len"] == [page] * layers and nixl["block_stride"] == [layers * page] * layers
    assert nixl["bases"] == [0, page]  # layer 1's page right after layer 0's, in every block
    assert nixl["registered"] == [nixl["num_blocks"] * layers * page]  # one range: exactly vLLM's blocks

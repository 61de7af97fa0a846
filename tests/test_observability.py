"""Snapshots (kvcached.observability) and Prometheus metrics (kvcached.metrics, kvctl serve-metrics)."""

from __future__ import annotations

import gc
import importlib.util
import json
import subprocess
import sys
import urllib.request

import pytest

from kvcached import metrics, observability, pool_registry, vmm_ops
from kvcached.errors import KVCachedConfigError
from kvcached.kv_cache_manager import KVCacheManager

MiB = 1 << 20
GROUP = 8 * MiB  # 2 layers x K, V x 2 MiB
BPP = 512  # blocks of 16 tokens x 256 B per 2 MiB page


@pytest.fixture
def env(exact_pool_env: str):
    name = exact_pool_env
    pool_registry.clear_registered_kv_cache_pools()
    yield name
    from kvcached import mem_info
    from kvcached.integration.sglang import interfaces as sg
    from kvcached.integration.vllm import interfaces as vi

    vi.shutdown_kvcached()
    sg.shutdown_kvcached()
    if vmm_ops.is_initialized():
        vmm_ops.shutdown_kvcached()
    mem_info.stop_publisher()
    mem_info.delete_segment(name)
    pool_registry.clear_registered_kv_cache_pools()


def _manager(pages: int = 4) -> KVCacheManager:
    vmm_ops.init_kvcached("cpu", contiguous_layout=False)
    vmm_ops.create_kv_tensors(pages * 4 * MiB, 2, "cpu", 2)
    return KVCacheManager(pages * BPP, 16, 256, 2, reserve_null_block=True, pool_name="main")


def test_capabilities_name_the_schema_and_every_field() -> None:
    caps = json.loads(json.dumps(observability.get_capabilities()))
    assert caps["schema_version"] == observability.SCHEMA_VERSION == "kvcached.observability.v1"
    assert caps["features"]["memory_limit_control"] and caps["features"]["prometheus_metrics"]
    assert "mapped_bytes" in caps["pool_snapshot_fields"] and "pages_mapped_total" in caps["pool_snapshot_fields"]


def test_a_pool_snapshot_follows_the_pool(env) -> None:
    m = _manager()
    blocks = m.alloc(BPP + 10)  # pages 0 and 1 (block 0 is the null block)
    assert m.try_to_reserve(5)
    snap = m.observability_snapshot_dict(integration="test")
    json.dumps(snap)
    assert snap["integration"] == "test" and snap["pool_name"] == "main" and snap["null_block_reserved"]
    assert (snap["allocated_blocks"], snap["reserved_blocks"]) == (BPP + 16, 5)
    assert snap["allocated_bytes"] == (BPP + 16) * 4096 * 4 and snap["block_size_bytes"] == 4096
    assert (snap["total_pages"], snap["inuse_pages"], snap["reserved_pages"]) == (4, 2, 0)
    assert snap["mapped_bytes"] == 2 * GROUP and snap["pages_mapped_total"] == 2 and snap["peak_inuse_pages"] == 2
    assert snap["virtual_per_layer_bytes"] == 4 * BPP * 4096 * 2 and not snap["in_shrink"]
    m.free_reserved()
    m.free(blocks)
    after = m.observability_snapshot_dict()
    assert after["inuse_pages"] == 1 and after["pages_unmapped_total"] == 1 and after["peak_inuse_pages"] == 2


def test_a_pool_not_bound_yet_is_described_without_waiting(env) -> None:
    vmm_ops.init_kvcached("cpu", contiguous_layout=False)
    m = KVCacheManager(BPP, 16, 256, 2, group_id=3)  # its KV tensors do not exist yet
    snap = m.observability_snapshot_dict()
    assert snap["total_pages"] is None and snap["allocated_blocks"] == 0 and snap["mapped_bytes"] == 0


def test_integrations_tag_their_pools_and_shutdown_forgets_them(env) -> None:
    import torch

    from kvcached.integration.vllm import interfaces as vi

    vi.init_kvcached(device="cpu", contiguous_layout=False)
    vi.alloc_kv_cache((2, 4 * BPP, 16, 2, 64), 16, torch.float16, "cpu", 2)
    m = vi.get_kv_cache_manager(4 * BPP, 16, 256, 2, pool_name="unified")
    snaps = vi.kv_cache_pool_snapshot_dicts()
    assert [(s["integration"], s["pool_name"]) for s in snaps] == [("vllm", "unified")]
    assert observability.get_registered_kv_cache_pool_snapshot_dicts(integration="sglang") == []
    assert observability.runtime_snapshot("vllm").to_dict()["initialized"] is True
    vi.shutdown_kvcached()
    assert vi.kv_cache_pool_snapshot_dicts() == [] and m is not None


def test_the_registry_does_not_keep_a_pool_alive(env) -> None:
    m = _manager()
    assert [x for x, _ in pool_registry.get_registered_kv_cache_pools()] == [m]
    m.close()
    assert pool_registry.get_registered_kv_cache_pools() == []
    vmm_ops.init_kvcached("cpu") if not vmm_ops.is_initialized() else None
    other = KVCacheManager(BPP, 16, 256, 2, group_id=5)
    del other
    gc.collect()
    assert pool_registry.get_registered_kv_cache_pools() == []


# -- Prometheus (prometheus_client is optional: scripts/dev.sh installs it) --------
needs_prometheus = pytest.mark.skipif(importlib.util.find_spec("prometheus_client") is None,
                                      reason="prometheus_client is not installed (pip install prometheus-client)")


def _scrape(collector: metrics.SegmentCollector) -> dict[tuple[str, str], float]:
    return {(s.name, s.labels["name"]): s.value for family in collector.collect() for s in family.samples}


@needs_prometheus
def test_the_collector_reports_each_instance(env) -> None:
    from kvcached import mem_info

    m = _manager()
    blocks = m.alloc(BPP + 10)
    m.free(blocks)
    mem_info.publisher().tick()
    got = _scrape(metrics.SegmentCollector([env]))
    assert got[("kvcached_in_use_bytes", env)] == GROUP  # the null block's page
    assert got[("kvcached_peak_bytes", env)] == 2 * GROUP
    assert got[("kvcached_limit_bytes", env)] == 4 * GROUP  # no limit: the capacity
    assert got[("kvcached_pages_mapped_total", env)] == 2 and got[("kvcached_pages_unmapped_total", env)] == 1
    assert got[("kvcached_up", env)] == 1 and got[("kvcached_limit_revision", env)] == -1


@needs_prometheus
def test_serve_answers_a_scrape_over_http(env) -> None:
    m = _manager()  # kept: the segment shows live pools only
    m.alloc(3)
    from kvcached import mem_info

    mem_info.publisher().tick()
    server = metrics.serve(0, names=[env])
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=10).read().decode()
    finally:
        server.shutdown()
    line = next(x for x in text.splitlines() if x.startswith(f'kvcached_mapped_bytes{{name="{env}"}} '))
    assert float(line.split()[-1]) == GROUP


@needs_prometheus
def test_kvctl_serve_metrics_runs_until_stopped(env) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "kvcached.cli.kvctl", "serve-metrics", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "serving kvcached metrics on http://127.0.0.1:" in line, proc.stderr.read() if not line else line
        text = urllib.request.urlopen(line.split(" on ")[1].strip(), timeout=10).read().decode()
        assert "# TYPE kvcached_in_use_bytes gauge" in text
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_without_prometheus_client_the_error_names_the_package(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from kvcached.cli import kvctl

    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(KVCachedConfigError, match="pip install prometheus-client"):
        metrics.serve(0)
    assert kvctl.main(["serve-metrics", "--port", "0"]) == 2
    assert "prometheus_client" in capsys.readouterr().err
    assert metrics.register_engine_collector() is False


def test_a_bad_port_is_refused(capsys) -> None:
    with pytest.raises(ValueError, match="port must be"):
        metrics.serve(70000)


@needs_prometheus
def test_the_engine_collector_joins_vllms_registry(env, monkeypatch: pytest.MonkeyPatch) -> None:
    import prometheus_client

    from kvcached import mem_info

    m = _manager()  # kept: the segment shows live pools only
    m.alloc(3)
    mem_info.publisher().tick()
    monkeypatch.setattr(metrics, "_engine_registered", False)
    registered = []
    monkeypatch.setattr(prometheus_client.REGISTRY, "register", registered.append)
    assert metrics.register_engine_collector() and metrics.register_engine_collector()
    assert len(registered) == 1  # once per process
    assert ("kvcached_in_use_bytes", env) in _scrape(registered[0])

"""Revisioned memory limits (kvcached.control, KVCacheManager.set_memory_limit) on the host backend.

Geometry: 2 layers, blocks of 16 tokens x 256 B = 4 KiB, 512 blocks a 2 MiB page, so a
page group (one page of every layer, K and V) is 8 MiB. No reserve: mapped = in use.
"""

from __future__ import annotations

import json
import time

import pytest

from kvcached import control, mem_info, pool_registry, vmm_ops
from kvcached.cli import kvctl
from kvcached.kv_cache_manager import KVCacheManager

MiB = 1 << 20
GROUP = 8 * MiB  # one page group
BPP = 512


@pytest.fixture
def pools(monkeypatch: pytest.MonkeyPatch, exact_pool_env: str):
    """``make(pages, group_id=0)`` -> a manager over its own KV tensors (a fresh runtime per test)."""
    monkeypatch.setenv("KVCACHED_HOST_MEM_LIMIT_MB", "512")
    pool_registry.clear_registered_kv_cache_pools()
    vmm_ops.init_kvcached("cpu", contiguous_layout=False)

    def make(pages: int, group_id: int = 0, name: str | None = None) -> KVCacheManager:
        vmm_ops.create_kv_tensors(pages * 2 * 2 * MiB, 2, "cpu", 2, group_id=group_id)
        return KVCacheManager(pages * BPP, 16, 256, 2, group_id=group_id, pool_name=name)

    yield make
    name = mem_info.publisher().name if mem_info.publisher() else None
    vmm_ops.shutdown_kvcached()
    mem_info.stop_publisher()
    if name:
        mem_info.delete_segment(name)
    pool_registry.clear_registered_kv_cache_pools()


def test_an_idle_pool_takes_its_limit_at_once_in_whole_page_groups(pools) -> None:
    m = pools(8)
    m.alloc(BPP + 1)  # two pages
    state = m.set_memory_limit(3 * GROUP + 123, revision=7)
    assert state["status"] == "applied" and state["reason"] == ""
    assert (state["limit_bytes"], state["effective_limit_bytes"]) == (3 * GROUP + 123, 3 * GROUP)
    assert state["current_capacity_bytes"] == 3 * GROUP and state["revision"] == 7
    assert state["mapped_bytes"] == 2 * GROUP and state["remaining_bytes"] == GROUP
    assert m.limit_pages == 3
    assert m.alloc(2 * BPP) is None  # a fourth page is past the limit
    assert m.memory_limit_state() == state


def test_a_limit_below_use_defers_takes_nothing_and_converges_as_blocks_are_freed(pools) -> None:
    m = pools(8)
    blocks = [b for _ in range(4) for b in m.alloc(BPP)]  # page by page: each page a run of its own
    state = m.set_memory_limit(2 * GROUP, revision=1)
    assert state["status"] == "deferred" and state["reason"] == "inuse_capacity_above_limit"
    assert state["mapped_bytes"] == 4 * GROUP and state["overage_bytes"] == 2 * GROUP
    assert m.in_shrink and m.num_allocated_blocks() == 4 * BPP  # every block still held
    assert m.alloc(1) is None  # no new page while over
    m.free(blocks[: 2 * BPP])
    assert m.memory_limit_state()["status"] == "applied" and not m.in_shrink
    again = m.set_memory_limit(2 * GROUP, revision=1)  # the same decision again: its state now
    assert again["status"] == "applied" and again["overage_bytes"] == 0


def test_a_limit_counts_as_met_only_once_the_memory_is_unmapped(pools) -> None:
    m = pools(8)
    blocks = m.alloc(4 * BPP)  # one map call: the four pages are one run, unmapped only together
    m.set_memory_limit(2 * GROUP, revision=1)
    m.free(blocks[: 2 * BPP])
    state = m.memory_limit_state()
    assert not m.in_shrink and state["status"] == "deferred" and state["overage_bytes"] == 2 * GROUP
    m.free(blocks[2 * BPP:])
    assert m.memory_limit_state()["status"] == "applied" and m.mapped_bytes == 0


def test_a_limit_regrows_is_clamped_to_the_pool_and_zero_drains_it(pools) -> None:
    m = pools(8)
    m.set_memory_limit(3 * GROUP, revision=1)
    assert m.set_memory_limit(6 * GROUP, revision=2)["effective_limit_bytes"] == 6 * GROUP and m.limit_pages == 6
    assert m.set_memory_limit(32 * GROUP, revision=3)["effective_limit_bytes"] == 8 * GROUP
    state = m.set_memory_limit(0, revision=4)
    assert state["status"] == "applied" and state["effective_limit_bytes"] == 0 and m.limit_pages == 0
    assert m.alloc(1) is None
    lifted = m.set_memory_limit(None, revision=5)
    assert lifted["effective_limit_bytes"] is None and m.limit_pages == 8 and m.alloc(1) is not None


def test_an_older_revision_is_stale_and_a_reused_one_with_another_limit_conflicts(pools) -> None:
    m = pools(8)
    first = m.set_memory_limit(4 * GROUP, revision=9)
    assert m.set_memory_limit(4 * GROUP, revision=9) == first
    conflict = m.set_memory_limit(3 * GROUP, revision=9)
    stale = m.set_memory_limit(2 * GROUP, revision=8)
    assert conflict["status"] == "conflict" and conflict["reason"] == "revision_reused_with_different_limit"
    assert stale["status"] == "stale" and stale["revision"] == 9
    assert m.limit_pages == 4 and m.memory_limit_state()["limit_bytes"] == 4 * GROUP


def test_an_instance_limit_is_split_by_capacity_and_kvctl_shows_it(pools, capsys) -> None:
    big, small = pools(6, 0, "big"), pools(2, 1, "small")
    result = control.set_instance_memory_limit(4 * GROUP, revision=3)
    assert result["status"] == "applied" and result["revision"] == 3
    by_name = {p["pool_name"]: p for p in result["pools"]}
    assert by_name["big"]["effective_limit_bytes"] == 3 * GROUP and by_name["small"]["effective_limit_bytes"] == GROUP
    assert (big.limit_pages, small.limit_pages) == (3, 1) and result["effective_limit_bytes"] == 4 * GROUP
    name = mem_info.publisher().name
    info = mem_info.read_segment(name)
    assert (info.limit, info.limit_revision, info.applied_revision) == (4 * GROUP, 3, 3)
    assert {p["pool_name"]: p["effective_limit_bytes"] for p in info.pools} == {"big": 3 * GROUP, "small": GROUP}
    assert kvctl.main(["--json", "list", name]) == 0
    assert json.loads(capsys.readouterr().out)[0]["limit_revision"] == 3
    # a stale controller is refused by the segment and changes nothing
    stale = control.set_instance_memory_limit(GROUP, revision=2)
    assert stale["status"] == "stale" and stale["revision"] == 3 and big.limit_pages == 3
    assert control.set_instance_memory_limit(GROUP, revision=3)["status"] == "conflict"
    # a manual kvctl limit is the next revision: the controller's view is then stale
    assert kvctl.main(["limit", name, "16M"]) == 0
    assert mem_info.read_segment(name).limit_revision == 4
    assert control.set_instance_memory_limit(GROUP, revision=4)["status"] == "conflict"
    assert control.instance_memory_limit_state(name)["revision"] == 4


def test_another_process_sets_a_limit_through_the_segment(pools, monkeypatch: pytest.MonkeyPatch) -> None:
    m = pools(4)
    m.alloc(3 * BPP)
    name = mem_info.publisher().name
    result = control.set_instance_memory_limit(2 * GROUP, revision=1, name=name, timeout=5)
    assert result["status"] == "deferred" and result["name"] == name  # applied by the engine's monitor thread
    assert [p["status"] for p in result["pools"]] == ["deferred"] and m.limit_pages == 2
    assert control.set_instance_memory_limit(GROUP, revision=0, name=name)["status"] == "stale"
    assert control.set_instance_memory_limit(3 * GROUP, revision=1, name=name)["status"] == "conflict"
    assert control.set_instance_memory_limit(None, revision=2, name=name, timeout=5)["status"] == "applied"
    assert m.limit_pages == 4


def test_a_segment_no_engine_serves_reports_pending(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mem_info, "SHM_DIR", str(tmp_path))
    with mem_info._Writer(mem_info.segment_path("kvcached_orphan"), create=True):
        pass
    t0 = time.monotonic()
    result = control.set_instance_memory_limit(GROUP, revision=5, name="kvcached_orphan", timeout=0.05)
    assert result["status"] == "pending" and time.monotonic() - t0 < 1
    assert mem_info.read_segment("kvcached_orphan").limit == GROUP


def test_no_live_pool_is_unavailable() -> None:
    pool_registry.clear_registered_kv_cache_pools()
    result = control.set_instance_memory_limit(GROUP, revision=1)
    assert result["status"] == "unavailable" and result["reason"] == "no_registered_kv_cache_pool"
    assert result["pools"] == []


@pytest.mark.parametrize("limit,revision,match", [(-1, 1, "limit_bytes"), (1.5, 1, "limit_bytes"),
                                                  (True, 1, "limit_bytes"), (1 << 63, 1, "too large"),
                                                  (GROUP, -1, "revision"), (GROUP, True, "revision"),
                                                  (GROUP, "3", "revision")])
def test_bad_arguments_are_refused(limit, revision, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        control.set_instance_memory_limit(limit, revision=revision)


def test_kvctl_limit_with_a_revision(pools, capsys) -> None:
    m = pools(4)
    name = mem_info.publisher().name
    assert kvctl.main(["--json", "limit", name, "16M", "--revision", "5"]) == 0
    reply = json.loads(capsys.readouterr().out)
    assert reply["ok"] and reply["status"] == "applied" and reply["revision"] == 5 and m.limit_pages == 2
    assert kvctl.main(["limit", name, "8M", "--revision", "4"]) == 1
    assert "revision 4: stale (it holds revision 5)" in capsys.readouterr().out
    assert m.limit_pages == 2

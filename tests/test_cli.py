"""kvctl and kvtop against a live segment (and against none)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest

from kvcached import mem_info, vmm_ops
from kvcached.cli import kvctl, kvtop
from kvcached.kv_cache_manager import KVCacheManager
from kvcached.utils import parse_size

MiB = 1 << 20


@pytest.fixture
def live(monkeypatch: pytest.MonkeyPatch):
    name = f"kvcached_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("KVCACHED_IPC_NAME", name)
    vmm_ops.init_kvcached("cpu", contiguous_layout=False)
    vmm_ops.create_kv_tensors(4 * 2 * 2 * MiB, 2, "cpu", 2)
    m = KVCacheManager(4 * 512, 16, 256, 2)
    m.alloc(600)  # two pages
    end = time.monotonic() + 2
    while mem_info.read_segment(name).used_size != 2 * 8 * MiB and time.monotonic() < end:
        time.sleep(0.01)
    yield name, m
    vmm_ops.shutdown_kvcached()
    mem_info.delete_segment(name)


@pytest.mark.parametrize(
    "text,value",
    [("2G", 2 << 30), ("512M", 512 << 20), ("1.5GiB", 3 << 29), ("1048576", 1 << 20), ("64 kb", 64 << 10),
     ("0", 0), ("1_000", 1000)],
)
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "G", "12X", "-1G", "abc", "1.2.3M", "nan", "inf"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_list_table_and_json(live, capsys: pytest.CaptureFixture[str]) -> None:
    name, _ = live
    assert kvctl.main(["list"]) == 0
    out = capsys.readouterr().out
    line = next(row for row in out.splitlines() if row.startswith(name))
    assert "16.0 MiB" in line and "per_layer" in line and "none" in line
    assert kvctl.main(["list", name, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["name"] == name and rows[0]["used_size"] == 16 * MiB and rows[0]["alive"] is True
    assert rows[0]["pid"] == os.getpid()


def test_limit_and_limit_percent(live, capsys: pytest.CaptureFixture[str]) -> None:
    name, m = live
    assert kvctl.main(["--json", "limit", name, "24M"]) == 0
    reply = json.loads(capsys.readouterr().out)
    assert reply["ok"] and reply["limit"] == 24 * MiB
    end = time.monotonic() + 1
    while m.limit_pages != 3 and time.monotonic() < end:
        time.sleep(0.01)
    assert m.limit_pages == 3
    assert kvctl.main(["limit", name, "8M"]) == 0
    assert "shrinks as blocks are freed" in capsys.readouterr().out  # 16 MiB in use > 8 MiB
    assert kvctl.main(["limit-percent", name, "50"]) == 0
    info = mem_info.read_segment(name)
    assert info.limit == info.device_total // 2
    assert kvctl.main(["limit", name, "none"]) == 0  # lifted: the pool may grow to its whole size again
    assert "limit lifted" in capsys.readouterr().out
    assert mem_info.read_segment(name).limit == mem_info.NO_LIMIT
    end = time.monotonic() + 1
    while m.limit_pages != m.num_pages and time.monotonic() < end:
        time.sleep(0.01)
    assert m.limit_pages == m.num_pages


def test_errors_exit_nonzero(live, capsys: pytest.CaptureFixture[str]) -> None:
    name, _ = live
    assert kvctl.main(["limit", "kvcached_nope", "1G"]) == 1
    assert "no kvcached instance named 'kvcached_nope'" in capsys.readouterr().err
    assert kvctl.main(["limit", name, "lots"]) == 2
    assert "cannot read 'lots' as a size" in capsys.readouterr().err
    assert kvctl.main(["limit-percent", name, "150"]) == 2
    assert kvctl.main(["delete", "kvcached_nope"]) == 1
    with pytest.raises(SystemExit):
        kvctl.main(["frobnicate"])


def test_watch_frames_and_delete(live, capsys: pytest.CaptureFixture[str]) -> None:
    name, _ = live
    assert kvctl.main(["watch", "-n", "0.01", "--count", "2", "--json", name]) == 0
    frames = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.strip()]
    assert len(frames) == 2 and frames[0][0]["name"] == name
    assert kvctl.main(["delete", name]) == 0
    assert not os.path.exists(mem_info.segment_path(name))
    # the live engine recreates it within its next period
    end = time.monotonic() + 2
    while not os.path.exists(mem_info.segment_path(name)) and time.monotonic() < end:
        time.sleep(0.01)
    assert os.path.exists(mem_info.segment_path(name))


def test_kvtop_once(live) -> None:
    name, _ = live
    frame = kvtop.render([name])
    assert name in frame and "used 16.0 MiB" in frame and "alive" in frame
    out = subprocess.run([sys.executable, "-m", "kvcached.cli.kvtop", "--once", name], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and name in out.stdout and "#" in out.stdout


def test_no_instances(monkeypatch: pytest.MonkeyPatch, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(mem_info, "SHM_DIR", str(tmp_path))
    assert mem_info.list_segments() == []
    assert kvctl.main(["list"]) == 0
    assert "No kvcached instances found." in capsys.readouterr().out
    assert "No kvcached instances found." in kvtop.render()


def test_kvcached_command_dispatch() -> None:
    from kvcached.__main__ import main

    assert main(["--help"]) == 0
    assert main(["bogus"]) == 2
    assert main(["ctl", "list", "--json"]) == 0


# -- names: kvctl touches nothing outside /dev/shm ------------------------------
def test_delete_of_a_path_outside_shm_is_refused_and_deletes_nothing(live, tmp_path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    name, _ = live
    victim = tmp_path / name  # same base name as the live segment
    victim.write_bytes(b"precious")
    assert kvctl.main(["delete", str(victim)]) == 2
    err = capsys.readouterr().err
    assert "not a path" in err and name in err, err
    out = subprocess.run([sys.executable, "-m", "kvcached.cli.kvctl", "delete", str(victim)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "not a path" in out.stderr, out.stderr
    assert victim.read_bytes() == b"precious"
    assert os.path.exists(mem_info.segment_path(name)), "the live segment must not be deleted either"


@pytest.mark.parametrize("bad", ["/abs/kvcached_x", "/dev/shm/kvcached_x", "../kvcached_x", "kvcached_x/..", ".",
                                 "..", "kvcached..x", "", "kvcached_\0x", "k" * 300])
@pytest.mark.parametrize("command", [["delete"], ["limit", "1G"], ["limit-percent", "10"], ["list"],
                                     ["watch", "--count", "1"]])
def test_commands_refuse_names_that_are_not_plain_file_names(bad: str, command: list[str],
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    argv = [command[0], bad, *command[1:]] if command[0] in ("delete", "limit", "limit-percent") else [*command, bad]
    assert kvctl.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvctl: segment name") and "kvctl list" in err, err


def test_a_file_that_is_not_a_segment_is_an_error_not_a_traceback(tmp_path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(mem_info, "SHM_DIR", str(tmp_path))
    (tmp_path / "kvcached_other").write_bytes(b"x" * 8216)
    for argv in (["delete", "kvcached_other"], ["limit", "kvcached_other", "1G"],
                 ["limit-percent", "kvcached_other", "5"]):
        assert kvctl.main(argv) == 1
        err = capsys.readouterr().err
        assert "not a kvcached segment" in err, err
    assert (tmp_path / "kvcached_other").read_bytes() == b"x" * 8216

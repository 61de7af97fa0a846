"""/dev/shm segments and the CLI against hostile or careless input (issue 35, D1-D4, D6, D9).

Segments are made in a temporary SHM_DIR with the module's own writer, then damaged by
hand as a dead writer or another local user would.
"""

from __future__ import annotations

import json
import os
import stat
import struct
import time

import pytest

from kvcached import mem_info
from kvcached.cli import kvctl, kvtop
from kvcached.errors import KVCachedConfigError

MiB = 1 << 20


@pytest.fixture
def shm(tmp_path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(mem_info, "SHM_DIR", str(tmp_path))
    return tmp_path


def make_segment(name: str, pid: int | None = None, used: int = 3 * MiB) -> str:
    """A segment as an engine publishes it (pid: this process unless given)."""
    path = mem_info.segment_path(name)
    with mem_info._Writer(path, create=True) as w:
        now = time.time_ns()
        w.write([(mem_info._BODY_OFF, mem_info._BODY.format,
                  (mem_info.NO_LIMIT, used, 0, 64 * MiB, 128 * MiB, os.getpid() if pid is None else pid, now, 0,
                   b"per_layer", b"cpu", used, now, now))])
    return path


def seq_of(name: str) -> int:
    with open(mem_info.segment_path(name), "rb") as f:
        f.seek(mem_info._SEQ_OFF)
        return struct.unpack("<Q", f.read(8))[0]


def set_seq(name: str, value: int) -> None:
    fd = os.open(mem_info.segment_path(name), os.O_RDWR)
    try:
        os.pwrite(fd, struct.pack("<Q", value), mem_info._SEQ_OFF)
    finally:
        os.close(fd)


# -- D1: a limit past 64 bits ---------------------------------------------------
@pytest.mark.parametrize("size", ["1e30", "9223372036854775808", "99999999999999999999G"])
@pytest.mark.parametrize("json_out", [False, True])
def test_a_limit_past_64_bits_is_refused_and_leaves_the_segment_intact(shm, size: str, json_out: bool,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    make_segment("kvcached_big")
    before = seq_of("kvcached_big")
    argv = (["--json"] if json_out else []) + ["limit", "kvcached_big", size]
    assert kvctl.main(argv) == 2
    out, err = capsys.readouterr()
    assert "too large" in err and "kvctl limit" not in out, err
    if json_out:
        reply = json.loads(out)
        assert reply["ok"] is False and "too large" in reply["error"]
    assert seq_of("kvcached_big") == before  # not left odd, nothing written
    assert mem_info.read_segment("kvcached_big").limit == mem_info.NO_LIMIT


def test_write_limit_refuses_a_value_past_64_bits(shm) -> None:
    make_segment("kvcached_big")
    with pytest.raises(ValueError, match="too large"):
        mem_info.write_limit("kvcached_big", 1 << 63)
    assert seq_of("kvcached_big") % 2 == 0


# -- D2: a writer died mid-write -------------------------------------------------
def test_a_segment_left_mid_write_is_shown_damaged_and_can_be_deleted(shm, capsys: pytest.CaptureFixture[str]) -> None:
    make_segment("kvcached_ok")
    make_segment("kvcached_torn", pid=1 << 22)
    set_seq("kvcached_torn", seq_of("kvcached_torn") + 1)  # odd: its writer died mid-write
    t0 = time.monotonic()
    assert kvctl.main(["list"]) == 0
    assert time.monotonic() - t0 < 1.0, "a dead writer's segment is recognised without a long wait"
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert set(rows) == {"kvcached_ok", "kvcached_torn"}, out
    assert "damaged" in rows["kvcached_torn"] and "damaged" not in rows["kvcached_ok"]
    assert kvctl.main(["--json", "list"]) == 0
    by_name = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert by_name["kvcached_torn"]["damaged"] is True and by_name["kvcached_ok"]["damaged"] is False
    assert kvctl.main(["list", "kvcached_torn"]) == 0
    assert "damaged" in capsys.readouterr().out
    assert "damaged" in kvtop.render(["kvcached_torn"])
    assert kvctl.main(["delete", "kvcached_torn"]) == 0
    assert not os.path.exists(mem_info.segment_path("kvcached_torn"))
    assert mem_info.list_segments() == ["kvcached_ok"]


def test_a_limit_written_to_a_damaged_segment_repairs_it(shm, capsys: pytest.CaptureFixture[str]) -> None:
    make_segment("kvcached_torn", pid=1 << 22)
    set_seq("kvcached_torn", seq_of("kvcached_torn") + 1)
    assert kvctl.main(["limit", "kvcached_torn", "8M"]) == 0
    assert seq_of("kvcached_torn") % 2 == 0
    info = mem_info.read_segment("kvcached_torn")
    assert info.limit == 8 * MiB and not info.damaged


# -- D3: a pid no process can have ------------------------------------------------
@pytest.mark.parametrize("pid", [1 << 31, 1 << 40, (1 << 63) - 1])
def test_a_segment_with_an_impossible_pid_does_not_break_the_listing(shm, pid: int,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    make_segment("kvcached_a_ok")
    make_segment("kvcached_b_odd_pid", pid=pid)
    assert mem_info.pid_alive(pid) is False
    assert kvctl.main(["list"]) == 0
    out = capsys.readouterr().out
    assert "kvcached_a_ok" in out and "kvcached_b_odd_pid" in out and "(dead)" in out
    assert kvctl.main(["--json", "list"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == ["kvcached_a_ok", "kvcached_b_odd_pid"]
    assert rows[1]["alive"] is False and rows[0]["alive"] is True
    frame = kvtop.render()
    assert "kvcached_a_ok" in frame and "kvcached_b_odd_pid" in frame and "DEAD" in frame


# -- D4: segments are private to their owner whatever the umask -------------------------
def test_segments_are_created_owner_only_under_any_umask(shm, monkeypatch: pytest.MonkeyPatch) -> None:
    old = os.umask(0)
    try:
        make_segment("kvcached_mine")
        pub = mem_info.Publisher("kvcached_engine")
        mode = stat.S_IMODE(os.stat(mem_info.segment_path("kvcached_engine")).st_mode)
        pub.stop()
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(mem_info.segment_path("kvcached_mine")).st_mode) == 0o600
    assert mode == 0o600


def test_an_engine_tightens_a_segment_left_world_writable(shm) -> None:
    path = make_segment("kvcached_engine", pid=0)
    os.chmod(path, 0o666)  # made by an older kvcached, or by hand
    pub = mem_info.Publisher("kvcached_engine")
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    finally:
        pub.stop()


# -- D6: refresh intervals ----------------------------------------------------------
@pytest.mark.parametrize("value", ["-1", "nan", "inf", "0"])
def test_watch_and_kvtop_refuse_an_interval_that_is_not_a_positive_number(shm, value: str,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        kvctl.main(["watch", "-n", value, "--count", "2"])
    assert exc.value.code == 2
    assert "positive" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        kvtop.main(["-r", value])
    assert exc.value.code == 2
    assert "positive" in capsys.readouterr().err
    with pytest.raises(ValueError, match="positive"):
        kvctl.cmd_watch(float(value), None, count=2)
    with pytest.raises(ValueError, match="positive"):
        kvtop.kvtop(None, float(value))


# -- D9: KVCACHED_IPC_NAME is used as given or refused ------------------------------------
@pytest.mark.parametrize("name", ["kvcached_a/b", "kvcached a", "kvcached_é", "kvcached_" + "x" * 92, "../x"])
def test_an_ipc_name_that_cannot_be_used_as_given_is_refused(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setenv("KVCACHED_IPC_NAME", name)
    with pytest.raises(KVCachedConfigError, match="KVCACHED_IPC_NAME"):
        mem_info.get_default_ipc_name()


def test_an_ipc_name_of_100_plain_characters_is_used_as_given(monkeypatch: pytest.MonkeyPatch) -> None:
    name = "kvcached_" + "x" * 91
    monkeypatch.setenv("KVCACHED_IPC_NAME", name)
    assert mem_info.get_default_ipc_name() == name


def test_a_segment_stuck_under_a_live_writer_is_reported_and_the_others_listed(
        shm, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import fcntl

    monkeypatch.setattr(mem_info, "_READ_TIMEOUT_S", 0.05)
    make_segment("kvcached_a_ok")
    make_segment("kvcached_b_stuck")
    set_seq("kvcached_b_stuck", seq_of("kvcached_b_stuck") + 1)
    fd = os.open(mem_info.segment_path("kvcached_b_stuck"), os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a writer that is alive but stuck mid-write
    try:
        assert kvctl.main(["list", "kvcached_a_ok", "kvcached_b_stuck"]) == 0
        out, err = capsys.readouterr()
        assert "kvcached_a_ok" in out and "kvcached_b_stuck" not in out
        assert "kvcached_b_stuck stayed mid-write" in err
        assert kvctl.main(["--json", "peak", "kvcached_b_stuck"]) == 1
        assert json.loads(capsys.readouterr().out)["ok"] is False
        assert "stayed mid-write" in kvtop.render(["kvcached_a_ok", "kvcached_b_stuck"])
    finally:
        os.close(fd)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file another user owns needs root")
def test_an_engine_refuses_a_segment_another_user_made(shm, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcached.errors import KVCachedStateError

    path = make_segment("kvcached_planted", pid=0)
    os.chown(path, 65534, 65534)  # planted by another local user, who could then set our limit
    with pytest.raises(KVCachedStateError, match="belongs to user id 65534"):
        mem_info.Publisher("kvcached_planted")
    assert mem_info._segment_taken("kvcached_planted")  # a default name moves on to the next suffix

"""The /dev/shm segment: contents, torn-read safety, clean-up, and limits set by kvctl
from another process taking effect in a running pool within a second."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
import uuid

import pytest

from kvcached import mem_info, vmm_ops
from kvcached.cli import utils as cli_utils
from kvcached.kv_cache_manager import KVCacheManager

MiB = 1 << 20
LAYERS = 2
BS, CELL = 16, 2 * 64 * 2  # 4 KiB blocks: 512 per 2 MiB page
GROUP = LAYERS * 2 * 2 * MiB  # bytes behind one page index


@pytest.fixture
def name(monkeypatch: pytest.MonkeyPatch):
    n = f"kvcached_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("KVCACHED_IPC_NAME", n)
    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "1")
    monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", "2")
    yield n
    if vmm_ops.is_initialized():
        vmm_ops.shutdown_kvcached()
    mem_info.delete_segment(n)


def _pool(pages: int = 8, contiguous: bool = True) -> KVCacheManager:
    vmm_ops.init_kvcached("cpu", contiguous_layout=contiguous)
    vmm_ops.create_kv_tensors(pages * 2 * 2 * MiB, 2, "cpu", LAYERS)
    return KVCacheManager(pages * 512, BS, CELL, LAYERS)


def _wait(cond, timeout: float) -> float | None:
    """Seconds until cond() held, or None if it did not within timeout."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return time.monotonic() - t0
        time.sleep(0.01)
    return None


def _kvctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvcached.cli.kvctl", *args], capture_output=True, text=True,
                          timeout=60)


def test_segment_publishes_usage_and_is_removed_at_shutdown(name: str) -> None:
    m = _pool()
    blocks = m.alloc(512 * 3)  # three pages
    assert blocks is not None
    assert _wait(lambda: mem_info.read_segment(name).used_size == 3 * GROUP, 2.0) is not None
    info = mem_info.read_segment(name)
    assert info.pid == os.getpid()
    assert info.capacity == 8 * GROUP
    assert info.limit == mem_info.NO_LIMIT and info.total_size == info.capacity
    assert info.layout == "contiguous" and info.device == "cpu"
    assert info.device_total > 0
    assert info.prealloc_size == m.page_allocator.num_reserved * GROUP or info.prealloc_size >= 0
    assert name in mem_info.list_segments()
    vmm_ops.shutdown_kvcached()
    assert not os.path.exists(mem_info.segment_path(name))


@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous_page_by_page", "per_layer_runs"])
def test_kvctl_limit_from_another_process_shrinks_and_regrows(name: str, contiguous: bool) -> None:
    m = _pool(8, contiguous)
    rt = vmm_ops.runtime()
    runs = vmm_ops.page_runs(rt.backend, rt.layout) != vmm_ops.PAGE_BY_PAGE
    assert runs == (not contiguous)
    if runs:  # the prealloc thread maps page 0 first, so the six pages below are runs [0] and [1..5]
        assert _wait(lambda: m.page_allocator.num_reserved == 1, 2.0) is not None
    held = m.alloc(512 * 6)  # six pages in use
    assert held is not None
    keep = held[:512 * 2]  # two pages stay
    m.free(held[512 * 2:])
    assert _wait(lambda: mem_info.read_segment(name).used_size == 2 * GROUP, 2.0) is not None

    # shrink to 3 page groups: applied within a second, in the engine, without any call from it.
    # Page by page, mapped memory comes down to the limit at once. With runs, pages 2..5 share
    # one allocation with page 1, still in use: they stay mapped, and are handed out first,
    # until the run is free.
    r = _kvctl("limit", name, f"{3 * GROUP // MiB}M")
    assert r.returncode == 0, r.stderr
    mapped = (lambda b: b == 6 * GROUP) if runs else (lambda b: b <= 3 * GROUP)
    t = _wait(lambda: m.limit_pages == 3 and mapped(m.mapped_bytes), 1.0)
    assert t is not None, f"limit not applied within 1 s (limit_pages={m.limit_pages}, mapped={m.mapped_bytes})"
    if runs:
        assert m.page_allocator.runs() == [(0, 1, 1), (1, 5, 1)]
    assert m.available_size() == 512  # one more page, then no more
    assert m.alloc(513) is None
    one = m.alloc(512)
    assert one is not None
    if runs:
        assert m.mapped_bytes == 6 * GROUP  # a page of the pinned run: no new memory

    # below what is in use: nothing in use is dropped; the cap follows as blocks are freed
    r = _kvctl("limit", name, f"{GROUP // MiB}M")
    assert r.returncode == 0, r.stderr
    assert _wait(lambda: m.limit_pages == 1, 1.0) is not None
    assert m.page_allocator.num_in_use == 3 and m.alloc(1) is None
    m.free(one)
    m.free(keep[512:])
    assert _wait(lambda: m.mapped_bytes == GROUP, 1.0) is not None
    assert _wait(lambda: mem_info.read_segment(name).used_size == GROUP, 1.0) is not None

    # regrow: a higher limit lets the pool map pages again within a second
    r = _kvctl("limit", name, "1G")
    assert r.returncode == 0, r.stderr
    assert _wait(lambda: m.available_size() == 8 * 512 - 512, 1.0) is not None
    more = m.alloc(512 * 7)
    assert more is not None
    assert _wait(lambda: mem_info.read_segment(name).used_size == 8 * GROUP, 1.0) is not None


def test_peak_shows_a_burst_between_two_publishes_and_kvctl_resets_it(name: str) -> None:
    m = _pool(8)
    base = m.alloc(512)  # one page stays in use
    assert base is not None and m.usage().peak == GROUP
    # a burst that is over long before the next publish: the segment still shows it
    burst = m.alloc(512 * 4)
    assert burst is not None
    m.free(burst)
    assert m.usage().used == GROUP and m.usage().peak == 5 * GROUP
    assert _wait(lambda: mem_info.read_segment(name).peak_used == 5 * GROUP, 2.0) is not None
    r = _kvctl("peak", name, "--json")
    assert r.returncode == 0, r.stderr
    assert f'"peak_used": {5 * GROUP}' in r.stdout

    # a reset from another process starts a new window at what is in use now, and kvctl waits for it
    r = _kvctl("peak", name, "--reset")
    assert r.returncode == 0, r.stderr
    info = mem_info.read_segment(name)
    assert info.peak_since_ns == info.peak_reset_ns > 0
    assert info.peak_used == GROUP and m.usage().peak == GROUP, (info, m.usage())
    two = m.alloc(512 * 2)
    assert two is not None
    m.free(two)
    assert _wait(lambda: mem_info.read_segment(name).peak_used == 3 * GROUP, 2.0) is not None
    assert "PEAK" in _kvctl("list", name).stdout


def test_kvctl_peak_reset_of_an_engine_that_is_gone_fails_with_a_reason(name: str) -> None:
    with mem_info._Writer(mem_info.segment_path(name), create=True) as w:
        w.mm[:mem_info._BODY_OFF] = mem_info._HEADER.pack(mem_info.MAGIC, mem_info.VERSION, 0)
    stamp = mem_info.request_peak_reset(name)
    with pytest.raises(TimeoutError, match="not applied"):
        mem_info.wait_peak_reset(name, stamp, timeout=0.3)
    for bad in ({"stamp": "now"}, {"stamp": 0}, {"stamp": stamp, "timeout": -1}, {"stamp": stamp, "timeout": None}):
        with pytest.raises(ValueError, match="stamp|timeout"):
            mem_info.wait_peak_reset(name, **bad)
    with pytest.raises(ValueError, match="is a path, not a name"):
        mem_info.request_peak_reset("../kvcached_x")  # names only, never a path
    assert _kvctl("peak", "kvcached_no_such_segment").returncode == 1


def test_limit_percent_uses_device_memory(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_HOST_MEM_LIMIT_MB", "1024")
    m = _pool(8)
    assert _wait(lambda: mem_info.read_segment(name).device_total == 1024 * MiB, 2.0) is not None
    r = _kvctl("limit-percent", name, "2.5")  # 25.6 MiB -> three page groups of 8 MiB
    assert r.returncode == 0, r.stderr
    assert _wait(lambda: m.limit_pages == 3, 1.0) is not None


def test_reads_are_never_torn(name: str) -> None:
    """A writer in another process keeps limit == limit_ns; a reader must never see them differ."""
    _pool(2)
    writer = (
        "import sys, time\n"
        "from kvcached import mem_info as mi\n"
        "end = time.time() + 1.5\n"
        "k = 0\n"
        "while time.time() < end:\n"
        "    with mi._Writer(mi.segment_path(sys.argv[1]), create=False) as w:\n"
        "        w.write([(mi._LIMIT_OFF, '<q', (k,)), (mi._LIMIT_NS_OFF, '<q', (k,))])\n"
        "    k += 1\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", writer, name])
    seen = 0
    try:
        while proc.poll() is None:
            info = mem_info.read_segment(name)
            if info.limit_ns:
                assert info.limit == info.limit_ns, "torn read"
                seen += 1
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == 0
    assert seen > 0


def test_a_writer_that_died_mid_write_does_not_block_readers(name: str) -> None:
    _pool(2)
    path = mem_info.segment_path(name)
    with open(path, "r+b") as f:
        f.seek(8)
        (seq,) = struct.unpack("<Q", f.read(8))
        f.seek(8)
        f.write(struct.pack("<Q", seq | 1))  # odd: "mid-write" forever
    # the next write (the engine's monitor) repairs the counter
    assert _wait(lambda: _readable(name), 2.0) is not None


def _readable(name: str) -> bool:
    try:
        mem_info.read_segment(name)
        return True
    except TimeoutError:
        return False


def test_stale_segment_of_a_dead_process_is_taken_over(name: str) -> None:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(proc.stdout)
    with mem_info._Writer(mem_info.segment_path(name), create=True) as w:
        w.mm[:mem_info._BODY_OFF] = mem_info._HEADER.pack(mem_info.MAGIC, mem_info.VERSION, 0)
        # written as a kvcached from before the peak fields wrote it: they read as zeros
        w.write([(mem_info._BODY_OFF, "<qqqqqqqq16s48s", (123, 0, 0, 0, 0, dead_pid, 0, 0, b"", b""))])
    old = mem_info.read_segment(name)
    assert (old.limit, old.pid, old.peak_used, old.peak_since_ns) == (123, dead_pid, 0, 0)
    _pool(2)
    info = mem_info.read_segment(name)
    assert info.pid == os.getpid() and info.limit == mem_info.NO_LIMIT and info.peak_since_ns > 0


def test_cli_utils_round_trip(name: str) -> None:
    _pool(4)
    assert cli_utils.get_kv_cache_limit("kvcached_no_such_segment") is None
    assert cli_utils.update_kv_cache_limit("kvcached_no_such_segment", 1) is None
    info = cli_utils.update_kv_cache_limit(name, 16 * MiB)
    assert info is not None and info.total_size == 16 * MiB
    got = cli_utils.get_kv_cache_limit(name)
    assert got is not None and got.total_size == 16 * MiB and got.limit == 16 * MiB


def test_manager_usage_and_set_limit_are_what_the_monitor_uses(name: str) -> None:
    m = _pool(8, contiguous=False)
    blocks = m.alloc(512 * 2)
    assert blocks is not None
    m.page_allocator.stop_prealloc_thread()  # the reserve stays put between the two reads below
    u = m.usage()
    assert u is not None and u.used == 2 * GROUP and u.capacity == 8 * GROUP
    assert u.prealloc == m.page_allocator.num_reserved * GROUP
    assert (u.layout, u.device) == ("per_layer", "cpu") and u.device_total == m.device_total > 0
    assert m.set_limit("ipc", 3) and m.limit_pages == 3
    assert m.set_limit("ipc", None) and m.limit_pages == 8
    m.close()
    assert m.usage() is None and m.set_limit("ipc", 1) is False


# -- only files inside SHM_DIR, only kvcached segments ----------------------------
def _segment_bytes(pid: int) -> bytes:
    buf = bytearray(mem_info.SEGMENT_BYTES)
    mem_info._HEADER.pack_into(buf, 0, mem_info.MAGIC, mem_info.VERSION, 0)
    mem_info._BODY.pack_into(buf, mem_info._BODY_OFF, mem_info.NO_LIMIT, 0, 0, 0, 0, pid, 0, 0, b"", b"", 0, 0, 0)
    return bytes(buf)


@pytest.mark.parametrize("bad", ["/tmp/kvcached_x", "../kvcached_x", "a/b", "..", ".", "", "x\0y", "kvcached..x"])
def test_segment_path_takes_plain_names_only(bad: str) -> None:
    with pytest.raises(ValueError, match="segment name .* use the name of a file in /dev/shm"):
        mem_info.segment_path(bad)


def test_cli_utils_refuse_paths(name: str, tmp_path) -> None:
    _pool(2)
    victim = tmp_path / name
    victim.write_bytes(b"precious")
    for call in (cli_utils.get_kv_cache_limit, cli_utils.delete_kv_cache_segment,
                 lambda n: cli_utils.update_kv_cache_limit(n, 1)):
        with pytest.raises(ValueError, match="not a path"):
            call(str(victim))
    assert victim.read_bytes() == b"precious"
    assert mem_info.read_segment(name).limit == mem_info.NO_LIMIT


def test_a_symlink_in_shm_is_never_followed(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    shm, outside = tmp_path / "shm", tmp_path / "outside"
    shm.mkdir()
    outside.mkdir()
    target = outside / "seg"
    target.write_bytes(_segment_bytes(os.getpid()))
    (shm / "kvcached_link").symlink_to(target)
    monkeypatch.setattr(mem_info, "SHM_DIR", str(shm))
    with pytest.raises(ValueError, match="symbolic link"):
        mem_info.read_segment("kvcached_link")
    with pytest.raises(ValueError, match="symbolic link"):
        mem_info.write_limit("kvcached_link", 1 << 20)
    with pytest.raises(ValueError, match="symbolic link"):
        mem_info.delete_segment("kvcached_link")
    assert mem_info.list_segments() == []
    assert target.read_bytes() == _segment_bytes(os.getpid())
    assert (shm / "kvcached_link").is_symlink()


def test_a_fifo_in_shm_does_not_block_readers(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    os.mkfifo(tmp_path / "kvcached_fifo")
    monkeypatch.setattr(mem_info, "SHM_DIR", str(tmp_path))
    got: list = []
    t = threading.Thread(target=lambda: got.append(mem_info.list_segments()), daemon=True)
    t.start()
    t.join(10)
    assert got == [[]], "listing blocked on a FIFO named like a segment"
    with pytest.raises(ValueError, match="not a regular file"):
        mem_info.read_segment("kvcached_fifo")


def _foreign(kind: str, path: str, tmp_path) -> bytes | None:
    """Put a file that is not a kvcached segment at path; what its target holds (to check it later)."""
    if kind == "text":
        data = b"someone else's data\n"
    elif kind == "zeros":  # right size, no magic
        data = bytes(mem_info.SEGMENT_BYTES)
    elif kind == "empty":
        data = b""
    elif kind == "longer":  # our header, but not our size
        data = _segment_bytes(999_999_999) + b"tail"
    elif kind == "symlink":  # a dead process's valid segment, but outside /dev/shm
        data = _segment_bytes(999_999_999)
        (tmp_path / "outside").write_bytes(data)
        os.symlink(tmp_path / "outside", path)
        return data
    else:
        os.mkdir(path)
        return None
    with open(path, "wb") as f:
        f.write(data)
    return data


@pytest.mark.parametrize("kind", ["text", "zeros", "empty", "longer", "symlink", "directory"])
def test_ipc_name_of_a_foreign_file_is_refused_and_the_file_kept(kind: str, name: str, tmp_path) -> None:
    from kvcached.errors import KVCachedStateError

    path = os.path.join("/dev/shm", name)
    data = _foreign(kind, path, tmp_path)
    try:
        with pytest.raises(KVCachedStateError, match=f"{path} .*not a kvcached segment.*KVCACHED_IPC_NAME"):
            _pool(2)
        vmm_ops.shutdown_kvcached()
        mem_info.stop_publisher()
        if kind == "symlink":
            assert os.path.islink(path) and (tmp_path / "outside").read_bytes() == data
        elif kind == "directory":
            assert os.path.isdir(path)
        else:
            with open(path, "rb") as f:
                assert f.read() == data
    finally:
        if os.path.isdir(path) and not os.path.islink(path):
            os.rmdir(path)
        elif os.path.lexists(path):
            os.unlink(path)


def test_a_foreign_file_locked_by_its_owner_is_refused_without_waiting(name: str) -> None:
    import fcntl
    import threading

    from kvcached.errors import KVCachedStateError

    path = os.path.join("/dev/shm", name)
    with open(path, "wb") as f:
        f.write(b"another program's data, under its own flock\n")
    owner = os.open(path, os.O_RDONLY)
    fcntl.flock(owner, fcntl.LOCK_EX)  # held for as long as the owner likes
    errors: list[BaseException] = []

    def start() -> None:
        try:
            _pool(2)
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    t = threading.Thread(target=start, daemon=True)
    try:
        t.start()
        t.join(10)
        assert not t.is_alive(), "kvcached waited for the lock of a file that is not its segment"
        assert len(errors) == 1 and isinstance(errors[0], KVCachedStateError), errors
        assert "not a kvcached segment" in str(errors[0])
    finally:
        fcntl.flock(owner, fcntl.LOCK_UN)
        os.close(owner)
        t.join(10)
        os.unlink(path)


def test_a_default_name_taken_in_a_race_moves_to_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    # Engines started together share a process group: both may find kvcached_<engine>_<pgid> free, and the
    # one that creates it second must take the next name instead of failing (seen with two test workers).
    monkeypatch.delenv("KVCACHED_IPC_NAME", raising=False)
    mem_info.stop_publisher()
    monkeypatch.setattr(mem_info, "_ipc_name_cache", None)
    tag = f"race{uuid.uuid4().hex[:8]}"
    monkeypatch.setattr(mem_info, "_engine_tag", lambda: tag)
    taken = mem_info.get_default_ipc_name()
    monkeypatch.setattr(mem_info, "_ipc_name_cache", None)
    with mem_info._Writer(mem_info.segment_path(taken), create=True) as w:  # the other engine, alive
        w.mm[:mem_info._BODY_OFF] = mem_info._HEADER.pack(mem_info.MAGIC, mem_info.VERSION, 0)
        w.write([(mem_info._BODY_OFF, "<qqqqqqqq16s48s", (0, 0, 0, 0, 0, os.getppid(), 0, 0, b"", b""))])
    real, calls = mem_info.get_default_ipc_name, []

    def chosen_before_the_other_created_it() -> str:
        calls.append(1)
        return taken if len(calls) == 1 else real()

    monkeypatch.setattr(mem_info, "get_default_ipc_name", chosen_before_the_other_created_it)
    try:
        pub = mem_info.start_publisher()
        assert pub.name == taken + "_1" and mem_info.read_segment(taken).pid == os.getppid()
    finally:
        mem_info.stop_publisher()
        mem_info.delete_segment(taken)
        mem_info.delete_segment(taken + "_1")

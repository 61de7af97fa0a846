"""The host backend's budget is shared by every process opening one /dev/shm segment,
like the free memory of one GPU: what one process holds, the others cannot take, and
what it frees (or leaves behind by dying) they can."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import uuid

import pytest

vmm = pytest.importorskip("kvcached._vmm")

MiB = 1 << 20
U = 2 * MiB

# A process holding host pages on command: "alloc N", "free", "info"; each answers one line.
WORKER = r"""
import sys
from kvcached import _vmm
b = _vmm.Backend("host", 0, int(sys.argv[1]))
vt = _vmm.VirtualTensor(b, 64 << 20, 2 << 20)
pa = _vmm.PageAllocator(b, [vt], [(0, 0, 2 << 20)], 32, 0, 0, False)
held = []
print("ready", b.shm_name, flush=True)
for line in sys.stdin:
    cmd = line.split()
    try:
        if cmd[0] == "alloc":
            held += pa.alloc_pages(int(cmd[1]))
            print("ok", len(held), flush=True)
        elif cmd[0] == "free":
            pa.free_pages(held)
            held = []
            print("ok", 0, flush=True)
        elif cmd[0] == "info":
            print("info", *b.mem_info(), flush=True)
    except _vmm.OutOfMemoryError as e:
        print("oom", str(e).replace("\n", " "), flush=True)
"""


class Worker:
    def __init__(self, budget: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, str(budget)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy())
        first = self.proc.stdout.readline().split()
        assert first[:1] == ["ready"], self.proc.stderr.read()
        self.shm_name = first[1]

    def ask(self, line: str) -> list[str]:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().split()
        assert answer, self.proc.stderr.read()
        return answer

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


@pytest.fixture(autouse=True)
def shm_name(monkeypatch: pytest.MonkeyPatch):
    """A segment of this test's own, so parallel runs and stale segments never interfere."""
    name = f"kvcached_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("KVCACHED_HOST_SHM_NAME", name)
    yield name
    vmm.unlink_host_shm(name)


@pytest.fixture
def worker():
    made: list[Worker] = []

    def start(budget: int) -> Worker:
        made.append(Worker(budget))
        return made[-1]

    yield start
    for w in made:
        w.stop()


def pages(backend, n=32):
    vt = vmm.VirtualTensor(backend, n * U, U)
    return vt, vmm.PageAllocator(backend, [vt], [(0, 0, U)], n, 0, 0, False)


def test_names_and_env(shm_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert vmm.host_shm_default_name(0) == shm_name
    assert vmm.Backend("host", 0, 8 * MiB).shm_name == "/" + shm_name
    assert vmm.Backend("host", 0, 8 * MiB, shm_name="/" + shm_name + "_x").shm_name == "/" + shm_name + "_x"
    vmm.unlink_host_shm(shm_name + "_x")
    monkeypatch.delenv("KVCACHED_HOST_SHM_NAME")
    uid = os.getuid()
    assert vmm.host_shm_default_name(0) == f"kvcached_host_{uid}_0"
    assert vmm.host_shm_default_name(3) == f"kvcached_host_{uid}_3"


@pytest.mark.parametrize("bad", ["a/b", "x" * 201, "..", "sp ace", "/", "...", "a..b", "../x", "/a/b", "x/", "//x"])
def test_bad_segment_names(bad: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="KVCACHED_HOST_SHM_NAME"):
        vmm.Backend("host", 0, 8 * MiB, shm_name=bad)
    monkeypatch.setenv("KVCACHED_HOST_SHM_NAME", bad)
    with pytest.raises(ValueError, match="KVCACHED_HOST_SHM_NAME"):
        vmm.Backend("host", 0, 8 * MiB)


def test_shm_name_only_for_host() -> None:
    with pytest.raises(ValueError, match="only applies to the host backend"):
        vmm.Backend("cuda", 0, 0, shm_name="x")


SEGMENT_BYTES = 8 + 4 + 4 + 8 + 256 * 32  # host_budget.cpp's BudgetSegment


def _put_foreign(kind: str, path: str, tmp_path) -> tuple[str, bytes | None]:
    """A file at path that is not a budget segment; (the file holding its bytes, those bytes)."""
    data = {"short": b"\x01" * 100, "empty": b"", "zeros": bytes(SEGMENT_BYTES),
            "other_magic": b"NOTOURS!" + bytes(SEGMENT_BYTES - 8), "symlink": bytes(SEGMENT_BYTES)}.get(kind)
    if kind == "directory":
        os.mkdir(path)
        return path, None
    target = str(tmp_path / "outside") if kind == "symlink" else path
    with open(target, "wb") as f:
        f.write(data)
    if kind == "symlink":
        os.symlink(target, path)
    return target, data


@pytest.mark.parametrize("kind", ["short", "empty", "zeros", "other_magic", "symlink", "directory"])
def test_foreign_segment_is_refused_and_left_alone(kind: str, shm_name: str, tmp_path) -> None:
    from kvcached.errors import KVCachedStateError

    path = f"/dev/shm/{shm_name}"
    target, data = _put_foreign(kind, path, tmp_path)
    try:
        sized = kind in ("short", "empty")
        want = "not the .* B of this kvcached version" if sized else "not a kvcached host budget segment"
        with pytest.raises(KVCachedStateError, match=want + ".*KVCACHED_HOST_SHM_NAME"):
            vmm.Backend("host", 0, 8 * MiB)
        with pytest.raises(KVCachedStateError, match="not a kvcached host budget segment|not the .* B"):
            vmm.unlink_host_shm(shm_name)
        if kind == "directory":
            assert os.path.isdir(path)
        else:
            assert os.path.lexists(path) and os.path.islink(path) == (kind == "symlink")
            with open(target, "rb") as f:
                assert f.read() == data, "the file was written"
    finally:
        if os.path.isdir(path) and not os.path.islink(path):
            os.rmdir(path)
        elif os.path.lexists(path):
            os.unlink(path)


def test_a_foreign_file_locked_by_its_owner_is_refused_without_waiting(shm_name: str) -> None:
    import fcntl
    import threading

    from kvcached.errors import KVCachedStateError

    path = f"/dev/shm/{shm_name}"
    with open(path, "wb") as f:
        f.write(b"another program's data, under its own flock\n")
    owner = os.open(path, os.O_RDONLY)
    fcntl.flock(owner, fcntl.LOCK_EX)
    errors: list[BaseException] = []

    def run(call) -> None:
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    try:
        for call in (lambda: vmm.Backend("host", 0, 8 * MiB), lambda: vmm.unlink_host_shm(shm_name)):
            t = threading.Thread(target=run, args=(call,), daemon=True)
            t.start()
            t.join(10)
            assert not t.is_alive(), "kvcached waited for the lock of a file that is not its segment"
        assert len(errors) == 2 and all(isinstance(e, KVCachedStateError) for e in errors), errors
    finally:
        fcntl.flock(owner, fcntl.LOCK_UN)
        os.close(owner)
        os.unlink(path)


def test_unlink_removes_a_budget_segment_and_reports_absence(shm_name: str) -> None:
    vmm.Backend("host", 0, 8 * MiB)
    assert os.path.exists(f"/dev/shm/{shm_name}")
    assert vmm.unlink_host_shm(shm_name) is True
    assert not os.path.exists(f"/dev/shm/{shm_name}")
    assert vmm.unlink_host_shm(shm_name) is False


def test_backends_of_one_process_share_and_last_opener_sets_budget() -> None:
    a = vmm.Backend("host", 0, 16 * MiB)
    vt, pa = pages(a)
    pa.alloc_pages(3)  # + the zero page: 8 MiB
    assert a.mem_info() == (8 * MiB, 16 * MiB)
    b = vmm.Backend("host", 0, 12 * MiB)  # the most recent opener's budget holds for all
    assert a.mem_info() == b.mem_info() == (4 * MiB, 12 * MiB)
    assert vmm.Backend("host", 0, 0).mem_info() == (4 * MiB, 12 * MiB)  # 0 keeps it
    vt2, pb = pages(b)  # its own zero page: 2 MiB
    pb.alloc_pages(1)
    with pytest.raises(vmm.OutOfMemoryError, match="12582912 B host budget"):
        pb.alloc_pages(1)
    b.set_host_limit(14 * MiB)
    assert a.mem_info() == (2 * MiB, 14 * MiB)
    pb.alloc_pages(1)
    # another device index is another segment
    other = vmm.Backend("host", 1, 64 * MiB, shm_name=a.shm_name.lstrip("/") + "_dev1")
    assert other.mem_info() == (64 * MiB, 64 * MiB)
    vmm.unlink_host_shm(other.shm_name)


def test_two_processes_share_the_budget(worker, eventually) -> None:
    budget = 16 * MiB
    w = worker(budget)  # its zero page: 2 MiB
    assert w.ask("alloc 4") == ["ok", "4"]  # 10 MiB held there
    b = vmm.Backend("host", 0, budget)
    assert b.shm_name == w.shm_name
    assert b.mem_info() == (6 * MiB, budget)
    vt, pa = pages(b)  # zero page here: 2 MiB, 4 MiB left
    pa.alloc_pages(2)
    with pytest.raises(vmm.OutOfMemoryError, match="in use by 2 process"):
        pa.alloc_pages(1)
    assert w.ask("alloc 1")[0] == "oom"
    assert w.ask("info") == ["info", "0", str(budget)]
    # memory one process frees becomes usable by the other while both run: its release is
    # deferred to the worker's background thread, so it arrives shortly after the call returned
    # (the worker makes no further call meanwhile: it waits on stdin)
    assert w.ask("free") == ["ok", "0"]
    assert eventually(lambda: b.mem_info() == (8 * MiB, budget))
    assert len(pa.alloc_pages(4)) == 4
    assert w.ask("alloc 1")[0] == "oom"
    pa.close()
    assert w.ask("alloc 4") == ["ok", "4"]


def test_killed_process_usage_is_reclaimed(worker) -> None:
    budget = 16 * MiB
    w = worker(budget)
    assert w.ask("alloc 7") == ["ok", "7"]  # the whole budget
    b = vmm.Backend("host", 0, budget)
    assert b.mem_info() == (0, budget)
    with pytest.raises(vmm.OutOfMemoryError):
        vmm.VirtualTensor(b, 4 * MiB, U)  # not even its zero page
    w.proc.send_signal(signal.SIGKILL)
    w.proc.wait(timeout=30)
    assert b.mem_info() == (budget, budget)
    vt, pa = pages(b)
    assert len(pa.alloc_pages(7)) == 7


def test_exited_process_leaves_nothing_behind(worker) -> None:
    w = worker(16 * MiB)
    assert w.ask("alloc 3") == ["ok", "3"]
    b = vmm.Backend("host", 0, 16 * MiB)
    assert b.mem_info()[0] == 8 * MiB
    w.stop()
    assert b.mem_info()[0] == 16 * MiB


def _forked_child(conn) -> None:
    b = vmm.Backend("host", 0, 0)  # the parent's backend object, reused after fork: its own slot
    vt, pa = pages(b)
    pa.alloc_pages(2)
    conn.send(b.mem_info()[0])
    conn.recv()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_gets_its_own_slot() -> None:
    parent = vmm.Backend("host", 0, 32 * MiB)
    vt, pa = pages(parent)
    pa.alloc_pages(1)  # 4 MiB here
    ctx = multiprocessing.get_context("fork")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_forked_child, args=(theirs,))
    child.start()
    try:
        assert ours.recv() == 32 * MiB - 4 * MiB - 6 * MiB
        assert parent.mem_info()[0] == 32 * MiB - 10 * MiB
    finally:
        ours.send("done")
        child.join(timeout=30)
    assert child.exitcode == 0
    assert parent.mem_info()[0] == 28 * MiB

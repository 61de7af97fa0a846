"""Per-instance memory accounting in ``/dev/shm``, and the monitor that obeys limits.

One small file per engine instance, ``/dev/shm/<ipc name>``, holds a fixed,
versioned little-endian record (see ``_BODY``): the limit set by ``kvctl``, the
bytes in use and preallocated, the capacity, the owner's pid, layout and device.
Writers (the engine's monitor thread, ``kvctl``) take ``flock(LOCK_EX)`` and bump a
sequence counter to odd before and to even after writing; readers take no lock
and retry until they see the same even counter before and after reading, so a
read is never torn.

Only files inside ``SHM_DIR`` are ever touched, named by a plain file name (no path,
no ``..``), opened without following a symlink, and only once they prove to be
kvcached segments (a regular file of ``SEGMENT_BYTES`` starting with ``MAGIC``): a
file of the same name that belongs to someone else is never written, truncated or
removed. A new segment is written under a temporary name and linked into place, so
no one ever sees a half-made one.

In the engine a daemon thread publishes usage every ``PERIOD`` seconds and applies
a new limit at once: the pool shrinks to it (never below what is in use; the rest
follows as blocks are freed) or grows back.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import mmap
import os
import stat
import struct
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from kvcached import config, limits
from kvcached.errors import KVCachedStateError
from kvcached.limits import MAX_LIMIT, NO_LIMIT, check_limit  # noqa: F401 (segment users read them here)
from kvcached.log import get_kvcached_logger

logger = get_kvcached_logger()

MAGIC = b"KVCM"
VERSION = 1
PERIOD = 0.1  # seconds between publishes; limits apply within one period
SEGMENT_BYTES = 4096

_HEADER = struct.Struct("<4sIQ")  # magic, version, sequence counter
_BODY = struct.Struct("<qqqqqqqq16s48sqqq")  # limit, used, prealloc, capacity, device_total, pid, updated_ns,
#                                               limit_ns, layout, device, peak_used, peak_reset_ns, peak_since_ns
# The peak fields were appended to the zeroed tail of version 1: a reader that predates them
# reads every other field where it was, and an older segment shows no peak.
_SEQ_OFF = 8
_BODY_OFF = _HEADER.size
_LIMIT_OFF = _BODY_OFF
_LIMIT_NS_OFF = _BODY_OFF + 7 * 8
_PEAK_OFF = _BODY_OFF + 128  # peak_used; then peak_reset_ns (asked by kvctl), peak_since_ns (applied)
_PEAK_RESET_OFF = _PEAK_OFF + 8
_PEAK_SINCE_OFF = _PEAK_OFF + 16
# Appended the same way: the limit's revision (kvcached.control), the revision the engine applied
# (both stored + 1, so a zeroed tail means none), pages mapped and unmapped so far, and the
# limit state of up to MAX_POOLS pools.
_TAIL = struct.Struct("<qqqqq")
_TAIL_OFF = _BODY_OFF + _BODY.size
_REVISION_OFF = _TAIL_OFF
_APPLIED_OFF = _TAIL_OFF + 8
_COUNTS_OFF = _TAIL_OFF + 16
_POOL = struct.Struct("<24sqqqqq")  # name, group, effective limit (-1: none), capacity, mapped, status
_POOLS_OFF = _TAIL_OFF + _TAIL.size
MAX_POOLS = 8
_STATUS_CODES = {"applied": 1, "deferred": 2}
SEGMENT_MODE = 0o600  # only the owner (and root) may read or set an engine's limit
# A reader that sees the counter odd this long checks whether any writer holds the lock; if none
# does, a writer died mid-write and the segment is reported damaged instead of waited on.
_DAMAGE_CHECK_S = 0.02
_READ_TIMEOUT_S = 2.0

SHM_DIR = "/dev/shm"
SHM_PREFIX = "kvcached_"

_ipc_name_cache: str | None = None


@dataclass
class MemInfo:
    """One segment's contents. ``total_size`` is the effective limit in bytes (as in kvcached)."""

    name: str
    limit: int  # bytes, NO_LIMIT (-1) when none was set
    used_size: int
    prealloc_size: int
    capacity: int
    device_total: int
    pid: int
    updated_ns: int
    limit_ns: int
    layout: str
    device: str
    peak_used: int = 0  # most bytes in use at once since peak_since_ns (each pool's own peak, summed)
    peak_since_ns: int = 0  # when the engine started, or applied the last `kvctl peak --reset`
    peak_reset_ns: int = 0  # the last reset asked for; equal to peak_since_ns once applied
    damaged: bool = False  # a writer died mid-write: the fields may be torn (the owner's next publish mends it)
    limit_revision: int = -1  # the revision of ``limit`` (kvcached.control; kvctl limit takes the next); -1: none
    applied_revision: int = -1  # the revision the engine applied last
    pages_mapped: int = 0  # pages this instance's pools mapped since they started
    pages_unmapped: int = 0
    pools: list[dict[str, Any]] = field(default_factory=list)  # each pool's limit state, as the engine published it

    @property
    def total_size(self) -> int:
        return self.capacity if self.limit < 0 else self.limit

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["total_size"] = self.total_size
        d["alive"] = pid_alive(self.pid)
        return d


def check_name(name: str) -> str:
    """``name`` if it names a file directly inside SHM_DIR, else ValueError saying why."""
    if not isinstance(name, str):
        raise ValueError(f"segment name must be a str, got {type(name).__name__}.")
    if not name:
        problem = "is empty"
    elif "\0" in name:
        problem = "holds a NUL byte"
    elif "/" in name:
        problem = "is a path, not a name"
    elif ".." in name or name == ".":
        problem = "holds '..' or is '.'"
    elif len(os.fsencode(name)) > 255:
        problem = "is longer than 255 bytes"
    else:
        return name
    hint = ""
    if "/" in name and "\0" not in name and os.path.basename(name):
        hint = f" (for {os.path.join(SHM_DIR, os.path.basename(name))} pass {os.path.basename(name)!r})"
    raise ValueError(f"segment name {name!r} {problem}; use the name of a file in {SHM_DIR} as `kvctl list` "
                     f"shows it, e.g. kvcached_proc_1234, not a path{hint}.")


def segment_path(name: str) -> str:
    return os.path.join(SHM_DIR, check_name(name))


def _open_segment(path: str, flags: int) -> int:
    """A descriptor of the kvcached segment at path: never through a symlink, never a FIFO's
    blocking open, and ValueError (the file untouched) for anything but a regular file."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValueError(f"{path} is a symbolic link, not a kvcached segment.") from None
        if exc.errno == errno.EISDIR:
            raise ValueError(f"{path} is a directory, not a kvcached segment.") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"{path} is not a regular file, so not a kvcached segment.")
    return fd


def _check_segment(path: str, fd: int) -> None:
    """ValueError unless fd holds a kvcached segment (its size and magic)."""
    size = os.fstat(fd).st_size
    if size != SEGMENT_BYTES:
        raise ValueError(f"{path} has {size} B, not the {SEGMENT_BYTES} B of a kvcached segment, so it is "
                         "not a kvcached segment.")
    magic = os.pread(fd, len(MAGIC), 0)
    if magic != MAGIC:
        raise ValueError(f"{path} is not a kvcached segment (bad magic {magic!r}).")


def _create_segment(path: str) -> bool:
    """Create a fresh segment at path (limit NO_LIMIT, pid 0); False if a file is there already.

    Written under a temporary name and linked into place: link never replaces a file, and
    no reader can find the segment before its header is written.
    """
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.{os.urandom(6).hex()}")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, SEGMENT_MODE)
    try:
        os.fchmod(fd, SEGMENT_MODE)  # the umask may have cleared the owner's bits too
        buf = bytearray(SEGMENT_BYTES)
        _HEADER.pack_into(buf, 0, MAGIC, VERSION, 0)
        struct.pack_into("<q", buf, _LIMIT_OFF, NO_LIMIT)
        os.write(fd, bytes(buf))
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        return True
    finally:
        os.close(fd)
        os.unlink(tmp)


def pid_alive(pid: int) -> bool:
    # anyone may write a segment: a pid no process can have (kill takes a C int) is simply not alive
    if not isinstance(pid, int) or not 0 < pid < 1 << 31:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True
    return True


def _unpack(name: str, buf: Any) -> MemInfo:
    magic, version, _ = _HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise ValueError(f"{segment_path(name)} is not a kvcached segment (bad magic {magic!r}).")
    if version != VERSION:
        raise ValueError(f"{segment_path(name)} has layout version {version}; this kvcached reads version {VERSION}.")
    f = _BODY.unpack_from(buf, _BODY_OFF)
    rev, applied, mapped, unmapped, npools = _TAIL.unpack_from(buf, _TAIL_OFF)
    pools = []
    for i in range(max(0, min(npools, MAX_POOLS))):
        pname, group, eff, cap, used, code = _POOL.unpack_from(buf, _POOLS_OFF + i * _POOL.size)
        status = next((k for k, v in _STATUS_CODES.items() if v == code), "unknown")
        pools.append({"pool_name": _text(pname), "group_id": group, "effective_limit_bytes": None if eff < 0 else eff,
                      "current_capacity_bytes": cap, "mapped_bytes": used, "status": status})
    return MemInfo(name, f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7], _text(f[8]), _text(f[9]),
                   peak_used=f[10], peak_reset_ns=f[11], peak_since_ns=f[12], limit_revision=rev - 1,
                   applied_revision=applied - 1, pages_mapped=mapped, pages_unmapped=unmapped, pools=pools)


def _text(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode(errors="replace")


def _read_damaged(name: str, mm: Any, fd: int) -> MemInfo | None:
    """The segment marked damaged if its counter is odd while no writer holds the lock, else None."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:  # a live writer is at work: wait for it
        return None
    try:
        (seq,) = struct.unpack_from("<Q", mm, _SEQ_OFF)
        if seq % 2 == 0:
            return None
        info = _unpack(name, mm)
        info.damaged = True
        return info
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def _read_consistent(name: str, mm: Any, fd: int | None = None) -> MemInfo:
    """A consistent read; with ``fd``, a counter left odd by a dead writer gives a damaged read."""
    start = time.monotonic()
    while True:
        (s1,) = struct.unpack_from("<Q", mm, _SEQ_OFF)
        if s1 % 2 == 0:
            info = _unpack(name, mm)
            (s2,) = struct.unpack_from("<Q", mm, _SEQ_OFF)
            if s1 == s2:
                return info
        waited = time.monotonic() - start
        if fd is not None and waited > _DAMAGE_CHECK_S and (info := _read_damaged(name, mm, fd)) is not None:
            return info
        if waited > _READ_TIMEOUT_S:
            raise TimeoutError(f"segment {name} stayed mid-write for {_READ_TIMEOUT_S:.0f} s while a writer held "
                               "its lock; is a writer stuck?")
        time.sleep(0.0001)


def read_segment(name: str) -> MemInfo:
    """Read one segment; FileNotFoundError if absent, ValueError if it is not ours.

    A segment whose writer died mid-write reads with ``damaged`` set (its fields may be torn):
    kvctl shows it, and ``limit`` or ``delete`` take the writers' lock and mend or remove it.
    """
    path = segment_path(name)
    fd = _open_segment(path, os.O_RDONLY)
    try:
        _check_segment(path, fd)
        with mmap.mmap(fd, SEGMENT_BYTES, access=mmap.ACCESS_READ) as mm:
            return _read_consistent(name, mm, fd)
    finally:
        os.close(fd)


class _Writer:
    """Open segment with flock(LOCK_EX) held; ``write(offset, fmt, *values)`` under the counter.

    ``create``: make a fresh segment if none is there. A file that is not a kvcached
    segment raises ValueError before anything is written.
    """

    def __init__(self, path: str, create: bool = False) -> None:
        if create:
            _create_segment(path)
        self.path = path
        self.fd = _open_segment(path, os.O_RDWR)
        try:
            _check_segment(path, self.fd)  # first unlocked: never wait on the lock of someone else's file
            fcntl.flock(self.fd, fcntl.LOCK_EX)
            _check_segment(path, self.fd)
            self.mm = mmap.mmap(self.fd, SEGMENT_BYTES)
        except BaseException:
            os.close(self.fd)
            raise

    def __enter__(self) -> _Writer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.mm.close()
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)

    def unlink(self) -> None:
        """Remove the name, if it still names this very file (not one put there since)."""
        try:
            now = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return
        mine = os.fstat(self.fd)
        if (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
            os.unlink(self.path)

    def write(self, items: list[tuple[int, str, tuple[Any, ...]]]) -> None:
        # packed before the counter goes odd: a value that does not fit raises with nothing written
        try:
            packed = [(off, struct.pack(fmt, *values)) for off, fmt, values in items]
        except struct.error as exc:
            raise ValueError(f"{self.path}: a value does not fit its field ({exc}); nothing was written.") from None
        (seq,) = struct.unpack_from("<Q", self.mm, _SEQ_OFF)
        seq += seq % 2  # a writer that died mid-write left it odd
        struct.pack_into("<Q", self.mm, _SEQ_OFF, seq + 1)
        for off, data in packed:
            self.mm[off:off + len(data)] = data
        struct.pack_into("<Q", self.mm, _SEQ_OFF, seq + 2)


def _write_limit_locked(w: _Writer, limit_bytes: int, revision: int | None) -> str:
    """Under the writers' lock: ``written``, ``repeated`` (that revision holds that limit already),
    ``stale`` or ``conflict`` (nothing written). None: the next revision (``kvctl limit``)."""
    (held,) = struct.unpack_from("<q", w.mm, _REVISION_OFF)
    held -= 1
    (limit,) = struct.unpack_from("<q", w.mm, _LIMIT_OFF)
    if revision is not None and revision < held:
        return "stale"
    if revision is not None and revision == held:
        return "repeated" if limit == limit_bytes else "conflict"
    revision = held + 1 if revision is None else revision
    w.write([(_LIMIT_OFF, "<q", (limit_bytes,)), (_LIMIT_NS_OFF, "<q", (time.time_ns(),)),
             (_REVISION_OFF, "<q", (revision + 1,))])
    return "written"


def write_limit(name: str, limit_bytes: int) -> MemInfo:
    """Set the limit of a live segment (``kvctl limit``) as its next revision; NO_LIMIT removes it."""
    check_limit(limit_bytes)
    path = segment_path(name)
    read_segment(name)  # FileNotFoundError / ValueError before touching anything
    with _Writer(path, create=False) as w:
        _write_limit_locked(w, limit_bytes, None)
        return _read_consistent(name, w.mm)


def write_limit_revision(name: str, limit_bytes: int, revision: int) -> tuple[str, MemInfo]:
    """Set the limit as ``revision`` unless the segment holds a newer one (``stale``) or this one with
    another limit (``conflict``); returns the outcome and the segment (see kvcached.control)."""
    check_limit(limit_bytes)
    path = segment_path(name)
    read_segment(name)
    with _Writer(path, create=False) as w:
        outcome = _write_limit_locked(w, limit_bytes, revision)
        return outcome, _read_consistent(name, w.mm)


def request_peak_reset(name: str) -> int:
    """Ask the engine that owns ``name`` to start a new peak window (``kvctl peak --reset``); returns the
    request's timestamp, which the segment's ``peak_since_ns`` shows once the engine applied it."""
    path = segment_path(name)
    read_segment(name)  # FileNotFoundError / ValueError before touching anything
    stamp = time.time_ns()
    with _Writer(path, create=False) as w:
        w.write([(_PEAK_RESET_OFF, "<q", (stamp,))])
    return stamp


def wait_peak_reset(name: str, stamp: int, timeout: float = 5.0) -> MemInfo:
    """Wait until the owner applied the reset ``stamp``; TimeoutError (saying why) if it does not."""
    if not isinstance(stamp, int) or isinstance(stamp, bool) or stamp <= 0:
        raise ValueError(f"stamp must be the int that request_peak_reset returned, got {stamp!r}.")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}.")
    deadline = time.monotonic() + timeout
    while True:
        info = read_segment(name)
        if info.peak_since_ns >= stamp:
            return info
        if time.monotonic() > deadline:
            owner = "is alive" if pid_alive(info.pid) else "is not running"
            raise TimeoutError(f"{name}: the peak reset was not applied within {timeout:.0f} s (its owner, pid "
                               f"{info.pid}, {owner}); the engine applies it within {PERIOD} s while it runs.")
        time.sleep(PERIOD / 4)


def delete_segment(name: str) -> bool:
    """Remove the segment ``name``; False if there is none. ValueError (nothing removed) for a
    file of that name that is not a kvcached segment."""
    try:
        with _Writer(segment_path(name)) as w:
            w.unlink()
        return True
    except FileNotFoundError:
        return False


def list_segments() -> list[str]:
    """Names of every kvcached segment in SHM_DIR (valid ones only), sorted."""
    try:
        entries = sorted(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return []
    names = []
    for entry in entries:
        if not entry.startswith(SHM_PREFIX):
            continue
        try:
            read_segment(entry)
        except (OSError, ValueError, TimeoutError):
            continue
        names.append(entry)
    return names


# -- segment names (kvcached.utils re-exports them) ---------------------
def sanitize_ipc_name(name: str) -> str:
    """Keep a /dev/shm name to ``[A-Za-z0-9_-]`` and 100 characters."""
    clean = "".join(ch if ch.isalnum() or ch in "_-" else "-" for ch in name)
    return clean[:100]


def _engine_tag() -> str:
    # Only engines actually loaded in this process count: an installed but
    # unused vLLM must not rename the demo's segment.
    if "vllm" in sys.modules:
        return "vLLM"
    if "sglang" in sys.modules:
        return "SGLang"
    return "proc"


def _segment_taken(name: str) -> bool:
    try:
        info = read_segment(name)
    except FileNotFoundError:
        return False
    except ValueError:  # someone else's file (or another kvcached version's): not ours to take
        return True
    try:
        foreign = os.stat(segment_path(name), follow_symlinks=False).st_uid != os.geteuid()
    except FileNotFoundError:
        return False
    return foreign or (info.pid != os.getpid() and pid_alive(info.pid))


def default_ipc_base(engine: str | None = None) -> str:
    """``kvcached_<engine>_<pgid>``: the default segment names of this process group's engines are this name
    and this name suffixed ``_1``, ``_2``... (``engine``: the engine's tag, by default the one loaded here)."""
    if engine is not None and not (isinstance(engine, str) and engine.isascii() and engine.isalnum()):
        raise ValueError(f"default_ipc_base: engine must be a tag of letters and digits (such as 'vLLM'), "
                         f"got {engine!r}.")
    try:
        group = os.getpgid(0)
    except OSError:
        group = os.getpid()
    return f"{SHM_PREFIX}{engine or _engine_tag()}_{group}"


def get_default_ipc_name() -> str:
    """``KVCACHED_IPC_NAME`` when set, else ``kvcached_<engine>_<pgid>`` (suffixed if taken).

    Two engines started from one script share a process group, so a name held
    by another live process gets ``_1``, ``_2``... The choice is made once per
    process so the segment keeps its name for the process's life.
    """
    global _ipc_name_cache
    explicit = config.ipc_name_override()
    if explicit:
        return explicit
    if _ipc_name_cache is not None:
        return _ipc_name_cache
    base = default_ipc_base()
    name = base
    for i in range(1, 1000):
        if not _segment_taken(name):
            break
        name = f"{base}_{i}"
    _ipc_name_cache = name
    return name


# -- the engine side -------------------------------------------------------
def _make_private(w: _Writer) -> None:
    """Refuse a segment another user owns (they could set this engine's limit); make ours owner-only
    (one left by an older kvcached or by hand may be writable by others)."""
    st = os.fstat(w.fd)
    if st.st_uid != os.geteuid():
        raise KVCachedStateError(
            f"segment {w.path} belongs to user id {st.st_uid}, not to this process's user ({os.geteuid()}), who "
            "could then set this engine's memory limit; set KVCACHED_IPC_NAME to another name, or have the file "
            "removed."
        )
    if stat.S_IMODE(st.st_mode) != SEGMENT_MODE:
        os.fchmod(w.fd, SEGMENT_MODE)


class Publisher:
    """Owns this process's segment: publishes usage, applies limits, removes it at the end."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.path = segment_path(name)
        self.managers: weakref.WeakSet = weakref.WeakSet()
        self._applied: tuple[int, int] | None = None  # (limit, revision) applied to the pools
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        try:
            with _Writer(self.path, create=True) as w:
                _make_private(w)
                old = _unpack(name, w.mm)  # under the lock: a dead owner is replaced by one process only
                if old.pid != os.getpid() and pid_alive(old.pid):
                    raise KVCachedStateError(
                        f"segment {self.path} belongs to the live process {old.pid}; set KVCACHED_IPC_NAME to a "
                        "unique name for this engine."
                    )
                now = time.time_ns()
                w.write([(_BODY_OFF, _BODY.format,
                          (NO_LIMIT, 0, 0, 0, 0, os.getpid(), now, 0, b"", b"", 0, now, now)),
                         (_TAIL_OFF, f"{_TAIL.size + MAX_POOLS * _POOL.size}x", ())])  # no revision, no pools
        except (ValueError, OSError) as exc:
            raise KVCachedStateError(
                f"{self.path} exists and is not a kvcached segment of this version ({exc}); kvcached does not "
                "write or remove files it did not make. Set KVCACHED_IPC_NAME to another name, or remove the file "
                "if nothing uses it."
            ) from None
        self._thread = threading.Thread(target=self._run, name=f"kvcached-meminfo-{name}", daemon=True)
        self._thread.start()

    def _snapshot(self) -> tuple[int, int, int, int, str, str, int, int, int]:
        used = prealloc = capacity = total = peak = maps = unmaps = 0
        layout = device = ""
        for m in list(self.managers):
            u = m.usage()  # no driver call from this thread (the device total was read at start)
            if u is None:
                continue
            used += u.used
            prealloc += u.prealloc
            capacity += u.capacity
            peak += u.peak
            maps += u.pages_mapped
            unmaps += u.pages_unmapped
            total, layout, device = u.device_total, u.layout, u.device
        return used, prealloc, capacity, total, layout, device, peak, maps, unmaps

    def _pool_records(self) -> list[tuple[int, str, tuple[Any, ...]]]:
        states = []
        for m in list(self.managers):
            with m._control_lock:
                if m._allocator is not None:
                    states.append(limits.pool_state(m))
        states.sort(key=lambda s: (s["pool_name"], s["group_id"]))
        out = [(_COUNTS_OFF + 16, "<q", (min(len(states), MAX_POOLS),))]
        for i, s in enumerate(states[:MAX_POOLS]):
            eff = -1 if s["effective_limit_bytes"] is None else s["effective_limit_bytes"]
            out.append((_POOLS_OFF + i * _POOL.size, _POOL.format,
                        (s["pool_name"].encode()[:24], s["group_id"], eff, s["current_capacity_bytes"],
                         s["mapped_bytes"], _STATUS_CODES.get(s["status"], 0))))
        return out

    def publish(self, w: _Writer | None = None) -> None:
        if w is None:
            with _Writer(self.path, create=False) as w2:
                self.publish(w2)
            return
        used, prealloc, capacity, total, layout, device, peak, maps, unmaps = self._snapshot()
        applied = [] if self._applied is None else [(_APPLIED_OFF, "<q", (self._applied[1] + 1,))]
        w.write([(_BODY_OFF + 8, "<qqqqqq", (used, prealloc, capacity, total, os.getpid(), time.time_ns())),
                 (_BODY_OFF + 64, "<16s48s", (layout.encode()[:16], device.encode()[:48])),
                 (_PEAK_OFF, "<q", (peak,)), (_COUNTS_OFF, "<qq", (maps, unmaps)), *applied,
                 *self._pool_records()])

    def limit_revision(self) -> int:
        """The revision of the limit this segment holds (-1: none)."""
        return read_segment(self.name).limit_revision

    def apply_revisioned_limit(self, limit: int | None, revision: int,
                               apply: Callable[[], list[dict[str, Any]]]) -> tuple[str, list[dict[str, Any]] | None]:
        """kvcached.control in this process: record ``(limit, revision)`` unless the segment holds a newer
        revision (``stale``) or this one with another limit (``conflict``: then ``(outcome, None)``), and run
        ``apply`` (the pools' own calls) under the lock the monitor applies limits under."""
        seg_limit = NO_LIMIT if limit is None else limit
        with self._lock, _Writer(self.path, create=False) as w:
            outcome = _write_limit_locked(w, seg_limit, revision)
            if outcome in ("stale", "conflict"):
                return outcome, None
            states = apply()
            self._applied = (seg_limit, revision)
            self.publish(w)
            return outcome, states

    def reset_peak(self) -> None:
        for m in list(self.managers):
            m.reset_peak()

    def apply_limit(self, limit: int, revision: int = -1) -> None:
        """Split ``limit`` bytes over this process's pools by their capacity (kvcached.limits' split);
        NO_LIMIT lifts the cap. A pool that holds a newer revision of its own keeps it."""
        pools = [m for m in list(self.managers) if m.usage() is not None]
        limits.apply_instance_limit(pools, None if limit < 0 else limit, revision)
        self._applied = (limit, revision)

    def tick(self) -> None:
        # holding the writers' lock there is no other writer, so an odd counter means one
        # died mid-write: read directly, and this write makes the counter even again
        with self._lock, _Writer(self.path, create=False) as w:
            info = _unpack(self.name, w.mm)
            if (info.limit, info.limit_revision) != self._applied:
                self.apply_limit(info.limit, info.limit_revision)
            ack = []
            if info.peak_reset_ns > info.peak_since_ns:
                self.reset_peak()
                ack = [(_PEAK_SINCE_OFF, "<q", (info.peak_reset_ns,))]
            self.publish(w)
            if ack:  # after the publish: a reader that sees the ack sees the new window's peak
                w.write(ack)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except FileNotFoundError:
                logger.warning("segment %s was deleted; recreating it", self.path)
                try:
                    with _Writer(self.path, create=True):
                        pass
                except (OSError, ValueError) as exc:  # someone else's file took the name: leave it alone
                    logger.warning("cannot recreate segment %s: %s", self.path, exc)
            except Exception as exc:  # the monitor must never take the engine down
                logger.warning("kvcached memory monitor: %s", exc)
            self._wake.wait(PERIOD)
            self._wake.clear()

    def poke(self) -> None:
        """Run a tick soon (after a register, or from tests)."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        try:
            with _Writer(self.path) as w:
                if _unpack(self.name, w.mm).pid == os.getpid():
                    w.unlink()
        except (OSError, ValueError):
            pass


_publisher: Publisher | None = None
_plock = threading.Lock()


def publisher() -> Publisher | None:
    return _publisher


def _start_locked() -> Publisher:
    global _publisher, _ipc_name_cache
    for attempt in range(8):
        if _publisher is not None:
            break
        name = get_default_ipc_name()
        try:
            _publisher = Publisher(name)
        except KVCachedStateError:
            # Two processes of one group (engines started together) may both find a default name free
            # and race to create it: the loser takes the next suffix. A name the user chose stays an error.
            if attempt == 7 or config.ipc_name_override() or not _segment_taken(name):
                raise
            _ipc_name_cache = None
    return _publisher


def start_publisher() -> Publisher:
    """This process's publisher, made with its segment on the first call (a manager calls this
    before it binds, so a name it may not use fails before anything is mapped)."""
    with _plock:
        return _start_locked()


def register(manager: Any) -> None:
    with _plock:
        pub = _start_locked()
        pub.managers.add(manager)
        pub._applied = None  # re-apply the limit to include the new pool
        pub.poke()


def unregister(manager: Any) -> None:
    with _plock:
        if _publisher is not None:
            _publisher.managers.discard(manager)
            _publisher.poke()


def stop_publisher() -> None:
    global _publisher
    with _plock:
        if _publisher is not None:
            _publisher.stop()
            _publisher = None


atexit.register(stop_publisher)

"""Test set-up shared by every test file.

Without a GPU the Triton kernels run in Triton's interpreter; that switch is read
when ``@triton.jit`` runs, so it is set here, before any kernel module is imported.
"""

from __future__ import annotations

import os
import time
import uuid

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Host-backend processes on one /dev/shm segment share one physical budget (like
# one GPU); a test session gets its own, so concurrent or earlier runs never meet
# (and each test gets its own too: own_host_budget below).
_HOST_SHM = f"kvcached_pytest_{os.getpid()}"
if os.environ.get("KVCACHED_HOST_SHM_NAME") == f"kvcached_pytest_{os.getppid()}":
    os.environ["KVCACHED_HOST_SHM_NAME"] = _HOST_SHM  # a pytest-xdist worker: its own, not its controller's
os.environ.setdefault("KVCACHED_HOST_SHM_NAME", _HOST_SHM)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    try:
        from kvcached import _vmm

        _vmm.unlink_host_shm(_HOST_SHM)
    except Exception:  # the extension may not be built; nothing to clean then
        pass


# Matrices marked ``pairwise`` (parametrized over three or more axes, slow in Triton's interpreter) run a pairwise
# cover of their parameters: every two values of two axes meet in some case that runs. KVCACHED_FULL_MATRIX=1 runs
# every combination (on a GPU they all run: there they are fast).
FULL_MATRIX = HAS_GPU or os.environ.get("KVCACHED_FULL_MATRIX", "0") not in ("", "0")


def _axes(item: pytest.Item) -> set[tuple]:
    """The case's value on each axis: one per parametrize mark (argnames given together are one axis)."""
    out = set()
    for mark in item.iter_markers("parametrize"):
        names = mark.args[0]
        names = [n.strip() for n in (names.split(",") if isinstance(names, str) else names)]
        out.add((names[0], repr(tuple(item.callspec.params[n] for n in names))))
    return out


def _pairwise_skips(items: list[pytest.Item]) -> None:
    from kvcached.kernels.compile_check import pairwise_cover

    matrices: dict[object, list[pytest.Item]] = {}
    for item in items:
        if item.get_closest_marker("pairwise") is not None and hasattr(item, "callspec"):
            matrices.setdefault(getattr(item, "function", item), []).append(item)
    skip = pytest.mark.skip(reason="not in the pairwise cover of this matrix (KVCACHED_FULL_MATRIX=1 runs it)")
    for cases in matrices.values():
        keep = set(pairwise_cover([_axes(c) for c in cases]))
        for i, case in enumerate(cases):
            if i not in keep:
                case.add_marker(skip)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not FULL_MATRIX:
        _pairwise_skips(items)
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a GPU (CUDA or ROCm)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def eventually():
    """``eventually(cond, timeout=10.0)``: polls ``cond()`` every millisecond until it holds (True)
    or the timeout passes (False), for what another thread or process does in its own time."""

    def wait(cond, timeout: float = 10.0) -> bool:
        end = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > end:
                return False
            time.sleep(0.001)
        return True

    return wait


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_GPU else "cpu"


@pytest.fixture(autouse=True)
def own_host_budget(monkeypatch: pytest.MonkeyPatch):
    """A /dev/shm budget segment of the test's own.

    Every test gets one: a budget limit that a test sets (KVCACHED_HOST_MEM_LIMIT_MB) stays
    on its segment, and so do pages its not-yet-collected objects still hold. On one
    session-wide segment those reached later tests, which then passed or failed by test order
    (pytest-xdist reorders tests).
    """
    name = f"kvcached_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("KVCACHED_HOST_SHM_NAME", name)
    yield name
    try:
        from kvcached import _vmm
    except ImportError:  # not built: nothing can have made the segment
        return
    _vmm.unlink_host_shm(name)


@pytest.fixture
def exact_pool_env(monkeypatch: pytest.MonkeyPatch) -> str:
    """A segment name of the test's own and no prealloc reserve, so mapped memory is exactly the
    pages in use; returns the name (KVCACHED_IPC_NAME)."""
    name = f"kvcached_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("KVCACHED_IPC_NAME", name)
    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "0")
    monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", "0")
    monkeypatch.setenv("KVCACHED_PAGE_PREALLOC_ENABLED", "false")
    return name

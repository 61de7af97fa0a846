"""Test set-up shared by every test file.

Without a GPU the Triton kernels run in Triton's interpreter; that switch is read
when ``@triton.jit`` runs, so it is set here, before any kernel module is imported.
"""

from __future__ import annotations

import os
import uuid

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Host-backend processes on one /dev/shm segment share one physical budget (like
# one GPU); a test session gets its own, so concurrent or earlier runs never meet.
_HOST_SHM = f"kvcached_pytest_{os.getpid()}"
os.environ.setdefault("KVCACHED_HOST_SHM_NAME", _HOST_SHM)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    try:
        from kvcached import _vmm

        _vmm.unlink_host_shm(_HOST_SHM)
    except Exception:  # the extension may not be built; nothing to clean then
        pass


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a GPU (CUDA or ROCm)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_GPU else "cpu"


@pytest.fixture
def own_host_budget(monkeypatch: pytest.MonkeyPatch):
    """A /dev/shm budget segment of the test's own, for tests that set host budgets."""
    from kvcached import _vmm

    name = f"kvcached_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("KVCACHED_HOST_SHM_NAME", name)
    yield name
    _vmm.unlink_host_shm(name)

"""HIP backend of kvcached._vmm without a GPU: the runtime loads and says "no device".

CI installs Debian's libamdhip64-dev (ROCm 5 runtime); the test is skipped when no
libamdhip64 can be loaded and when a GPU is present (tests/test_native_cuda.py covers it).
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvcached import errors

vmm = pytest.importorskip("kvcached._vmm")


def _hip_loadable() -> bool:
    for name in ("libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6", "libamdhip64.so.5"):
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            continue
    return False


def test_hip_backend_reports_no_device():
    if not _hip_loadable():
        pytest.skip("no libamdhip64 on this machine (CI installs libamdhip64-dev)")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(vmm.NoDeviceError) as info:
        vmm.Backend("hip")
    msg = str(info.value)
    assert isinstance(info.value, errors.KVCachedError)
    assert "no usable AMD GPU" in msg and "hipGetDeviceCount" in msg and "host" in msg


def test_hip_backend_without_runtime_fails_cleanly():
    if _hip_loadable():
        pytest.skip("libamdhip64 is installed here")
    with pytest.raises(vmm.LibraryNotFoundError, match="cannot open the HIP runtime"):
        vmm.Backend("hip")


def test_hip_bad_device_index():
    if not _hip_loadable() or torch.cuda.is_available():
        pytest.skip("needs libamdhip64 and no GPU")
    with pytest.raises(ValueError, match="device must be >= 0"):
        vmm.Backend("hip", -1)

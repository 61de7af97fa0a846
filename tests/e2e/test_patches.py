"""Which layout and attention backend kvcached picks under vLLM (no engine needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvcached.errors import KVCachedConfigError
from kvcached.integration.vllm import settings

MLA = SimpleNamespace(use_mla=True, use_sparse=False)
MHA = SimpleNamespace(use_mla=False, use_sparse=False)
OURS = SimpleNamespace(name="KVCACHED")
THEIRS = SimpleNamespace(name="ROCM_ATTN")


@pytest.fixture
def on(monkeypatch: pytest.MonkeyPatch):
    def set_platform(rocm: bool, choice: str | None = None, contiguous: str | None = None) -> None:
        monkeypatch.setattr(settings, "is_rocm", lambda: rocm)
        for name, value in (("KVCACHED_ATTENTION_BACKEND", choice), ("KVCACHED_CONTIGUOUS_LAYOUT", contiguous)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)

    return set_platform


def test_rocm_defaults_to_contiguous_with_our_backend(on) -> None:
    on(rocm=True)
    assert settings.contiguous_layout() is True
    assert settings.wants_kvcached_backend(None, MHA)
    assert settings.wants_kvcached_backend(THEIRS, MHA)  # vendor kernels would misread the strided views
    assert not settings.wants_kvcached_backend(None, MLA)


def test_explicit_layout_wins_on_rocm(on) -> None:
    on(rocm=True, contiguous="false")
    assert settings.contiguous_layout() is False
    assert not settings.wants_kvcached_backend(None, MHA)  # per-layer: vendor kernels are fine
    assert settings.wants_kvcached_backend(OURS, MHA)  # asked for by name: always


def test_rocm_without_our_backend_stays_per_layer(on) -> None:
    on(rocm=True, choice="vllm")
    assert settings.contiguous_layout() is False
    assert not settings.wants_kvcached_backend(None, MHA)


def test_nvidia_and_cpu_keep_vllm_backends_unless_asked(on) -> None:
    on(rocm=False)
    assert settings.contiguous_layout() is True
    assert not settings.wants_kvcached_backend(None, MHA)
    assert settings.wants_kvcached_backend(OURS, MHA)
    on(rocm=False, choice="triton")
    assert settings.wants_kvcached_backend(None, MHA)


def test_bad_backend_choice_is_refused(on) -> None:
    on(rocm=False, choice="flashy")
    with pytest.raises(KVCachedConfigError, match="KVCACHED_ATTENTION_BACKEND"):
        settings.attention_backend_choice()


def test_memory_flags_are_read_from_vllms_cache_config() -> None:
    from vllm.config import CacheConfig

    assert settings.memory_flag(CacheConfig()) is None  # vLLM's defaults: elastic, no cap
    assert settings.memory_flag(CacheConfig(gpu_memory_utilization=0.5)) == "gpu_memory_utilization"
    assert settings.memory_flag(CacheConfig(kv_cache_memory_bytes=1 << 30)) == "kv_cache_memory_bytes"
    assert settings.memory_flag(CacheConfig(gpu_memory_utilization=0.5, kv_cache_memory_bytes=1 << 30)) == \
        "kv_cache_memory_bytes"

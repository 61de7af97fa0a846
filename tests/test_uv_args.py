"""scripts/uv_args.py: pip's package sources handed to uv as pip would use them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("uv_args", Path(__file__).parents[1] / "scripts" / "uv_args.py")
uv_args = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(uv_args)


def test_sources_precedence_and_missing_folders(tmp_path: Path):
    wheels, env_wheels, index = tmp_path / "wheels", tmp_path / "env_wheels", tmp_path / "simple"
    for d in (wheels, env_wheels, index):
        d.mkdir()
    constraints = tmp_path / "c.txt"
    constraints.write_text("torch<=2.14.1\n")
    config = "\n".join([
        f":env:.find-links='{env_wheels}'",
        ":env:.default-timeout='180'",
        f"global.constraint='{constraints}'",
        f"global.extra-index-url='file://{index} file://{tmp_path}/absent https://example.org/simple'",
        f"global.find-links='{wheels}'",
        "global.index-url='https://a.example/simple'",
        "install.index-url='https://b.example/simple'",
        "not a setting",
    ])
    assert uv_args.uv_args(config) == [
        "--find-links", str(env_wheels),  # the environment wins over the files
        "--index-url", "https://b.example/simple",  # [install] over [global]
        "--extra-index-url", f"file://{index}", "--extra-index-url", "https://example.org/simple",  # absent: left out
        "--constraint", str(constraints),
    ]


def test_nothing_configured():
    assert uv_args.uv_args("") == []

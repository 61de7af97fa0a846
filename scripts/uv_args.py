"""Print pip's configured package sources (``pip config list``) as ``uv pip install`` options, one a line.

uv reads no pip configuration; a machine whose pip finds wheels in a local folder (this project's CPU
machines: the CPU build of torch), extra indexes or a constraints file must give uv the same, or uv resolves
against PyPI alone (a CUDA torch). Sources that do not exist on this machine (a ``file://`` index folder
that is not there, which pip only warns about) are left out. Used by scripts/dev.sh.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

# pip setting -> uv option
OPTIONS = {"find-links": "--find-links", "index-url": "--index-url", "extra-index-url": "--extra-index-url",
           "constraint": "--constraint"}


def _exists(source: str) -> bool:
    url = urlparse(source)
    if url.scheme in ("http", "https"):
        return True
    return Path(url.path if url.scheme == "file" else source).exists()


def uv_args(pip_config: str) -> list[str]:
    """``pip config list`` lines (``section.key='value'``, sorted by key) -> uv options. As in pip, a setting
    from the environment (``PIP_*``, section ``:env:``) wins over the ``[install]`` section of the files, and
    that over ``[global]``."""
    rank = {":env:": 2, "install": 1}
    settings: dict[str, tuple[int, str]] = {}
    for line in pip_config.splitlines():
        key, sep, value = line.partition("=")
        section, _, name = key.rpartition(".")
        if not sep or name not in OPTIONS:
            continue
        r = rank.get(section, 0)
        if name not in settings or r >= settings[name][0]:
            settings[name] = (r, " ".join(shlex.split(value)))
    out: list[str] = []
    for name, option in OPTIONS.items():
        values = settings.get(name, (0, ""))[1].split()
        if name == "index-url":
            values = values[-1:]
        for value in values:
            if _exists(value):
                out += [option, value]
    return out


def main() -> int:
    config = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    print("\n".join(uv_args(config)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

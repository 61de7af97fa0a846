"""kvcached as a user installs it: a wheel built from a clean copy of the repository, installed into a fresh venv,
used from a directory outside the repository.

How, and why this way (offline, within the test job's time):

* the clean copy holds the files a clone would (``git ls-files --cached --others --exclude-standard``: tracked
  files plus new ones not ignored, so no build output, venv or ``.so`` of the checkout comes along);
* ``pip wheel --no-deps --no-build-isolation --no-index`` builds it with this interpreter's setuptools and pybind11
  (no download; the build compiles the pybind11 extension, most of this test's time);
* ``python -m venv --without-pip`` makes the fresh venv, and this interpreter's pip installs the wheel into it
  (``pip --python VENV install --no-deps --no-index``), which writes the console scripts and entry points as any
  install does;
* kvcached's dependencies (torch, numpy, triton, einops) come from this interpreter's site-packages, put at the
  *end* of the fresh venv's path by a ``.pth`` file (read-only; nothing is installed there). Only the fresh venv's
  own site-packages is a site directory, so the ``.pth`` files over there (the checkout's editable install of
  kvcached) are not run: ``import kvcached`` finds the wheel's copy or nothing, and the test checks which.

Then, from an empty directory with no ``PYTHONPATH``: ``import kvcached`` (and its native module), ``kvctl --help``,
``kvtop --once``, ``kvcached --help``, vLLM's lookup of the ``vllm.general_plugins`` entry point (the way vLLM's
plugin loader finds it: ``importlib.metadata``; vLLM itself is not imported), the elastic-cache demo (``python -m
kvcached demo``), and the two-engine demo's refusal: its tiny models are made by the repository's ``tools/``, and
it must say so instead of failing with a traceback.

Skipped where no C++ compiler is found (the extension cannot be built) or the tree is not a git checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import uuid
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _compiler() -> str | None:
    cxx = os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++"
    return shutil.which(cxx.split()[0])


def _clean_copy(dest: Path) -> None:
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_symlink() or not src.is_file():  # deleted in the working tree, or a link to a local folder
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)


def _user_env(venv: Path) -> dict[str, str]:
    """A shell's environment with the fresh venv activated: nothing of the checkout or of the test session."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KVCACHED_", "PYTEST_")) and k not in ("PYTHONPATH", "ENABLE_KVCACHED", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    return env


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _ok(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 0, f"{out.args} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


@pytest.mark.skipif(_compiler() is None, reason="no C++ compiler (CXX / c++): the wheel's extension cannot be built")
@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="not a git checkout: no clean copy of the tracked files")
def test_wheel_installs_and_runs_outside_the_repository(tmp_path: Path) -> None:
    src, dist, venv, elsewhere = (tmp_path / d for d in ("src", "dist", "venv", "elsewhere"))
    for d in (src, dist, elsewhere):
        d.mkdir()
    _clean_copy(src)
    build_env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_")}  # no KVCACHED_BUILD_BENCH
    _ok(_run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
              "-w", str(dist), str(src)], tmp_path, build_env, timeout=600))
    (wheel,) = dist.glob("kvcached-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("kvcached/_vmm.") and n.endswith(".so") for n in names), names
    assert not [n for n in names if n.startswith(("tests/", "tools/", "benchmarks/", "kvcached/_vmm_bench"))]

    _ok(_run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path, build_env))
    py = venv / "bin" / "python"
    _ok(_run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index",
              str(wheel)], tmp_path, build_env))
    site = Path(_ok(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path,
                         build_env)).strip())
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "_kvcached_test_deps.pth").write_text("".join(f"{p}\n" for p in sorted(deps)))

    env = _user_env(venv)
    shm = f"kvcached_wheel_test_{uuid.uuid4().hex[:8]}"
    env.update(KVCACHED_HOST_SHM_NAME=shm, KVCACHED_IPC_NAME=shm + "_demo")
    try:
        where = _ok(_run([str(py), "-c", "import kvcached, kvcached._vmm as m; print(kvcached.__file__); "
                          "print(m.__file__)"], elsewhere, env)).split()
        assert all(p.startswith(str(site)) for p in where), f"kvcached imported from {where}, not from {site}"

        assert "usage" in _ok(_run([str(venv / "bin" / "kvctl"), "--help"], elsewhere, env)).lower()
        _ok(_run([str(venv / "bin" / "kvtop"), "--once"], elsewhere, env))
        assert "kvcached {demo,ctl,top}" in _ok(_run([str(venv / "bin" / "kvcached"), "--help"], elsewhere, env))

        lookup = ("from importlib.metadata import entry_points\n"
                  "(ep,) = [e for e in entry_points(group='vllm.general_plugins') if e.name == 'kvcached']\n"
                  "register = ep.load()\n"
                  "assert callable(register), register\n"
                  "print(ep.value, ep.dist.locate_file(''))\n")
        value, dist_root = _ok(_run([str(py), "-c", lookup], elsewhere, env)).split()
        assert value == "kvcached.integration.vllm.plugin:register"
        assert Path(dist_root).resolve() == site.resolve(), f"the entry point came from {dist_root}, not the wheel"

        demo = _ok(_run([str(py), "-m", "kvcached", "demo", "--device", "cpu"], elsewhere, env))
        last = demo.strip().splitlines()[-1]
        assert last.startswith("PASS: contiguous:") and "per_layer:" in last, demo[-3000:]

        refused = _run([str(py), "-m", "kvcached.serve_demo"], elsewhere, env)
        assert refused.returncode != 0 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
        assert "tools/tiny_model.py" in refused.stderr and "repository" in refused.stderr, refused.stderr
    finally:
        from kvcached import _vmm

        _vmm.unlink_host_shm(shm)

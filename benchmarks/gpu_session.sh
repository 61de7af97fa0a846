#!/usr/bin/env bash
# One call on a GPU machine: build the extension, run the GPU tests, the benchmarks
# and the compile check; everything lands under $OUT (logs + results tarball).
#   OUT=/tmp/out bash benchmarks/gpu_session.sh [all|tests|vmm|kernels|quick]
set -uo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"
OUT="${OUT:-/tmp/kvcached_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
log() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$OUT/session.log"; }

log "machine"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)"; } | tee -a "$OUT/session.log"

log "build"
# FACTS.md: the image's default g++ breaks ABI with torch; the system one works.
# KVCACHED_BUILD_BENCH=1: also kvcached._vmm_bench, the driver-call timers bench_vmm.py needs.
CC=/usr/bin/gcc CXX=/usr/bin/g++ KVCACHED_BUILD_BENCH=1 python3 setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1 \
  || { tail -30 "$OUT/build.log"; exit 1; }

if [[ "$what" == all || "$what" == tests || "$what" == smoke ]]; then
  log "gpu tests"
  timeout 150 python3 -m pytest -q -m gpu tests -p no:cacheprovider --ignore=tests/e2e --tb=line 2>&1 | tee "$OUT/gpu_tests_full.log" | tail -40
fi
if [[ "$what" == all || "$what" == vmm || "$what" == smoke ]]; then
  log "bench_vmm"
  timeout 90 python3 benchmarks/bench_vmm.py 2>&1 | tail -60 | tee "$OUT/bench_vmm.log"
fi
if [[ "$what" == all || "$what" == kernels || "$what" == quick || "$what" == smoke ]]; then
  log "bench_kernels"
  mode=""; [[ "$what" == quick || "$what" == smoke ]] && mode="--quick"
  timeout 300 python3 benchmarks/bench_kernels.py $mode ${BENCH_ARGS:-} 2>&1 | tail -120 | tee "$OUT/bench_kernels.log"
fi
log "collect"
tar czf "$OUT/results.tar.gz" benchmarks/results
log "done"

#!/usr/bin/env bash
# Issue 38: an fp8-cache kernel patch against this tree's kernels, each at its default tile and at smaller ones.
# Ran on an H100 on 2026-12-08 (benchmarks/results/fp8_products_h100_80gb_hbm3.md) with the decode's fp16 products
# (fp8_decode_fp16.patch, since landed: `git show c814bd3:benchmarks/experiments/fp8_decode_fp16.patch`) and with
# the prefill's query converted to fp16 before the launch (not kept):
#   OUT=/tmp/out FP8_AB_NAME=fp8_prefill_ab FP8_AB_PATCH=benchmarks/experiments/fp8_prefill_fp16.patch \
#     FP8_AB_CASES=1x8192x8192:fp8,8x1024x1024:fp8 FP8_AB_KNOBS=- bash benchmarks/experiments/fp8_decode_ab.sh
# and prepared on 2026-12-08 (not yet run): FP8_AB_PATCH=benchmarks/experiments/fp8_prefill_stage.patch, the prefill's
# query converted inside the kernel and staged through its output rows (docs/attention_tuning.md, last section).
# FP8_AB_PATCH (required): the patch. With FP8_AB_TESTS=1 the patched tree's GPU attention tests run after the
# timings ($OUT/NAME_tests.log), its fp8 decode tile at FP8_AB_TEST_BLOCK_N keys if set (else the tree's).
# One process a tree (benchmarks/experiments/ab_power_cap.py: graph replay, cold and at the power cap, float64
# error of the first two sequences of a decode); the log lands in $OUT/NAME.log (NAME: FP8_AB_NAME, fp8_decode_ab).
# KVCACHED_FULL_MATRIX=1: test_paged_attention.py's fp8 cases outside its pairwise cover run too.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/fp8_ab}
mkdir -p "$OUT"
L="$OUT/${FP8_AB_NAME:-fp8_decode_ab}.log"
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)"; } | tee "$L"
tree=$(mktemp -d)
cp -r kvcached tests "$tree/"  # the patch holds the kernels and their test
p=$PWD/${FP8_AB_PATCH:?FP8_AB_PATCH names the patch to run against this tree}
{ if command -v patch >/dev/null; then patch -d "$tree" -p1 < "$p"; else (cd "$tree" && git apply -v "$p"); fi; } 2>&1 \
  | tee -a "$L" || exit 1
cases=${FP8_AB_CASES:-64x8192x1:fp8,8x8192x1:fp8,4x32768x1:fp8,64x8192x4:fp8}
# the default tile (128 keys, 4 warps: 255 registers and 24 B of stack on sm90), 64 keys (166 registers) and 32
# keys at 2 warps (206 registers); FP8_AB_KNOBS replaces the list
read -ra knobs <<<"${FP8_AB_KNOBS:-- decode_block_n=64 decode_block_n=32,decode_num_warps=2}"
for run in ".:head" "$tree:fp16"; do
  echo "+ python3 benchmarks/experiments/ab_power_cap.py ${run%%:*} ${run##*:} $cases ${knobs[*]}" | tee -a "$L"
  timeout 300 python3 benchmarks/experiments/ab_power_cap.py "${run%%:*}" "${run##*:}" "$cases" "${knobs[@]}" 2>&1 \
    | grep -v Warning | tee -a "$L"
done
if [[ ${FP8_AB_TESTS:-0} == 1 ]]; then
  # the GPU attention tests, and test_paged_attention.py's fp8 cases (the patch's own test among them; that file
  # has no gpu mark: on a GPU machine it runs on the GPU)
  bn=${FP8_AB_TEST_BLOCK_N:-}
  if [[ -n $bn ]]; then
    sed -i "s/^        block_n = 128$/        block_n = $bn/" "$tree/kvcached/kernels/attention_config.py"
    grep -c "^        block_n = $bn$" "$tree/kvcached/kernels/attention_config.py" >/dev/null \
      || { echo "tile edit failed" | tee -a "$L"; exit 1; }
  fi
  echo "+ (patched tree, fp8 decode tile ${bn:-default}) pytest tests/gpu/test_attention_gpu.py; pytest tests/test_paged_attention.py -k fp8" | tee -a "$L"
  cp pyproject.toml "$tree/"  # its pytest markers
  (cd "$tree" && timeout 240 python3 -m pytest -q tests/gpu/test_attention_gpu.py -p no:cacheprovider --tb=short \
    && timeout 120 python3 -m pytest -q tests/test_paged_attention.py -k fp8 -p no:cacheprovider --tb=short) \
    > "${L%.log}_tests.log" 2>&1
  grep -E "passed|failed|error" "${L%.log}_tests.log" | tee -a "$L"
fi
date -u | tee -a "$L"

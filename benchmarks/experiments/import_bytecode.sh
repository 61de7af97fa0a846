#!/usr/bin/env bash
# What byte-compiling the carried bundles (gpu_session.sh) takes off an engine's start: the time to import vLLM's
# OpenAI server, three processes at once (a policy's engines start together), before and after
# `compileall`. Run on the GPU machine from the project root with .gpu-bundle and .serve-wheels carried:
#   OUT=$OUT bash benchmarks/experiments/import_bytecode.sh
set -uo pipefail
OUT="${OUT:-/tmp/kvcached_out}"; mkdir -p "$OUT"
exec > >(tee "$OUT/import_bytecode.log") 2>&1
rm -rf /tmp/vllm-bundle-site /tmp/serve-site
# shellcheck disable=SC1091
source .gpu-bundle/setup.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/serve-site .serve-wheels/*.whl
export PYTHONPATH=$PYTHONPATH:/tmp/serve-site
echo "$(date -u +%F\ %T) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader); nproc $(nproc);" \
  "PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE-unset}"
imp() { python3 -c "import vllm.entrypoints.openai.api_server"; }
since() { awk "BEGIN { printf \"%.1f\", $EPOCHREALTIME - $1 }"; }
one() { local s=$EPOCHREALTIME; imp; echo "$1: one import $(since "$s") s"; }
three() { local s=$EPOCHREALTIME; imp & imp & imp & wait; echo "$1: three at once $(since "$s") s"; }
three "before"  # first: with PYTHONDONTWRITEBYTECODE unset, the first import writes byte-code itself
s=$EPOCHREALTIME; python3 -m compileall -q -j 0 /tmp/vllm-bundle-site /tmp/serve-site >/dev/null 2>&1
echo "compileall $(since "$s") s"
three "after"; one "after"

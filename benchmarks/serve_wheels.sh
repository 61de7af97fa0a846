#!/usr/bin/env bash
# Wheels that `vllm serve` (vLLM 0.24's OpenAI server) imports and that neither the GPU machine's image nor the
# vLLM bundle (../shared/tools/vllm-gpu-bundle) has: made here, on a machine with package access, for the GPU
# machine's Python 3.12 on x86_64. benchmarks/gpu_session.sh (step serve or coserving) installs them there.
#   bash benchmarks/serve_wheels.sh [OUTDIR]      (default .serve-wheels, git-ignored; ~1.4 MiB)
# Found by importing vllm.entrypoints.openai.api_server with only the image's packages and the bundle's:
# uvicorn, watchfiles, model_hosting_container_standards (+ jmespath, supervisor), openai's jiter and distro,
# prometheus_fastapi_instrumentator, setproctitle.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.serve-wheels}"
mkdir -p "$out"
plat=()
for n in 5 17 24 27 28 31 34 35; do plat+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$out" \
  uvicorn==0.55.0 watchfiles==1.3.0 model-hosting-container-standards==0.1.16 jmespath==1.1.0 supervisor==4.3.0 \
  prometheus-fastapi-instrumentator==8.1.0 setproctitle==1.3.8 jiter==0.19.0 distro==1.9.0
ls "$out"

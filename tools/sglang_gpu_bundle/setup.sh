# Source on the GPU machine from the project root: source .sgl-bundle/setup.sh (bundle: tools/sglang_gpu_bundle;
# .sgl-bundle-2 beside it, carried in an earlier call)
# Unpacks once into /tmp/sglang-bundle-site (kept while the machine stays warm) and puts SGLang on PYTHONPATH.
B=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd); S=${SGLANG_BUNDLE_SITE:-/tmp/sglang-bundle-site}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 SGLANG_PLUGINS=kvcached
if [ ! -f "$S/.ok" ]; then
  rm -rf "$S"; mkdir -p "$S"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$S" "$B"/deps/*.whl \
    "$B-2"/deps/*.whl &&
  tar -xJf "$B/sglang_py.tar.xz" -C "$S" &&
  xz -dc "$B/sgl_common_ops.so.xz" > "$S/sgl_kernel/sm90/common_ops.abi3.so" &&
  touch "$S/.ok" || { echo "sglang bundle: unpack failed"; return 1; }
fi
export PYTHONPATH=$S${PYTHONPATH:+:$PYTHONPATH}

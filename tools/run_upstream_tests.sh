#!/usr/bin/env bash
# Run the existing kvcached project's own tests against THIS package.
#
# The two files are not part of this repository (they belong to ovg-project/kvcached);
# this script fetches nothing. Get them with a clone elsewhere, e.g.
#     git clone https://github.com/ovg-project/kvcached /tmp/upstream-kvcached
# and run, from this repository's root:
#     tools/run_upstream_tests.sh /tmp/upstream-kvcached/tests
# (or pass the two file paths; PYTHON=/path/to/python picks the interpreter). Files:
#     test_kvcache_manager.py           (upstream: 4 passed, 1 skipped)
#     test_paged_allocator_aliasing.py  (upstream: 2 passed)
#
# With a GPU (torch.cuda.is_available()) the files run unchanged. Without one
# (our host backend), each file is copied to a temporary folder and exactly one line
# is changed, the device string:
#     test_kvcache_manager.py:          DEVICE = f"cuda:{TP_RANK}"  ->  DEVICE = "cpu"
#     test_paged_allocator_aliasing.py: DEVICE           = "cuda:0"  ->  DEVICE = "cpu"
# The files also call torch.cuda.set_device() and torch.cuda.synchronize(), which a
# CPU-only torch refuses; a pytest plugin written next to the copies (loaded with -p)
# makes those two calls no-ops on the host. Nothing else is touched.
#
# Known result here: test_paged_allocator_aliasing.py uses SGLang page size 16 on the
# contiguous layout, which needs the token-major contiguous layout (issue 9 item 3);
# until then its fixture raises KVCachedConfigError. With KVCACHED_CONTIGUOUS_LAYOUT=false
# in the environment it runs on the per-layer layout instead.
set -euo pipefail

PY=${PYTHON:-python}
if [ $# -eq 0 ]; then
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
  exit 2
fi
files=()
for arg in "$@"; do
  if [ -d "$arg" ]; then
    for f in test_kvcache_manager.py test_paged_allocator_aliasing.py; do
      [ -f "$arg/$f" ] && files+=("$arg/$f")
    done
  elif [ -f "$arg" ]; then
    files+=("$arg")
  else
    echo "no such file or folder: $arg" >&2
    exit 2
  fi
done
[ ${#files[@]} -gt 0 ] || { echo "none of the two test files found in: $*" >&2; exit 2; }

root=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's kvcached, not an installed one

if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  cd "$root"
  exec "$PY" -m pytest -q -p no:cacheprovider "${files[@]}"
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat > "$tmp/host_cuda_noops.py" <<'PLUGIN'
"""Loaded with -p on a host without CUDA: torch.cuda.set_device/synchronize do nothing."""
import torch

torch.cuda.set_device = lambda *a, **k: None
torch.cuda.synchronize = lambda *a, **k: None
PLUGIN
copies=()
for f in "${files[@]}"; do
  out="$tmp/$(basename "$f")"
  # the one changed line: DEVICE = <a cuda string>  ->  DEVICE = "cpu"
  sed -E 's/^DEVICE( *)= *f?"cuda:[^"]*"$/DEVICE\1= "cpu"/' "$f" > "$out"
  if ! grep -qE '^DEVICE *= "cpu"$' "$out"; then
    echo "$f: no 'DEVICE = \"cuda:...\"' line found to change; is it the expected file?" >&2
    exit 2
  fi
  [ "$(diff "$f" "$out" | grep -c '^>')" -eq 1 ] || { echo "$f: more than one line would change" >&2; exit 2; }
  copies+=("$out")
done
cd "$tmp"
PYTHONPATH="$tmp:$PYTHONPATH" "$PY" -m pytest -q -p no:cacheprovider -p host_cuda_noops --rootdir "$tmp" "${copies[@]}"

#!/usr/bin/env bash
# Run the existing kvcached project's own tests against THIS package.
#
# The files are not part of this repository (they belong to ovg-project/kvcached);
# this script fetches nothing. Get them with a clone elsewhere, e.g.
#     git clone https://github.com/ovg-project/kvcached /tmp/upstream-kvcached
# and run, from this repository's root:
#     tools/run_upstream_tests.sh /tmp/upstream-kvcached/tests
# (or pass file paths; PYTHON=/path/to/python picks the interpreter). Files (as of e8e6406):
#     test_kvcache_manager.py           (upstream: 4 passed, 1 skipped)
#     test_paged_allocator_aliasing.py  (upstream: 2 passed)
#     test_memory_limit_control.py      (kvcached.control, kvcached.pool_registry)
#     test_observability.py             (kvcached.observability, kvcached.pool_registry)
#     test_get_max_cached_blocks.py     (kvcached.integration.vllm.patches._get_max_cached_blocks)
#
# Lines changed: none in the last three; in the first two, without a GPU only, the device
# string (each file is copied to a temporary folder and exactly that one line is changed):
#     test_kvcache_manager.py:          DEVICE = f"cuda:{TP_RANK}"  ->  DEVICE = "cpu"
#     test_paged_allocator_aliasing.py: DEVICE           = "cuda:0"  ->  DEVICE = "cpu"
# Those two files also call torch.cuda.set_device() and torch.cuda.synchronize(), which a
# CPU-only torch refuses; a pytest plugin written next to the copies (loaded with -p)
# makes those two calls no-ops on the host. Nothing else is touched.
#
# Tests left out (deselected), because they assert on the existing kvcached's internals, not on
# behaviour (this package has the same behaviour under its own tests, named after each):
#     test_memory_limit_control.py: the six tests that build a manager with object.__new__ and set its
#         private fields (_memory_limit_*, a page_allocator with resize/get_page_state, in_shrink):
#         test_idle_limit_applies_immediately_through_resize, test_active_limit_defers_without_revoking_
#         and_converges_on_release, test_limit_can_regrow_within_the_original_reservation,
#         test_limit_is_clamped_to_the_original_reservation, test_zero_limit_drains_an_idle_pool,
#         test_stale_update_is_ignored_and_revision_reuse_must_match  (ours: tests/test_control.py);
#     test_observability.py: test_sglang_manager_factory_registers_and_shutdown_clears_pool and
#         test_vllm_manager_factory_registers_and_shutdown_clears_pool, which load interfaces.py by a
#         path next to the test file with kvcached.vmm_ops / utils / kv_cache_manager / tp_ipc_util
#         replaced by stand-ins holding only the existing kvcached's internal names
#         (ours: test_integrations_tag_their_pools_and_shutdown_forgets_them in tests/test_observability.py).
#
# The aliasing file is a script (upstream runs it with python, not pytest), and so is it run
# here. On the host, KVCACHED_HOST_MEM_LIMIT_MB defaults to 32768 (the manager test's
# virtual KV tensors; nothing is allocated until written).
set -euo pipefail

PY=${PYTHON:-python}
if [ $# -eq 0 ]; then
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
  exit 2
fi
KNOWN="test_kvcache_manager.py test_paged_allocator_aliasing.py test_memory_limit_control.py test_observability.py
       test_get_max_cached_blocks.py"
files=()
for arg in "$@"; do
  if [ -d "$arg" ]; then
    for f in $KNOWN; do
      [ -f "$arg/$f" ] && files+=("$arg/$f")
    done
  elif [ -f "$arg" ]; then
    files+=("$arg")
  else
    echo "no such file or folder: $arg" >&2
    exit 2
  fi
done
[ ${#files[@]} -gt 0 ] || { echo "none of the test files ($KNOWN) found in: $*" >&2; exit 2; }

root=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's kvcached, not an installed one

# test_kvcache_manager.py is a pytest file; test_paged_allocator_aliasing.py is a script (it prints
# "Results: N passed, M failed" and exits non-zero on a failure), as upstream runs them.
run_all() {  # $1: extra pytest/python setup (a -p plugin, or nothing); then the files
  local plugin=$1; shift
  local rc=0
  for f in "$@"; do
    case "$(basename "$f")" in
      test_paged_allocator_aliasing.py)
        "$PY" -c "import runpy, sys; ${plugin:+import $plugin;} sys.argv=[sys.argv[1]]; runpy.run_path(sys.argv[0], run_name='__main__')" "$f" || rc=1 ;;
      test_memory_limit_control.py)
        "$PY" -m pytest -q -p no:cacheprovider "$f" -k "test_instance_limit" || rc=1 ;;
      test_observability.py)
        "$PY" -m pytest -q -p no:cacheprovider "$f" -k "not manager_factory_registers" || rc=1 ;;
      test_get_max_cached_blocks.py) "$PY" -m pytest -q -p no:cacheprovider "$f" || rc=1 ;;
      *) "$PY" -m pytest -q -p no:cacheprovider ${plugin:+-p $plugin} "$f" || rc=1 ;;
    esac
  done
  return $rc
}

if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  cd "$root"
  run_all "" "${files[@]}"
  exit $?
fi
# the host backend's virtual capacity is its budget: upstream's 16 layers x 65,536 blocks need 32 GiB of it
# (only what is written gets memory)
export KVCACHED_HOST_MEM_LIMIT_MB=${KVCACHED_HOST_MEM_LIMIT_MB:-32768}

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
  case "$(basename "$f")" in
    test_kvcache_manager.py|test_paged_allocator_aliasing.py) ;;
    *) cp "$f" "$out"; copies+=("$out"); continue ;;  # no line changed
  esac
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
PYTHONPATH="$tmp:$PYTHONPATH" run_all host_cuda_noops "${copies[@]}"

#!/usr/bin/env bash
# h6 (attention tuning) device run; temporary, deleted after the session.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
T_TESTS="${T_TESTS:-90}"; T_TUNE="${T_TUNE:-130}"; PARTS="${PARTS:-host,decode,prefill}"; TESTS="${TESTS:-tests/gpu/test_attention_gpu.py}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
if [ "$T_TESTS" -gt 0 ]; then
  python3 -m pytest -q --collect-only -m gpu $TESTS -p no:cacheprovider 2>/dev/null | grep '::' > /tmp/ids.txt
  echo "collected $(wc -l < /tmp/ids.txt) tests"
  split -n r/${SHARDS:-8} /tmp/ids.txt /tmp/shard.
  for f in /tmp/shard.*; do
    timeout "$T_TESTS" python3 -m pytest -q -p no:cacheprovider -rf --tb=line $(cat $f) > "$OUT/test_$(basename $f).log" 2>&1 &
  done
  wait
  cat "$OUT"/test_shard.*.log | grep -E "passed|failed|FAILED|Error|error" | sort | uniq -c | sort -rn | head -40
fi
timeout "$T_TUNE" python3 benchmarks/tune_attention.py --parts "$PARTS" --out "$OUT" > "$OUT/tune.log" 2>&1
echo "tune rc=$?"
grep -vE "^\| (1|8|64|256) \| (32|64|128) \|" "$OUT/tune.log" | tail -60

"""Host time of one prefix-cache eviction in kvcached's vLLM block pool (CPU host backend, no GPU needed).

    python3 benchmarks/experiments/evict_cost.py

A 1000-block cache (25 finished requests of 40 blocks, 2-layer geometry of tests/e2e/test_block_pool.py) is
evicted 40 blocks at a time, as a serving engine past its KVCACHED_MAX_CACHED_TOKENS bound does at every finished
request; prints the mean time a call. docs/serving_overhead.md quotes it before and after the lazy LRU walk.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "e2e")]
os.environ["KVCACHED_HOST_MEM_LIMIT_MB"] = "512"


class _Env:  # what _make_pool's monkeypatch does, without its 64 MiB host limit (1000 blocks need more)
    def setenv(self, key: str, value: str) -> None:
        if key != "KVCACHED_HOST_MEM_LIMIT_MB":
            os.environ[key] = value


def main() -> None:
    from test_block_pool import _cache, _make_pool

    pool = _make_pool(_Env(), max_cached_tokens=-1)
    requests = [pool.get_new_blocks(40) for _ in range(25)]
    for blocks in requests:
        _cache(pool, blocks)
        pool.free_blocks(blocks)
    cached = pool.free_block_queue.num_free_blocks
    t0, calls = time.perf_counter(), 0
    while pool.free_block_queue.num_free_blocks:
        pool._evict(40)
        calls += 1
    took = (time.perf_counter() - t0) / calls * 1e6
    print(f"evicting {cached} cached blocks 40 at a time: {calls} calls, {took:.0f} us a call")
    pool.close()


if __name__ == "__main__":
    main()

"""Freeing blocks that queued kernels still read: the hazard without deferred freeing, and its fix.

An engine that schedules ahead frees a finished request's blocks while the step it
already launched still reads them. Here the queued reads are a sleep kernel followed
by sums over every mapped page; the blocks are freed (and the pool trimmed, so an
empty page is unmapped at once) right after the launch. Each case runs in its own
process: a read of an unmapped page is an illegal address, which poisons the context.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.gpu

SCENARIO = textwrap.dedent("""
    import json, sys, time
    import torch
    from kvcached import vmm_ops
    from kvcached.kv_cache_manager import KVCacheManager

    deferred = sys.argv[1] == "1"
    vmm_ops.init_kvcached("cuda:0", contiguous_layout=True)
    pages = 64
    vmm_ops.create_kv_tensors(2 * pages * (2 << 20), 1, "cuda:0", num_layers=1)
    # one layer, K and V; blocks of 16 tokens x 8 KiB: 16 blocks per 2 MiB page
    mgr = KVCacheManager(num_blocks=16 * pages, block_size=16, cell_size=8192, num_layers=1,
                         deferred_free=deferred)
    blocks = mgr.alloc(16 * pages)
    raw = vmm_ops.get_group(0).tensors[0]
    data = raw[: mgr.get_mapped_memory_size()].view(torch.int32)
    data.fill_(1)
    expected = data.numel()
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)  # about 0.2 s of queued device work before the reads
    sums = [data.sum() for _ in range(8)]
    t0 = time.perf_counter()
    mgr.free(blocks)
    mgr.trim()
    free_s = time.perf_counter() - t0
    mapped_while_queued = int(mgr.mapped_bytes)
    try:
        torch.cuda.synchronize()
        values = [int(s) for s in sums]
        fault = None
    except RuntimeError as exc:
        values, fault = [], str(exc).splitlines()[0]
    result = {"expected": expected, "values": values, "fault": fault, "free_s": free_s,
              "mapped_while_queued": mapped_while_queued}
    if fault is None:
        mgr.available_size()  # the pool's next call gives the blocks back
        mgr.trim()
        result["mapped_after"] = int(mgr.mapped_bytes)
    print("RESULT " + json.dumps(result), flush=True)
""")


def _run(deferred: bool) -> dict:
    env = dict(os.environ, KVCACHED_PAGE_PREALLOC_ENABLED="false", KVCACHED_MIN_RESERVED_PAGES="0",
               KVCACHED_MAX_RESERVED_PAGES="0", KVCACHED_IPC_NAME=f"kvcached_unmap_test_{int(deferred)}")
    proc = subprocess.run([sys.executable, "-c", SCENARIO, "1" if deferred else "0"], env=env, capture_output=True,
                          text=True, timeout=300)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise AssertionError(f"scenario printed no result (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-3000:]}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_unmapping_under_queued_reads_is_a_hazard_without_deferral() -> None:
    r = _run(deferred=False)
    print(r)
    wrong = [v for v in r["values"] if v != r["expected"]]
    assert r["fault"] is not None or wrong, (
        f"freeing immediately did not disturb the queued reads ({r}); the driver must have waited for them"
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_deferred_free_keeps_pages_until_the_reads_ran() -> None:
    r = _run(deferred=True)
    print(r)
    assert r["fault"] is None, r
    assert r["values"] == [r["expected"]] * 8, r
    assert r["mapped_while_queued"] >= r["expected"] * 4, "the pages were unmapped while reads were queued"
    assert r["mapped_after"] == 0, "the blocks never went back to the pool once the reads had run"
    assert r["free_s"] < 0.05, f"free() waited for the device ({r['free_s']:.3f} s): it must not sync"

#!/usr/bin/env python
"""Ours and FA3 timed in turn on 64 x 8k short queries, with wall-clock stamps to match against nvidia-smi samples.

    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active \\
        --format=csv -lms 100 > smi.csv &
    python3 benchmarks/experiments/probe_power_cap.py 16,8,1

For each query length: ours on inputs built as ``sweep_decode.py`` builds them (oursA) and as ``bench_peers.py``
does (oursB), FA3 (vLLM's CUDA build) on B, each timed as ``bench_peers`` times (a fresh graph, ``do_bench``
median), three rounds in turn, then ours again after 3 s idle. Each line starts with ``time.time()``: the
samples in the last 0.14 s before it show the clock the call ran at (``kv_offsets_h200.md`` section 1).
"""

from __future__ import annotations

import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import _bench_common as bc  # noqa: E402
import torch  # noqa: E402
from _bench_common import HEAD  # noqa: E402

from kvcached.kernels import paged_attention  # noqa: E402

FA3 = "FA3 paged (peer)"
B, C = 64, 8192


def stamp(msg: str) -> None:
    print(f"{time.time():.3f} {msg}", flush=True)


def probe(n: int, fa3, dev: torch.device) -> None:
    q, kc, vc, table, lens, qsl = bc.sweep_batch([C] * B, n, C, dev)
    name = f"short q={n} {B}x{C}" if n > 1 else f"decode {B}x{C}"  # bench_peers' case names seed its inputs
    qb, tb, lb, qslb, _, kb, vb = bc.paged_batch([n] * B, [C] * B, zlib.crc32(name.encode()), dev)
    fns = {
        "oursA": lambda: paged_attention(q, kc, vc, table, lens, qsl, max_query_len=n, max_seq_len=C,
                                         scale=HEAD**-0.5),
        "oursB": lambda: paged_attention(qb, kb, vb, tb, lb, qslb, max_query_len=n, max_seq_len=C, scale=HEAD**-0.5),
    }
    if not isinstance(fa3, Exception):
        fns["fa3B"] = bc.peer_call(FA3, fa3, qb, kb, vb, tb, lb, qslb, n, C)
    for f in fns.values():
        f()
    torch.cuda.synchronize()
    for r in range(3):
        for name, f in fns.items():
            stamp(f"start {name} q={n} r={r}")
            stamp(f"RESULT {name} q={n} r={r} us={bc.graph_time_us(f, dev):.1f}")
    time.sleep(3)
    stamp(f"idle-then oursB q={n}")
    stamp(f"RESULT oursB-afteridle q={n} us={bc.graph_time_us(fns['oursB'], dev):.1f}")


def main() -> None:
    dev = torch.device("cuda")
    fa3 = bc.vllm_peers().get(FA3, RuntimeError("no FA3"))
    for n in (int(x) for x in sys.argv[1].split(",")):
        probe(n, fa3, dev)
        bc.free_memory(dev)


if __name__ == "__main__":
    main()

"""benchmarks/bench_peers.py runs end to end on the CPU (Triton interpreter, tiny shapes, vLLM's peers absent)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("decode", "uneven", "short", "mixed", "prefill")


def test_bench_peers_quick_on_cpu(tmp_path: Path) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_peers.py"), "--quick", "--device", "cpu",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    text = (tmp_path / "peers_cpu.md").read_text()
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("| ")]
    rows = [c for c in cells if len(c) == 10 and c[0] not in ("row", "---")]  # the main table
    for kind in KINDS:
        assert any(r[0].startswith(kind + " ") for r in rows), f"no {kind} row in\n{text}"
    ours = [r for r in rows if r[1] == "ours"]
    assert {r[2] for r in ours} == {"per-layer", "contiguous"}
    assert len(ours) == 2 * len({r[0] for r in rows})
    assert all(r[8].startswith("ok ") for r in ours), [r for r in ours if not r[8].startswith("ok ")]
    assert all(r[8].startswith("absent: ") for r in rows if r[1].startswith(("vLLM", "FA3")))
    sdpa = [r for r in rows if r[1].startswith("SDPA")]
    assert all(r[8].startswith("ok ") for r in sdpa if r[0].startswith(("decode", "prefill"))
               and not r[0].endswith(" fp8")), sdpa
    fp8 = [r for r in ours if r[0].endswith(" fp8")]  # an fp8 KV cache, read with its scales
    assert {r[2] for r in fp8} == {"per-layer", "contiguous"} and all(r[8].startswith("ok ") for r in fp8), fp8
    assert "correctness, ours: all checks passed" in text


def test_vllm_triton_peer_reads_fp8_with_its_scales() -> None:
    """vLLM releases whose unified_attention takes ``kv_quant_mode`` apply per-tensor descales only in its
    FP8_PER_TENSOR mode: the peer call must ask for it with an fp8 cache (not without one, nor where the release
    has no such parameter)."""
    import torch

    kv = pytest.importorskip("vllm.v1.kv_cache_interface")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _bench_common import peer_call

    seen: list[dict] = []

    def newer(*, q, kv_quant_mode=kv.KVQuantMode.NONE, **kw):
        seen.append({"kv_quant_mode": kv_quant_mode, **kw})

    def older(*, q, **kw):
        seen.append(kw)

    q, kc = torch.zeros(4, 32, 128), torch.zeros(2, 16, 8, 128)
    lens, scales = torch.tensor([4]), {"k": torch.tensor([0.5]), "v": torch.tensor([0.25])}
    args = (q, kc, kc, torch.zeros(1, 2, dtype=torch.int32), lens, torch.tensor([0, 4]), 4, 4)
    peer_call("vLLM Triton unified (peer)", newer, *args, scales=scales)()
    peer_call("vLLM Triton unified (peer)", newer, *args)()
    peer_call("vLLM Triton unified (peer)", older, *args, scales=scales)()
    assert seen[0]["kv_quant_mode"] == kv.KVQuantMode.FP8_PER_TENSOR
    assert seen[0]["k_descale"].shape == (1, 8) and float(seen[0]["v_descale"][0, 0]) == 0.25
    assert seen[1]["kv_quant_mode"] == kv.KVQuantMode.NONE and seen[1]["k_descale"] is None
    assert "kv_quant_mode" not in seen[2] and seen[2]["k_descale"] is not None

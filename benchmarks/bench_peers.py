#!/usr/bin/env python
"""Our paged attention against its peers: vLLM's Triton unified attention, FA3 and dense SDPA, on the same data.

    python benchmarks/bench_peers.py                  # every case (GPU)
    python benchmarks/bench_peers.py --quick          # fewer shapes
    python benchmarks/bench_peers.py --only decode,mixed   # some kinds (peers_<gpu>_<kinds>.md)
    python benchmarks/bench_peers.py --quick --device cpu  # plumbing only (Triton interpreter, peers absent)

Every case: bf16, 32 query / 8 KV heads, head 128, block 16, causal, random data, block tables
from randperm; one call covers the whole batch (query_start_loc over every sequence). Ours runs
on the per-layer cache and on the last layer of a contiguous cache holding the same values;
vLLM's Triton unified attention and FA3 (from vLLM's CUDA build) run on both too. Dense SDPA
(flash backend, K/V gathered into contiguous tensors, enable_gqa) runs for the decode and
prefill cases only, in a child process that never imports vLLM (vLLM's import slows SDPA,
FACTS.md): this script first runs itself with --sdpa-only --json PATH.

Ours is called with max_query_len and min_query_len from the case's query lengths, as kvcached's vLLM
backend calls it (FA3 gets max_seqlen_q likewise).

The fp8 rows (decode 64 x 8k and prefill 1 x 8k, issue 38): the same random values in an e4m3 KV cache with one
scale for K and one for V (amax over the format's largest value), read with those scales by ours and by vLLM's
Triton attention (bf16 query); FA3's fp8 path also takes the query in fp8 (vLLM quantizes it for FA3), so its
check is against a reference with that query. No dense SDPA row for them.

Timing: each (case, impl) 3 times, each a fresh CUDA-graph capture timed by do_bench (median;
eager do_bench where no graph can be made), a case's implementations in turn (``time_in_turn``: the GPU's
clock falls at its power cap); the table gives the median of the 3 and their min-max (in the interpreter,
once: plumbing only). Each output is first checked against a float64
reference on a slice (the first two sequences; for long queries their first and last 64 tokens).
Counting: bytes = K+V of every sequence read once + query in and output out (decode, uneven,
short, mixed); prefill FLOPs = 4*H*D*n(n+1)/2 per sequence (causal).
Writes benchmarks/results/peers_<gpu>.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

KINDS = ("decode", "uneven", "short", "mixed", "prefill")
SDPA_KINDS = ("decode", "prefill")
VLLM, FA3 = "vLLM Triton unified (peer)", "FA3 paged (peer)"  # the names bc.vllm_peers() gives
MEM_GB = 100.0  # the contiguous cache gets as many layers (2..8) as fit in this

import _bench_common as bc  # noqa: E402  (torch only: the kernels come once the device is known)
from _bench_common import BLOCK, HEAD, KV_HEADS, Q_HEADS  # noqa: E402


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="comma-separated kinds of " + ",".join(KINDS))
    ap.add_argument("--sdpa-only", action="store_true", help="(internal) time dense SDPA only, without vLLM")
    ap.add_argument("--json", default="", help="(internal) where --sdpa-only writes its results")
    return bc.bench_args(ap)  # --quick, --out, --device


ARGS = parse_args()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kvcached.kernels import paged_attention  # noqa: E402
from kvcached.kernels.paged_attention import device_target, target_fp8  # noqa: E402
from kvcached.kernels.reference import paged_attention_ref  # noqa: E402
from kvcached.layout import Layout  # noqa: E402

DEV = torch.device(ARGS.device or ("cuda" if torch.cuda.is_available() else "cpu"))
GPU = DEV.type == "cuda"
# the fp8 KV dtype the dispatcher takes here (e4m3fn; e4m3fnuz on gfx942); None where the target has none
FP8 = (target_fp8(device_target(DEV)) or [None])[0] if GPU else torch.float8_e4m3fn
LAYOUTS = {Layout.PER_LAYER: "per-layer", Layout.CONTIGUOUS: "contiguous"}


@dataclass
class Case:
    kind: str
    name: str
    q_lens: list[int]
    seq_lens: list[int]
    check_seqs: tuple[int, ...] = (0, 1)
    fp8: bool = False  # the KV cache in fp8 (e4m3, per-tensor scales), issue 38's fp8 rows

    def work(self) -> tuple[float, str]:
        """Bytes (memory-bound kinds) or FLOPs (prefill) of one call, and the rate's unit."""
        if self.kind == "prefill":
            return sum(4 * Q_HEADS * HEAD * n * (n + 1) / 2 for n in self.q_lens), "TFLOP/s"
        kv_bytes = 1 if self.fp8 else 2
        return (sum(self.seq_lens) * KV_HEADS * HEAD * 2 * kv_bytes + sum(self.q_lens) * Q_HEADS * HEAD * 2 * 2), "TB/s"


def make_cases(kinds: list[str]) -> list[Case]:
    quick = ARGS.quick
    if GPU:
        ctx, batches, qs = 8192, (1, 64) if quick else (1, 8, 64, 256), (4,) if quick else (2, 4, 8, 16)
        n_uneven, lo, hi = 64, 256, 16384
        chunks, new, prior, decodes = 4, 1024, 3072, 60
        prefills = [(1, 8192)] if quick else [(1, 8192), (8, 1024), (1, 32768)]  # 1 x 32k: issue 38's long prefill
    else:  # interpreter: tiny shapes, plumbing only (one case of each kind: every call costs seconds there)
        ctx, batches, qs = 64, (2,), (4,)
        n_uneven, lo, hi = 3, 16, 64
        chunks, new, prior, decodes = 1, 8, 24, 2
        prefills = [(2, 16)]
    out = [Case("decode", f"decode {b}x{ctx}", [1] * b, [ctx] * b) for b in batches]
    if GPU and not quick:  # issue 10's third long-context small batch, beside 1 and 8 x 8k
        out.append(Case("decode", "decode 4x32768", [1] * 4, [32768] * 4))
    lens = torch.randint(lo, hi + 1, (n_uneven,), generator=torch.Generator().manual_seed(0)).tolist()
    out.append(Case("uneven", f"uneven {n_uneven}x{lo}..{hi}", [1] * n_uneven, lens))
    n_short = 64 if GPU else 2
    out += [Case("short", f"short q={n} {n_short}x{ctx}", [n] * n_short, [ctx] * n_short) for n in qs]
    out.append(Case("mixed", f"mixed {chunks}x{new}(+{prior}) + {decodes}x{ctx}", [new] * chunks + [1] * decodes,
                    [prior + new] * chunks + [ctx] * decodes, (0, chunks)))
    out += [Case("prefill", f"prefill {b}x{n}", [n] * b, [n] * b, (0, b - 1) if b > 1 else (0,)) for b, n in prefills]
    if FP8 is not None and not (GPU and quick):  # fp8 KV against FA3's fp8 path (and vLLM Triton's)
        b, n = (64, ctx) if GPU else (2, ctx)
        out.append(Case("decode", f"decode {b}x{n} fp8", [1] * b, [n] * b, fp8=True))
        if GPU:
            out.append(Case("prefill", "prefill 1x8192 fp8", [8192], [8192], (0,), fp8=True))
    return [c for c in out if c.kind in kinds]


# -- data, reference, timing ------------------------------------------------------------------
def inputs(case: Case):
    """Query, block table, lengths, a per-layer cache and its fp8 scales; the same values in every process (seeded
    by name). An fp8 case's cache holds the bf16 values quantized with one scale each for K and V ({"k", "v"};
    {} for a bf16 case)."""
    q, table, lens, qsl, bases, kc, vc = bc.paged_batch(case.q_lens, case.seq_lens, zlib.crc32(case.name.encode()),
                                                        DEV)
    if not case.fp8:
        return q, table, lens, qsl, bases, kc, vc, {}
    bases8, k8, v8 = bc.kv_cache(Layout.PER_LAYER, table.numel(), 1, DEV, dtype=FP8)
    scales = {}
    for name, src, dst in (("k", kc, k8), ("v", vc, v8)):
        values, scales[name] = bc.fp8_quantize(src, FP8)
        dst[:len(values)].copy_(values)  # an fp8 page holds twice the blocks: the view may be longer
    return q, table, lens, qsl, bases8, k8, v8, scales


def reference(case: Case, q, kc, vc, table, qsl, w: int = 64, scales: dict | None = None):
    """Float64 output of the check_seqs sequences (whole, or their first and last w query tokens) and its rows
    (an fp8 cache read with ``scales``)."""
    scales = scales or {}
    rows, want = [], []
    starts = qsl.tolist()
    for i in [i for i in case.check_seqs if i < len(case.seq_lens)]:
        lo, hi = starts[i], starts[i + 1]
        for a, b in [(lo, hi)] if hi - lo <= 2 * w else [(lo, lo + w), (hi - w, hi)]:
            seen = case.seq_lens[i] - (hi - b)  # keys the piece's last token sees
            want.append(paged_attention_ref(q[a:b], kc, vc, table[i:i + 1],
                                            torch.tensor([seen], dtype=torch.int32, device=DEV),
                                            torch.tensor([0, b - a], dtype=torch.int32, device=DEV),
                                            scale=HEAD**-0.5, k_scale=scales.get("k"), v_scale=scales.get("v")))
            rows.append(torch.arange(a, b))
    return torch.cat(rows).to(DEV), torch.cat(want)


def measure(fn, rows, want, what: str, pack=lambda o: o) -> dict:
    """Check fn's output on the reference rows, then time it 3 times (a fresh graph capture each). Off the GPU
    (the interpreter, whose times mean nothing) the checked call's own time stands, for the plumbing."""
    res = check_call(fn, rows, want, what, pack)
    return time_in_turn([(res, fn)])[0]


def check_call(fn, rows, want, what: str, pack=lambda o: o) -> dict:
    """fn's output checked on the reference rows; the call's own time stands until :func:`time_in_turn`."""
    t0 = time.perf_counter()
    got = fn()
    first = (time.perf_counter() - t0) * 1e6
    return {"t": first, "lo": first, "hi": first, "check": bc.close(pack(got)[rows], want, what, bad="BAD"),
            "note": ""}


def time_in_turn(calls: list[tuple[dict, object]]) -> list[dict]:
    """Each checked call timed 3 times (a fresh graph capture each), the calls in turn: under sustained load an
    H200 reaches its 700 W cap within a second and its SM clock falls (1980 -> 1200-1700 MHz; throttle reason
    SW power cap, benchmarks/results/kv_offsets_h200.md), which slows a kernel bound by its instructions and not
    one bound by memory. Timed one after another, each implementation met another point of that descent; in turn,
    every one of a case's implementations sees the same load before it. Off the GPU the checked times stand."""
    if not GPU:
        return [res for res, _ in calls]
    times: list[list[float]] = [[] for _ in calls]
    notes = ["" for _ in calls]
    for _ in range(3):
        for i, (_, fn) in enumerate(calls):
            try:
                t = bc.graph_time_us(fn, DEV)
            except Exception as exc:  # no graph for this one: its eager time stands, and the row says so
                t, notes[i] = None, f"eager (no graph: {bc.err_text(exc)[:80]})"
            times[i].append(t if t is not None else bc.time_us(fn, DEV, reps=3))
    return [res | {"t": statistics.median(ts), "lo": min(ts), "hi": max(ts), "note": note}
            for (res, _), ts, note in zip(calls, times, notes, strict=True)]


# -- dense SDPA (its own process: no vLLM there) --------------------------------------------------
def sdpa_case(case: Case) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, table, lens, qsl, bases, kc, vc, _ = inputs(case)
    rows, want = reference(case, q, kc, vc, table, qsl)
    b, n = len(case.seq_lens), case.q_lens[0]
    k, v = bc.gathered_kv(kc, vc, table)
    del bases, kc, vc
    q4 = q.view(b, n, Q_HEADS, HEAD).transpose(1, 2).contiguous()
    backend = [SDPBackend.FLASH_ATTENTION]

    def fn():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q4, k, v, is_causal=n > 1, enable_gqa=True)

    note = "flash backend"
    try:
        fn()
    except RuntimeError as exc:  # no flash kernel here (the CPU's may refuse GQA): the default choice
        backend = list(SDPBackend)
        note = f"flash refused ({bc.err_text(exc)[:60]}); default backend"
    res = measure(fn, rows, want, f"sdpa {case.name}", pack=lambda o: o.transpose(1, 2).reshape(b * n, Q_HEADS, HEAD))
    res["note"] = "; ".join(x for x in (note, res["note"], "own process, vLLM never imported") if x)
    return res


def sdpa_child(kinds: list[str]) -> dict:
    """Runs this script with --sdpa-only in a fresh process; its results by case name, or {'error': ...}."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sdpa.json"
        cmd = [sys.executable, __file__, "--sdpa-only", "--json", str(path), "--device", DEV.type,
               "--only", ",".join(kinds)] + (["--quick"] if ARGS.quick else [])
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            return {"error": "SDPA child process timed out (600 s)"}
        if run.returncode != 0 or not path.exists():
            return {"error": f"SDPA child process rc {run.returncode}: {' '.join(run.stderr.split()[-40:])}"}
        return json.loads(path.read_text())


# -- ours and the vLLM peers (this process) ---------------------------------------------------------
def run_case(case: Case, peers: dict) -> list[dict]:
    """Rows {impl, layout, t, lo, hi, check, note} of one case: ours on both layouts, then the peers."""
    q, table, lens, qsl, bases, kc, vc, scales = inputs(case)
    rows, want = reference(case, q, kc, vc, table, qsl, scales=scales)
    max_q, max_k, min_q = max(case.q_lens), max(case.seq_lens), min(case.q_lens)
    views = {Layout.PER_LAYER: (kc, vc, "")}
    out: list[dict] = []
    peer_scales, want_fa3 = None, want
    if scales:  # FA3's fp8 path takes an fp8 query too: its own reference reads the query it was given
        q8, q_scale = bc.fp8_quantize(q, FP8)
        peer_scales = scales | {"q8": q8, "q": q_scale}
        want_fa3 = reference(case, (q8.float() * q_scale), kc, vc, table, qsl, scales=scales)[1]
    try:  # the same values in the last layer of a contiguous cache
        per_layer_bytes = table.numel() * BLOCK * KV_HEADS * HEAD * 2 * kc.element_size()
        layers = bc.layers_for(Layout.CONTIGUOUS, per_layer_bytes, MEM_GB)
        bases_c, kcc, vcc = bc.kv_cache(Layout.CONTIGUOUS, table.numel(), layers, DEV, dtype=kc.dtype)
        n = min(len(kc), len(kcc))  # the views' lengths are whole pages of each layout
        kcc[:n].copy_(kc[:n])
        vcc[:n].copy_(vc[:n])
        views[Layout.CONTIGUOUS] = (kcc, vcc, f"{layers} layers, block stride {kcc.stride(0) * 2 // 1024} KiB")
    except Exception as exc:
        out.append({"impl": "ours", "layout": "contiguous", "check": "ERROR", "note": bc.err_text(exc)})

    # min_query_len as kvcached's vLLM backend passes it (from the host's query lengths): a batch of prefills
    # then makes no decode launch
    def ours(k, v):
        return lambda: paged_attention(q, k, v, table, lens, qsl, max_query_len=max_q, max_seq_len=max_k,
                                       scale=HEAD**-0.5, min_query_len=min_q, k_scale=scales.get("k"),
                                       v_scale=scales.get("v"))

    # the peers on contiguous views come last: a fault there cannot cost the other rows
    order = [("ours", lay) for lay in views] + [(p, lay) for lay in views for p in peers]
    placed: list[tuple[int, dict]] = []  # (place in the order, row): the table keeps this order
    checked: list[tuple[int, dict, object, str]] = []
    for i, (impl, layout) in enumerate(order):
        peer = peers.get(impl)
        row = {"impl": impl, "layout": LAYOUTS[layout]}
        if isinstance(peer, Exception):
            if layout is Layout.PER_LAYER:
                placed.append((i, row | {"layout": "-", "check": f"absent: {bc.err_text(peer)[:100]}", "note": ""}))
            continue
        k, v, note = views[layout]
        try:
            fn = ours(k, v) if impl == "ours" else bc.peer_call(impl, peer, q, k, v, table, lens, qsl, max_q, max_k,
                                                                 scales=peer_scales)
            target = want_fa3 if impl == FA3 else want
            if impl == FA3 and scales:
                note = "; ".join(x for x in (note, "fp8 query (FA3's fp8 path), checked against it") if x)
            checked.append((i, row | check_call(fn, rows, target, f"{impl} {row['layout']} {case.name}"), fn, note))
        except Exception as exc:  # a failing implementation is its row, not the end of the run
            placed.append((i, row | {"check": "ERROR", "note": bc.err_text(exc)}))
    try:
        timed = time_in_turn([(res, fn) for _, res, fn, _ in checked])
    except Exception as exc:  # a fault while timing (a peer's graph): the case's rows say so, the run goes on
        timed = [res | {"check": "ERROR", "note": bc.err_text(exc)} for _, res, _, _ in checked]
    for res, (i, _, _, note) in zip(timed, checked, strict=True):
        placed.append((i, res | {"note": "; ".join(x for x in (note, res["note"]) if x)}))
    checked.clear()
    bc.free_memory(DEV)
    return out + [row for _, row in sorted(placed, key=lambda p: p[0])]


def sdpa_row(case: Case, sdpa: dict) -> dict:
    row = {"impl": "SDPA dense (peer)", "layout": "gathered"}
    if case.kind not in SDPA_KINDS or case.fp8:
        return row | {"layout": "-", "check": "-", "note": "dense SDPA only for the bf16 decode and prefill cases"}
    if "error" in sdpa:
        return row | {"check": "ERROR", "note": sdpa["error"]}
    return row | sdpa.get(case.name, {"check": "ERROR", "note": "no result from the SDPA process"})


# -- tables --------------------------------------------------------------------------------------
def tables(results: list[tuple[Case, list[dict]]]) -> tuple[bc.Table, bc.Table]:
    tab = bc.Table(f"Paged attention and its peers: bf16 (fp8 rows: the KV cache in e4m3 with per-tensor scales), "
                f"{Q_HEADS} query / {KV_HEADS} KV heads, head {HEAD}, block "
                f"{BLOCK}, causal", ["row", "impl", "layout", "time us (median of 3)", "spread us", "TB/s or TFLOP/s",
                                     "FA3 time / this time", "vLLM Triton time / this time", "check vs fp64", "note"])
    tab.notes.append("time: do_bench (median) of a CUDA-graph replay, 3 fresh captures, a case's implementations "
                     "in turn; spread: their min-max. Ratios use the peers' per-layer times: above 1, this row is "
                     "faster.")
    summ = bc.Table("Summary", ["row", "ours best layout", "ours best / FA3 (time)", "ours best / vLLM Triton (time)",
                             "ours contiguous vs per-layer (time)"])
    summ.notes.append("below 1: ours is faster; contiguous vs per-layer: + is slower on the contiguous layout.")
    for case, rows in results:
        per = {(r["impl"], r["layout"]): r.get("t") for r in rows}
        fa3, vl = per.get((FA3, "per-layer")), per.get((VLLM, "per-layer"))
        work, unit = case.work()
        for r in rows:
            t = r.get("t")
            tab.add(case.name, r["impl"], r["layout"], t, f"{r['lo']:.1f}-{r['hi']:.1f}" if t else None,
                    f"{work / t / 1e6:.2f} {unit}" if t else None, fa3 / t if t and fa3 else None,
                    vl / t if t and vl else None, r["check"], r.get("note") or "")
        mine = {lay: per.get(("ours", lay)) for lay in ("per-layer", "contiguous")}
        best = min((t, lay) for lay, t in mine.items() if t) if any(mine.values()) else (None, "-")
        pc, cc = mine["per-layer"], mine["contiguous"]
        summ.add(case.name, best[1], best[0] / fa3 if best[0] and fa3 else None,
                 best[0] / vl if best[0] and vl else None, f"{100 * (cc / pc - 1):+.1f} %" if pc and cc else None)
    return tab, summ


def main() -> int:
    t_start = time.time()
    only = [x for x in ARGS.only.split(",") if x]
    unknown = sorted(set(only) - set(KINDS))
    if unknown:
        raise SystemExit(f"--only: unknown kinds {unknown}; choose from {','.join(KINDS)}")
    kinds = [k for k in KINDS if not only or k in only]
    cases = make_cases(kinds)
    if ARGS.sdpa_only:
        res = {}
        for case in cases:
            if case.kind in SDPA_KINDS and not case.fp8:
                try:
                    res[case.name] = sdpa_case(case)
                except Exception as exc:
                    res[case.name] = {"check": "ERROR", "note": bc.err_text(exc)}
                bc.free_memory(DEV)
        if "vllm" in sys.modules:  # the point of this process
            raise SystemExit("vLLM was imported in the SDPA process")
        Path(ARGS.json).write_text(json.dumps(res))
        return 0
    env = bc.environment(DEV)
    sdpa_kinds = [k for k in kinds if k in SDPA_KINDS]
    sdpa = sdpa_child(sdpa_kinds) if sdpa_kinds else {}  # before vLLM is imported here
    peers = bc.vllm_peers() if GPU else {p: RuntimeError("no GPU (CPU run)") for p in (VLLM, FA3)}
    results = []
    for case in cases:
        rows = run_case(case, peers) + [sdpa_row(case, sdpa)]
        results.append((case, rows))
        print(f"{case.name}: " + "; ".join(f"{r['impl']} {r['layout']} " + (f"{r['t']:.1f} us" if r.get("t") else
                                                                                 r["check"]) for r in rows), flush=True)
        bc.free_memory(DEV)
    ours_bad = [f"{c.name} {r['layout']}: {r['check']}" for c, rows in results for r in rows
                if r["impl"] == "ours" and not r["check"].startswith("ok")]
    slug = bc.gpu_slug(DEV)
    lines = [f"- wall time: {time.time() - t_start:.0f} s",
             f"- correctness, ours: {'all checks passed' if not ours_bad else 'FAILED: ' + '; '.join(ours_bad)}",
             f"- correctness, all: {'all checks passed' if not bc.FAILED_CHECKS else '; '.join(bc.FAILED_CHECKS)}",
             "", "Formulas and method: the docstring of benchmarks/bench_peers.py (bytes = K+V read once + q/out; "
             "prefill FLOPs = 4*H*D*n(n+1)/2 causal).", ""]
    stem = f"peers_{slug}" + ("_" + "_".join(kinds) if only else "")
    bc.write_report(ARGS.out, stem, f"Paged attention against its peers ({slug})", env, lines, list(tables(results)))
    return 1 if ours_bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""kvcached under vLLM's CUDA build on a real GPU: same tokens, safe under async scheduling and CUDA graphs.

Needs a GPU and vLLM (on our H200: ``benchmarks/gpu_session.sh`` with the vLLM bundle);
skipped otherwise. Every engine runs in its own process (``tests/e2e/engine_runner.py``)
with CUDA graphs and async scheduling on. The independent engines start together (one
GPU holds them all) so the suite costs about one engine start; the two-engine hand-over
runs alone, against a ballast that leaves room for one burst at a time.

Models, made here (no downloads): ``small``, a 4-layer Llama (8 query / 2 KV heads of 64)
with random weights scaled for peaked logits, and ``8b``, Llama-3-8B's shape (32 layers,
32 / 8 heads of 128, 14336 MLP, 128256 vocabulary) with vLLM's dummy weights and token-id
prompts.

``GPU_TEST_ENGINES=mamba_,swa_`` (name prefixes) starts only those engines of the shared
set, for a short run of the tests that use them (``-k``); the others then fail as not started.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import sys
import time
from pathlib import Path

import pytest
import torch

E2E = Path(__file__).resolve().parent.parent / "e2e"
sys.path.insert(0, str(E2E))
from harness import check_decode, check_teacher_forced, engine_env, finish_engine, start_engine  # noqa: E402
from tiny_model import BURST_PROMPTS, PROMPTS, make_tiny_mamba_hybrid, make_tiny_model  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

GiB = 1 << 30
MiB = 1 << 20
GRAPHS = {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 48, 64]}
COMMON = {"dtype": "bfloat16", "enforce_eager": False, "async_scheduling": True, "compilation_config": GRAPHS,
          "max_model_len": 512, "max_num_seqs": 64}
SHORT = {"prompts": PROMPTS * 4, "max_tokens": 48, "prompt_logprobs": 2, "logprobs": 2}
BURST = {"prompts": BURST_PROMPTS, "max_tokens": 480, "logprobs": 2}
# under a limit cut preempted requests are recomputed: shorter outputs keep bf16 recomputation from
# meeting a near-tie between two tokens; the first 120 steps of BURST run the very same batches
CUT_TOKENS = 120
# The Mamba hybrid's 12 KiB pages (48-token blocks) fit 512 to a 6 MiB page: 64 requests of ~6 blocks never fill
# one, so its burst runs 192 at once (~1150 blocks, 3 pages) to make the pool grow and shrink
MAMBA_BURST = {"prompts": BURST_PROMPTS * 4, "max_num_seqs": 192}
PAGE_GROUP_SMALL = 4 * 2 * MiB  # 4 layers x one 2 MiB page (a vLLM page is kept whole)


def _tokens_8b(n: int, length: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1000, 120000) for _ in range(length)] for _ in range(n)]


def _gpu_env(**extra: str | None) -> dict[str, str]:
    return engine_env(cpu=False, **extra)


def _kv_env(name: str, **extra: str | None) -> dict[str, str]:
    return _gpu_env(ENABLE_KVCACHED="true", KVCACHED_IPC_NAME=name, KVCACHED_MAX_CACHED_TOKENS="0", **extra)


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    small = make_tiny_model(tmp_path_factory.mktemp("small_llama"), hidden_size=512, num_heads=8, num_kv_heads=2,
                            num_layers=4)
    big = tmp_path_factory.mktemp("llama3_8b_shape")
    (big / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
        "bos_token_id": 128000, "eos_token_id": 128001,
    }))
    swa = make_tiny_model(tmp_path_factory.mktemp("swa_llama"), hidden_size=512, num_heads=8, num_kv_heads=2,
                          num_layers=4, sliding_window=64)
    mamba = make_tiny_mamba_hybrid(tmp_path_factory.mktemp("mamba_hybrid"))
    return {"small": str(small), "8b": str(big), "swa": str(swa), "mamba": str(mamba)}


def _specs(models: dict[str, str]) -> dict[str, tuple[dict, dict]]:
    small, big = models["small"], models["8b"]
    plain = {"gpu_memory_utilization": 0.1, "kv_cache_memory_bytes": 2 * GiB}
    big_prompts = {"prompt_token_ids": _tokens_8b(64, 512), "max_tokens": 64, "load_format": "dummy",
                   "skip_tokenizer_init": True, "max_model_len": 1024}
    specs = {
        "plain_short": ({"model": small, **COMMON, **SHORT, **plain}, _gpu_env()),
        "plain_burst": ({"model": small, **COMMON, **BURST, **plain}, _gpu_env()),
        "contiguous": ({"model": small, **COMMON, **BURST, "ipc_name": "kvc_gpu_contig", "settle_s": 1.0,
                        "kv_cache_memory_bytes": 2 * GiB},
                       _kv_env("kvc_gpu_contig", KVCACHED_CONTIGUOUS_LAYOUT="true")),
        "per_layer": ({"model": small, **COMMON, **BURST, "ipc_name": "kvc_gpu_perlayer", "settle_s": 1.0,
                       "gpu_memory_utilization": 0.5},
                      _kv_env("kvc_gpu_perlayer", KVCACHED_CONTIGUOUS_LAYOUT="false")),
        "older_runner": ({"model": small, **COMMON, **BURST, "ipc_name": "kvc_gpu_v1runner", "settle_s": 1.0},
                         _kv_env("kvc_gpu_v1runner", VLLM_USE_V2_MODEL_RUNNER="0")),
        "ours": ({"model": small, **COMMON, **SHORT, "attention_backend": "KVCACHED", "ipc_name": "kvc_gpu_ours"},
                 _kv_env("kvc_gpu_ours")),
        "phases": ({"model": small, **COMMON, **BURST, "max_tokens": CUT_TOKENS, "ipc_name": "kvc_gpu_phases",
                    "phases": [
            {"settle_s": 0.5},  # idle
            {"generate": True, "settle_s": 1.0},  # burst grows, drain shrinks
            {"limit_bytes": PAGE_GROUP_SMALL},  # a cut far below the burst's demand
            {"generate": True, "settle_s": 0.5},  # preemption under the cut
            {"limit_bytes": -1},
            {"generate": True, "settle_s": 1.0},  # recover
        ]}, _kv_env("kvc_gpu_phases")),
        # hybrids: a sliding-window + full Llama and a Mamba2 + attention Granite-4.0-H, both layouts
        **{f"{kind}_{layout}": (
            {"model": models[kind], **COMMON, **BURST, "max_tokens": 200, **(MAMBA_BURST if kind == "mamba" else {}),
             **({"ipc_name": f"kvc_gpu_{kind}_{layout}", "settle_s": 1.0} if layout != "plain" else plain),
             **({"tune_after": "mamba_plain"} if kind == "mamba" else {})},
            _gpu_env() if layout == "plain" else
            _kv_env(f"kvc_gpu_{kind}_{layout}", KVCACHED_CONTIGUOUS_LAYOUT=str(layout == "contiguous").lower()))
           for kind in ("swa", "mamba") for layout in ("plain", "contiguous", "per_layer")},
        "plain_8b": ({"model": big, **COMMON, **big_prompts, "gpu_memory_utilization": 0.3,
                      "kv_cache_memory_bytes": 8 * GiB}, _gpu_env()),
        "kv_8b": ({"model": big, **COMMON, **big_prompts, "ipc_name": "kvc_gpu_8b", "settle_s": 1.0},
                  _kv_env("kvc_gpu_8b")),
    }
    # the control: plain vLLM again, as the kvcached engines run (started after mamba_plain, its kernel choices)
    specs["mamba_twin"] = specs["mamba_plain"]
    return specs


def _wait_ready(procs: dict, files: dict[str, Path], timeout: float = 900) -> None:
    """Until every engine has started (or exited): no engine drains or exits while another profiles memory."""
    deadline = time.monotonic() + timeout
    while not all(files[n].exists() or procs[n].poll() is not None for n in procs):
        if time.monotonic() > deadline:
            raise AssertionError(f"engines not up within {timeout} s: {[n for n in procs if not files[n].exists()]}")
        time.sleep(0.2)


@pytest.fixture(scope="session")
def runs(models: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Every independent engine, started together; results by name (an engine's failure is its test's)."""
    gate = tmp_path_factory.mktemp("gate")
    procs, ready = {}, {}
    only = tuple(p for p in os.environ.get("GPU_TEST_ENGINES", "").split(",") if p)
    specs = {n: s for n, s in _specs(models).items() if not only or n.startswith(only)}
    for name, (spec, env) in specs.items():
        ready[name] = gate / f"{name}.ready"
        spec = {**spec, "ready_file": str(ready[name]), "wait_file": str(gate / "go")}
        first = spec.pop("tune_after", None)
        if first is not None:
            # vLLM autotunes some Triton kernels (the Mamba2 prefill's) in each process; engines timing them side by
            # side choose differently, and other choices round differently. This engine starts once `first` is up
            # and takes its choices from the Triton cache they share (TRITON_CACHE_AUTOTUNING)
            env = {**env, "TRITON_CACHE_AUTOTUNING": "1", "TRITON_CACHE_DIR": str(gate / f"triton_{first}")}
            if first != name and first in specs:
                spec["start_after"] = str(gate / f"{first}.ready")
        procs[name] = start_engine(spec, env)
    _wait_ready(procs, ready)
    (gate / "go").touch()
    out: dict[str, dict] = {}
    for name, proc in procs.items():
        try:
            out[name] = finish_engine(proc, timeout=900)
        except AssertionError as exc:
            out[name] = {"error": str(exc)}
            continue
        if out[name].get("idle_published") != out[name].get("idle_before"):
            print(f"{name}: the idle reading was {out[name]['idle_published']} B as last published, "
                  f"{out[name]['idle_before']} B after a publish")
    return out


def _ok(runs: dict[str, dict], name: str) -> dict:
    r = runs.get(name, {"error": "not started (GPU_TEST_ENGINES)"})
    assert "error" not in r, f"engine {name} failed:\n{r.get('error')}"
    return r


def _used(r: dict) -> list[int]:
    return [u for _, u, _ in r["samples"]]


def _same_run(base: dict, r: dict, label: str) -> bool:
    """Whether ``r`` ran the baseline's very batches with the very kernels, so that the same bits are due:
    every batch the same (the engine runner's digests; without them, no preemption and equal prefix-cache
    hits), and every autotuned kernel (vLLM's Mamba2 prefill) with the baseline's choice, since another
    choice tiles a reduction differently and sums it in another order."""
    print(f"{label}: preemptions {r['preemptions']} (plain {base['preemptions']}), prefix-cache hits "
          f"{sum(map(sum, r['cached_tokens']))} tokens (plain {sum(map(sum, base['cached_tokens']))})")
    if r.get("batches") is not None and base.get("batches") is not None:
        ours, theirs = r["batches"], base["batches"]
        same = ours == theirs
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
                     min(len(ours), len(theirs)))
        print(f"{label}: {len(ours)} batches (plain {len(theirs)})" + ("" if same else f", batch {first} differs"))
    else:
        same = r["preemptions"] == base["preemptions"] == 0 and r["cached_tokens"] == base["cached_tokens"]
    tuned = {k for k in set(r["autotune"]) | set(base["autotune"]) if r["autotune"].get(k) != base["autotune"].get(k)}
    for k in sorted(tuned):
        print(f"{label}: autotuned {k} chose {r['autotune'].get(k)} (plain {base['autotune'].get(k)})")
    return same and not tuned


def _same_or_near_tie(base: dict, run: dict, label: str, same_batches: bool, steps: int | None = None) -> int:
    """The same tokens as the baseline where both ran the same batches with the same kernels (the same kernels
    on the same data give the same bits, wherever the pages are); where they did not (a preempted request is
    recomputed as a prefill, a prefix-cache hit skips part of one, an autotuned kernel chose another config),
    rounding differs, so requests may part from the baseline only at a near-tie of its decode
    (harness.check_decode: logprobs within 0.06 until then, and a lead of at most 0.12 where they part).
    ``base``/``run``: a phase record or an engine result (tokens, decode). Returns the requests that parted."""
    cut = (lambda rows: [t[:steps] for t in rows]) if steps else (lambda rows: rows)
    base_tokens, tokens = cut(base["tokens"]), run["tokens"]
    differ = sum(a != b for a, b in zip(tokens, base_tokens, strict=True))
    print(f"{label}: {differ} of {len(base_tokens)} requests differ from plain vLLM "
          f"({'the same batches and kernels' if same_batches else 'other batches or kernels, or the control parted'})")
    if same_batches or not differ:
        if differ and base.get("decode") and run.get("decode"):
            try:  # where they part, for the failure's record
                check_decode(cut(base["decode"]), run["decode"])
            except AssertionError as exc:
                print(f"{label}: not only at near-ties: {exc}")
        assert tokens == base_tokens
        return 0
    _, parted = check_decode(cut(base["decode"]), run["decode"])
    return parted


@pytest.mark.parametrize("name", ["contiguous", "per_layer", "older_runner"])
def test_greedy_tokens_equal_plain_vllm(runs: dict[str, dict], name: str) -> None:
    """FLASH_ATTN on kvcached's memory, both layouts and both model runners: the very same tokens."""
    base, r = _ok(runs, "plain_burst"), _ok(runs, name)
    assert r["pool"] == "KVCachedBlockPool" and r["backend"] == "FLASH_ATTN", (r["pool"], r["backend"])
    assert r["tokens"] == base["tokens"]
    used = _used(r)
    assert max(used) >= r["idle_before"] + 3 * PAGE_GROUP_SMALL, "mapped memory never rose under the burst"
    assert r["after"] == r["idle_before"], (
        f"mapped memory did not fall back: {r['idle_before']} -> {r['after']}; {r.get('late')}")


def test_older_runner_was_used(runs: dict[str, dict]) -> None:
    assert "gpu_model_runner" in _ok(runs, "older_runner")["runner"]
    assert "gpu.model_runner" in _ok(runs, "contiguous")["runner"]


def test_memory_flags_become_the_engine_limit(runs: dict[str, dict]) -> None:
    contiguous, per_layer = _ok(runs, "contiguous"), _ok(runs, "per_layer")
    assert contiguous["limit"] == 2 * GiB  # --kv-cache-memory-bytes, as kvctl shows it
    total = torch.cuda.mem_get_info()[1]
    # --gpu-memory-utilization 0.5: what vLLM planned for KV (half the device less the engine's weights and
    # activations, as its profile measured them while the other engines started)
    assert per_layer["limit"] == per_layer["kv_planned"], (per_layer["limit"], per_layer["kv_planned"])
    assert 0 < per_layer["limit"] < 0.5 * total
    assert max(_used(contiguous)) <= 2 * GiB
    assert _ok(runs, "older_runner")["limit"] == -1  # neither flag: no cap, as before


def test_kvcached_backend_matches_flash_attn(runs: dict[str, dict]) -> None:
    base, ours = _ok(runs, "plain_short"), _ok(runs, "ours")
    assert ours["backend"] == "KVCACHED"
    check_teacher_forced(base["teacher"], ours["teacher"])  # prefill
    check_decode(base["decode"], ours["decode"])  # decode steps, replayed from full CUDA graphs


def test_limit_cut_preempts_and_every_request_completes_unchanged(runs: dict[str, dict]) -> None:
    """Upstream kvcached's elastic phases: idle, burst grows, drain shrinks, limit cut, recover."""
    r, base = _ok(runs, "phases"), _ok(runs, "plain_burst")
    idle, burst, _, cut, _, recover = r["phases"]
    assert base["preemptions"] == 0, "the baseline preempted: it no longer runs the burst's batches"
    assert all(len(t) == CUT_TOKENS for t in cut["tokens"]), "a request under the cut did not complete"
    assert cut["preemptions"] > burst["preemptions"], "the cut preempted nothing"
    before = idle["preemptions"]
    for phase, label in ((burst, "burst"), (cut, "cut"), (recover, "recover")):
        # the cut preempts by design; the burst and the recovery must run the baseline's batches exactly
        _same_or_near_tie(base, phase, label, same_batches=label != "cut", steps=CUT_TOKENS)
        if label != "cut":
            assert phase["preemptions"] == before, f"the {label} phase preempted"
        before = phase["preemptions"]
    in_burst = [u for t, u, _ in r["samples"] if burst["t0"] <= t <= burst["t1"]]
    in_cut = [u for t, u, _ in r["samples"] if cut["t0"] <= t <= cut["t1"]]
    assert max(in_burst) >= idle["used_after"] + PAGE_GROUP_SMALL, "the burst did not grow the pool"
    assert burst["used_after"] <= idle["used_after"], "the drain did not shrink the pool"
    assert max(in_cut) <= PAGE_GROUP_SMALL, f"mapped {max(in_cut)} B under a {PAGE_GROUP_SMALL} B limit"


@pytest.mark.parametrize("name", ["swa_contiguous", "swa_per_layer", "mamba_contiguous", "mamba_per_layer"])
def test_hybrid_models_equal_plain_vllm(runs: dict[str, dict], name: str) -> None:
    """Several KV cache groups (sliding window + full; Mamba state + attention) in one elastic pool."""
    kind = name.split("_")[0]
    base, r = _ok(runs, f"{kind}_plain"), _ok(runs, name)
    assert r["pool"] == "KVCachedBlockPool" and len(r["kv_groups"]) == 2, (r["pool"], r["kv_groups"])
    assert r["kv_groups"] == base["kv_groups"]
    same = _same_run(base, r, name)
    if kind == "mamba":
        # Exact equality is due from nobody here: vLLM's own Mamba2 kernels do not give the same bits from one
        # process to the next on the same batches with the same kernel choices. The control (plain vLLM again,
        # started as the kvcached engines are) parted from plain vLLM at near-ties in GPU runs 17, 18, 21 and 23
        # and agreed in others, and an agreeing control does not make the next engine agree (run 24: the control
        # agreed, mamba_per_layer parted in 4 of 192 at near-ties, as the control had in run 23; it did in run 25
        # and not in run 26, with plain vLLM's very strides and alignments in its KV views). The control and
        # kvcached are both held to the near-tie check; the memory checks below stay exact.
        twin = _ok(runs, "mamba_twin")
        if r.get("kv_views") != base.get("kv_views"):  # diagnostics for the parting of the per-layer engine
            print(f"{name}: KV views (shape, strides, dtype, address mod 1024) of the first layers "
                  f"{r.get('kv_views')}; plain vLLM {base.get('kv_views')}")
        _same_run(base, twin, "mamba_twin")
        _same_or_near_tie(base, twin, "mamba_twin", same_batches=False)
        same = False
    _same_or_near_tie(base, r, name, same_batches=same)
    assert max(_used(r)) > r["idle_before"], "mapped memory never rose under the burst"
    assert r["after"] == r["idle_before"], (
        f"mapped memory did not fall back: {r['idle_before']} -> {r['after']}; {r.get('late')}")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (kind nvidia-h200-x2)")
def test_tensor_parallel_two_gpus(models: dict[str, str]) -> None:
    """TP = 2: tokens as TP = 2 without kvcached; both GPUs map the scheduler's pages through a kvctl cut, a
    burst and a drain, and show the same mapped memory."""
    # Each rank holds half the KV heads, so a page holds twice the blocks of one GPU's (512 of 16 tokens):
    # 192 requests of ~20 + 120 tokens need ~1700 blocks at once, over 3 pages, so the cut to one page
    # preempts and the drain has pages to give back.
    spec = {"model": models["small"], **COMMON, "prompts": BURST["prompts"] * 4, "max_num_seqs": 256,
            "max_tokens": CUT_TOKENS, "tensor_parallel_size": 2}
    base = finish_engine(start_engine({**spec, "gpu_memory_utilization": 0.3}, _gpu_env()), timeout=900)
    group = PAGE_GROUP_SMALL * 2  # the engine's bytes behind one page index: both ranks
    r = finish_engine(start_engine({**spec, "ipc_name": "kvc_gpu_tp2", "settle_s": 1.0, "rank_state": True,
                                    "phases": [{"limit_bytes": group, "generate": True, "settle_s": 1.0},
                                               {"limit_bytes": -1, "generate": True, "settle_s": 1.0}]},
                                   _kv_env("kvc_gpu_tp2")), timeout=900)
    assert r["all_tokens"] == [base["tokens"]] * 2
    capped, free = r["phases"]
    assert capped["ranks"][0]["peak"] == capped["ranks"][1]["peak"] == 1, capped["ranks"]
    assert free["ranks"][0] == free["ranks"][1], free["ranks"]
    assert free["ranks"][0]["peak"] >= 2 and free["ranks"][0]["in_use"] * group == r["idle_before"]


def test_llama3_8b_shape_greedy_equal(runs: dict[str, dict]) -> None:
    base, r = _ok(runs, "plain_8b"), _ok(runs, "kv_8b")
    assert r["pool"] == "KVCachedBlockPool"
    assert r["tokens"] == base["tokens"]
    assert r["after"] == r["idle_before"]


def test_two_engines_hand_memory_over(models: dict[str, str], runs: dict[str, dict], tmp_path: Path) -> None:
    """Two 8B-shaped engines; A bursts and drains, then B bursts into memory that only A's drain left free.

    Once both are up, a ballast in this process leaves room for one burst (and a little),
    measured from the solo kvcached run of the same prompts.
    """
    solo, base = _ok(runs, "kv_8b"), _ok(runs, "plain_8b")["tokens"]
    burst = max(_used(solo)) - solo["idle_before"]
    procs, ready = {}, {}
    for name, wait, signal in (("a", "go", "a_done"), ("b", "a_done", None)):
        ready[name] = tmp_path / f"{name}.ready"
        spec = {**_specs(models)["kv_8b"][0], "ipc_name": f"kvc_gpu_two_{name}", "settle_s": 1.0,
                "linger_s": 1.0 if name == "a" else 0.0, "ready_file": str(ready[name]), "warmup": True,
                "wait_file": str(tmp_path / wait), "signal_file": str(tmp_path / signal) if signal else None}
        procs[name] = start_engine(spec, _kv_env(f"kvc_gpu_two_{name}", KVCACHED_MIN_RESERVED_PAGES="1",
                                                 KVCACHED_MAX_RESERVED_PAGES="2"))
    _wait_ready(procs, ready)
    free, _ = torch.cuda.mem_get_info()
    # one burst and a half, plus the engines' prealloc reserves (2 page groups of 64 MiB each) and slack
    room = int(1.5 * burst) + 4 * 64 * MiB + 512 * MiB
    ballast = torch.empty(max(0, free - room), dtype=torch.uint8, device="cuda")
    try:
        (tmp_path / "go").touch()
        a, b = (finish_engine(procs[n], timeout=900) for n in ("a", "b"))
    finally:
        del ballast
        torch.cuda.empty_cache()
    assert a["tokens"] == base and b["tokens"] == base
    a_peak, b_peak = max(_used(a)), max(_used(b))
    assert a["after"] == a["idle_before"] and b["after"] == b["idle_before"]
    free_at_a_peak = min(f for _, u, f in a["samples"] if u == a_peak)
    b_burst = b_peak - b["idle_before"]
    print(f"burst {burst / MiB:.0f} MiB; A peak {a_peak / MiB:.0f} MiB with {free_at_a_peak / MiB:.0f} MiB free "
          f"on the device; B's burst {b_burst / MiB:.0f} MiB")
    assert b_burst > free_at_a_peak, "B's burst would have fitted beside A's: no hand-over shown"

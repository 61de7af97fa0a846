"""Bad inputs to paged_attention raise ValueError saying what is wrong; the op list is sane."""

from __future__ import annotations

import pytest
import torch

from kvcached.kernels import attention_config as cfg
from kvcached.kernels.paged_attention import (
    BLOCK_SIZES,
    HEAD_SIZES,
    QUERY_DTYPES,
    SHORT_MAX,
    _target_info,
    compile_variants,
    decode_rows,
    paged_attention,
    select,
    target_fp8,
    variant_key,
)
from kvcached.kernels.reference import paged_kv_case, random_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(head_size=32, block_size=16, dtype=torch.float16):
    gen = torch.Generator().manual_seed(0)
    k, v, _, _ = paged_kv_case(layout="contiguous", style="flash_attn", num_kv_heads=2, head_size=head_size,
                               block_size=block_size, dtype=dtype, num_blocks=64, generator=gen, device=DEVICE)
    q, bt, sl, qsl = random_batch([1, 4], [20, 4], 4, head_size, block_size, k.shape[0], dtype, generator=gen,
                                  device=DEVICE)
    args = [q, k, v, bt, sl, qsl]
    kwargs = {"max_query_len": 4, "max_seq_len": 20}
    return args, kwargs


def _mutate(name):
    args, kw = _case()
    q, k, v, bt, sl, qsl = args
    if name == "query_2d":
        args[0] = q[:, 0]
    elif name == "query_fp32":
        args[0] = q.float()
    elif name == "query_strided_d":
        args[0] = q.transpose(1, 2).contiguous().transpose(1, 2)
    elif name == "head_mismatch":
        args[0] = torch.randn(q.shape[0], 4, 64, dtype=q.dtype, device=DEVICE)
    elif name == "kv_shape_mismatch":
        args[2] = v[:-1]
    elif name == "kv_dtype_mismatch":
        args[2] = v.to(torch.bfloat16)
    elif name == "kv_dtype_other":
        args[1], args[2] = k.to(torch.bfloat16), v.to(torch.bfloat16)
    elif name == "kv_3d":
        args[1] = k[:, :, 0]
    elif name == "heads_not_multiple":
        args[0] = torch.randn(q.shape[0], 3, 32, dtype=q.dtype, device=DEVICE)
    elif name == "block_table_int64":
        args[3] = bt.long()
    elif name == "block_table_1d":
        args[3] = bt[0]
    elif name == "seq_lens_int64":
        args[4] = sl.long()
    elif name == "seq_lens_len":
        args[4] = sl[:1]
    elif name == "qsl_len":
        args[5] = qsl[:-1]
    elif name == "max_query_len_zero":
        kw["max_query_len"] = 0
    elif name == "max_seq_len_float":
        kw["max_seq_len"] = 20.0
    elif name == "query_longer_than_seq":
        kw["max_query_len"] = 30
    elif name == "table_too_narrow":
        kw["max_seq_len"] = bt.shape[1] * 16 + 1
    elif name == "window_zero":
        kw["sliding_window"] = 0
    elif name == "window_noncausal":
        kw.update(sliding_window=4, causal=False)
    elif name == "softcap_negative":
        kw["softcap"] = -1.0
    elif name == "alibi_wrong_len":
        kw["alibi_slopes"] = torch.rand(3, device=DEVICE)
    elif name == "alibi_fp16":
        kw["alibi_slopes"] = torch.rand(4, device=DEVICE).half()
    elif name == "sinks_wrong_len":
        kw["sinks"] = torch.rand(5, device=DEVICE)
    elif name == "out_wrong_dtype":
        kw["out"] = torch.empty(q.shape, dtype=torch.float32, device=DEVICE)
    elif name == "out_wrong_shape":
        kw["out"] = torch.empty(q.shape[0], 4, 16, dtype=q.dtype, device=DEVICE)
    elif name == "k_scale_vector":
        kw["k_scale"] = torch.ones(2, device=DEVICE)
    elif name == "v_scale_negative":
        kw["v_scale"] = -2.0
    elif name == "scale_nan":
        kw["scale"] = float("nan")
    elif name == "scale_zero":
        kw["scale"] = 0.0
    elif name == "scale_negative":
        kw["scale"] = -0.1
    elif name == "min_query_len_zero":
        kw["min_query_len"] = 0
    elif name == "min_query_len_above_max":
        kw["min_query_len"] = 5
    elif name == "min_query_len_bool":
        kw["min_query_len"] = True
    return args, kw


BAD = {
    "query_2d": "query must be",
    "query_fp32": "query dtype",
    "query_strided_d": "stride 1",
    "head_mismatch": "head size",
    "kv_shape_mismatch": "differ in shape",
    "kv_dtype_mismatch": "differ in dtype",
    "kv_dtype_other": "must equal the query",
    "kv_3d": "k_cache must be",
    "heads_not_multiple": "not a multiple",
    "block_table_int64": "block_table must be",
    "block_table_1d": "block_table must be",
    "seq_lens_int64": "seq_lens must be",
    "seq_lens_len": "seq_lens must be",
    "qsl_len": "query_start_loc must be",
    "max_query_len_zero": "max_query_len must be",
    "max_seq_len_float": "max_seq_len must be",
    "query_longer_than_seq": "exceeds max_seq_len",
    "table_too_narrow": "columns",
    "window_zero": "sliding_window must be",
    "window_noncausal": "causal=True",
    "softcap_negative": "softcap must be",
    "alibi_wrong_len": "alibi_slopes must be",
    "alibi_fp16": "alibi_slopes must be",
    "sinks_wrong_len": "sinks must be",
    "out_wrong_dtype": "out must match",
    "out_wrong_shape": "out must match",
    "k_scale_vector": "k_scale must be",
    "v_scale_negative": "v_scale must be",
    "scale_nan": "scale must be",
    "scale_zero": "scale must be a positive",
    "scale_negative": "scale must be a positive",
    "min_query_len_zero": "min_query_len must be",
    "min_query_len_above_max": r"min_query_len must be None or an int in \[1, max_query_len = 4\]",
    "min_query_len_bool": "min_query_len must be",
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_raises(name):
    args, kw = _mutate(name)
    with pytest.raises(ValueError, match=BAD[name]):
        paged_attention(*args, **kw)


@pytest.mark.parametrize("head_size", [16, 48, 112, 192, 512])
def test_unsupported_head_size(head_size):
    q = torch.randn(2, 4, head_size, dtype=torch.float16, device=DEVICE)
    kv = torch.randn(4, 16, 2, head_size, dtype=torch.float16, device=DEVICE)
    bt = torch.zeros(1, 4, dtype=torch.int32, device=DEVICE)
    sl = torch.tensor([2], dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0, 2], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="head size"):
        paged_attention(q, kv, kv, bt, sl, qsl, max_query_len=2, max_seq_len=2)


@pytest.mark.parametrize("block_size", [3, 24, 256])
def test_unsupported_block_size(block_size):
    q = torch.randn(2, 4, 32, dtype=torch.float16, device=DEVICE)
    kv = torch.randn(4, block_size, 2, 32, dtype=torch.float16, device=DEVICE)
    bt = torch.zeros(1, 4, dtype=torch.int32, device=DEVICE)
    sl = torch.tensor([2], dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0, 2], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="block size"):
        paged_attention(q, kv, kv, bt, sl, qsl, max_query_len=2, max_seq_len=2)


def test_unknown_knob_raises():
    with pytest.raises(ValueError, match="unknown attention knob"), cfg.override(decode_splits=2):
        pass


TARGETS = ["sm80", "sm90", "gfx942", "gfx90a", "gfx950"]


@pytest.mark.parametrize("target", TARGETS)
def test_compile_variants_per_target(target):
    variants = compile_variants(target)
    names = [v.name for v in variants]
    assert len(names) == len(set(names))
    assert len({variant_key(v) for v in variants}) == len(variants)
    ptr_types = {t for v in variants for t in v.signature.values()}
    # one fp8 rule with write_kv: e4m3fn on sm89+ and gfx950, e4m3fnuz on gfx942, none on sm80/gfx90a
    assert ("*fp8e4nv" in ptr_types) == (target in ("sm90", "gfx950"))
    assert ("*fp8e4b8" in ptr_types) == (target == "gfx942")
    kernels = {v.fn.__name__ for v in variants}
    assert kernels == {"decode_kernel", "reduce_kernel", "reduce_rows_kernel", "prefill_kernel"}
    for v in variants:
        assert v.constexprs.get("INTERP", False) is False
        assert not set(v.signature) & set(v.constexprs)
        assert set(v.signature) | set(v.constexprs) == set(v.fn.arg_names)
    # head sizes 80 and 96 run on the 128 tile with a head mask (PAD_D)
    tiles = {(v.constexprs["HEAD_PAD"], v.constexprs["PAD_D"]) for v in variants if "PAD_D" in v.constexprs}
    assert tiles == {(32, False), (64, False), (128, False), (128, True), (256, False)}
    # block size, group, split count and feature values are run-time arguments: a small, fixed list
    # (dtype pairs x 5 tiles x (decode rows 16, 16 stream-K, 32 and 64, prefill) x FEATURES, plus the reduces per
    # query dtype x 4 tiles: a row at a time, and a decode program's 16, 32 or 64 rows at a time). Hopper-class
    # targets have no 32-row tile: their short queries take the 64-row one (paged_attention.decode_rows), and
    # their plain 128-tile prefill (head 128, and 80/96 masked) over a 16-bit cache has a second compile for
    # prompts of at most ONE_RUN_KEYS keys (attention_config.prefill_tile). Every decode and prefill compile comes
    # twice: V's block and token strides K's (SAME_KV) or its own.
    hip, big_smem = _target_info(target)
    hopper = big_smem and not hip
    rows = {16, 64} if hopper else {16, 32, 64}
    pairs = 4 if target in ("sm90", "gfx942", "gfx950") else 2
    one_run = 2 * 2 if hopper else 0
    assert len(variants) == (pairs * 5 * (len(rows) + 2) * 2 + one_run) * 2 + 2 * 4 * (len(rows) + 1)
    assert len([v for v in variants if v.constexprs.get("ONE_RUN")]) == one_run * 2
    own = {v.name.replace("-kvstrides", ""): v.constexprs for v in variants if v.constexprs.get("SAME_KV") is False}
    same = {v.name: v.constexprs for v in variants if v.constexprs.get("SAME_KV")}
    assert own.keys() == same.keys() and all(own[n] | {"SAME_KV": True} == same[n] for n in same)
    assert {v.constexprs["BLOCK_H"] for v in variants if v.fn.__name__ == "decode_kernel" and v.constexprs["STREAM"]} \
        == {16}
    assert {v.constexprs["BLOCK_H"] for v in variants if v.fn.__name__ == "decode_kernel"} == rows


def test_prefill_tile_per_compile():
    # Hopper-class NVIDIA: the FEATURES compile on 32-key tiles (the 64-key one spills), the one-loop diagonal for
    # 16-bit caches when no sequence passes ONE_RUN_KEYS keys; AMD, sm80 and the interpreter keep their tile
    hopper = {"hip": False, "big_smem": True, "interp": False}
    plain = cfg.prefill_tile(128, 2, **hopper)
    assert (plain.block_m, plain.block_n, plain.num_warps, plain.bt_ahead, plain.one_run) == (256, 64, 16, True, False)
    assert cfg.prefill_tile(128, 2, **hopper, features=True).block_n == 32
    assert cfg.prefill_tile(128, 1, **hopper, features=True).block_n == 64  # fp8 caches lost at 32 keys
    assert cfg.prefill_tile(128, 2, **hopper, short_keys=True).one_run
    assert not cfg.prefill_tile(128, 1, **hopper, short_keys=True).one_run
    assert not cfg.prefill_tile(128, 2, **hopper, features=True, short_keys=True).one_run
    assert not cfg.prefill_tile(128, 2, hip=True, big_smem=False, interp=False, short_keys=True).one_run
    assert not cfg.prefill_tile(128, 2, hip=False, big_smem=False, interp=False, short_keys=True).one_run
    assert not cfg.prefill_tile(64, 2, **hopper, short_keys=True).one_run  # no block ids ahead on that tile
    assert not cfg.prefill_tile(128, 2, hip=False, big_smem=False, interp=True, short_keys=True).one_run
    with cfg.override(prefill_one_run=1):
        assert cfg.prefill_tile(128, 2, hip=False, big_smem=False, interp=True).one_run  # the CPU tests' way in
        assert not cfg.prefill_tile(128, 2, hip=False, big_smem=False, interp=True, features=True).one_run


def test_short_query_rows_per_target():
    # 8 tokens x group 4 = 32 rows: the 32-row tile, or the 64-row one where that one loads its block ids a tile
    # ahead (Hopper-class NVIDIA; not AMD, whatever its shared memory)
    assert decode_rows(4, 8, True) == 32
    assert decode_rows(4, 8, True, hip=True, big_smem=True) == 32
    assert decode_rows(4, 8, True, hip=False, big_smem=True) == 64
    assert decode_rows(4, 16, True, hip=False, big_smem=True) == 64
    assert decode_rows(4, 4, True, hip=False, big_smem=True) == 16  # the decode tile holds 4 tokens x 4 heads
    assert decode_rows(4, 17, True, hip=False, big_smem=True) == 16  # a prefill in the batch keeps the decode tile
    with cfg.override(short_rows=32):
        assert decode_rows(4, 8, True, hip=False, big_smem=True) == 32


def _feature_sets():
    # every subset of (window, softcap, alibi, sinks) x causal on/off (a window needs causal)
    for mask in range(16):
        window, softcap, alibi, sinks = (bool(mask >> i & 1) for i in range(4))
        for causal in (True, False):
            if window and not causal:
                continue
            yield {"causal": causal, "window": 13 if window else 0, "softcap": 2.5 if softcap else 0.0,
                   "alibi": alibi, "sinks": sinks}


@pytest.mark.parametrize("target", TARGETS)
def test_every_dispatcher_choice_is_compiled(target):
    """The compile check is honest: whatever the inputs, the dispatcher only picks listed variants."""
    listed = {variant_key(v) for v in compile_variants(target)}
    hip, big_smem = _target_info(target)
    fp8 = target_fp8(target)
    chosen = set()
    calls = 0
    for qdt in QUERY_DTYPES:
        for kdt in [qdt, *fp8]:
            for head in HEAD_SIZES:
                for block in (BLOCK_SIZES[0], BLOCK_SIZES[-1]):
                    # the block size is a run-time value that select() does not read: the smallest and the
                    # largest, the largest with V's own strides, so both addressings meet every other axis
                    same_kv = block != BLOCK_SIZES[-1]
                    for group in (1, 7, 33):
                        for feats in _feature_sets():
                            for max_query_len in (1, 4, 16, 300):
                                # short: no sequence past attention_config.ONE_RUN_KEYS keys
                                for num_splits, fused, stream, rows, short in (
                                        (1, False, False, False, False), (37, False, False, False, False),
                                        (37, False, False, True, False), (128, True, False, True, False),
                                        (37, False, True, False, False), (37, False, True, True, False),
                                        (128, True, True, False, False), (1, False, False, False, True),
                                        (37, False, False, True, True)):
                                    plan = select(qdt, kdt, head, block, group, max_query_len=max_query_len,
                                                  num_splits=num_splits, fused=fused, hip=hip, big_smem=big_smem,
                                                  interp=False, stream=stream, merge_rows=rows, short_keys=short,
                                                  same_kv=same_kv, **feats)
                                    calls += 1
                                    kinds = [v.fn.__name__ for v in plan]
                                    assert kinds[0] == "decode_kernel"
                                    merge = "reduce_rows_kernel" if rows else "reduce_kernel"
                                    assert (merge in kinds) == (num_splits > 1 and not fused)
                                    assert len(kinds) == len(set(kinds))  # one merge at most
                                    # causal queries up to SHORT_MAX tokens go through the decode kernel
                                    short = SHORT_MAX if feats["causal"] else 1
                                    assert ("prefill_kernel" in kinds) == (max_query_len > short)
                                    for v in plan:
                                        if "SAME_KV" in v.constexprs:
                                            assert v.constexprs["SAME_KV"] == same_kv, v.name
                                        key = variant_key(v)
                                        assert key in listed, f"{target}: {v.name} {v.constexprs} not listed"
                                        chosen.add(key)
    assert calls > 10_000
    assert chosen == listed  # nothing listed that the dispatcher never picks


@pytest.mark.parametrize("target", ["sm80", "gfx90a", "gfx1100"])
def test_no_fp8_on_targets_without_it(target):
    assert target_fp8(target) == []


def test_fp8_refused_on_a_gpu_without_it(monkeypatch):
    import importlib

    pa = importlib.import_module("kvcached.kernels.paged_attention")
    args, kw = _case()
    q, k, v, bt, sl, qsl = args
    # pretend the tensors live on an A100-class GPU: validation must refuse fp8 before any launch
    monkeypatch.setattr(pa, "_fp8_kv_dtypes", lambda dev: ())
    monkeypatch.setattr(pa, "device_target", lambda dev: "sm80")
    k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="no fp8 support"):
        paged_attention(q, k8, v8, bt, sl, qsl, k_scale=1.0, v_scale=1.0, **kw)


def test_compile_variants_unknown_target():
    with pytest.raises(ValueError, match="unknown compile target"):
        compile_variants("sm7x")


def test_split_heuristic_fills_the_gpu():
    from kvcached.kernels.attention_config import _pick_splits

    # H200-like: 132 SMs, 8 KV heads, 8k context, 64-key tiles
    assert _pick_splits(1 * 8, 8192, 64, 132, hip=False)[0] >= 32
    # a batch below one wave of programs: the grid has room for runs of the batch's mean, the kernel plans them
    splits, balance, waves = _pick_splits(8 * 8, 8192, 64, 132, hip=False)
    assert balance == 132 * 4 and waves == 1 and 8 <= splits <= 64
    # a batch of more than a quarter of a wave of programs: the kernel checks for a second wave
    assert _pick_splits(40 * 8, 8192, 64, 132, hip=False)[1:] == (132 * 4, 2)
    with cfg.override(split_waves=0):  # equal splits per sequence, one wave
        assert _pick_splits(8 * 8, 8192, 64, 132, hip=False) == (8, 0, 1)
    assert _pick_splits(256 * 8, 8192, 64, 132, hip=False) == (1, 0, 1)
    assert _pick_splits(1 * 8, 100, 64, 132, hip=False) == (1, 0, 1)  # too short to be worth a reduce
    assert _pick_splits(1 * 8, 8192, 64, 304, hip=True)[0] > 1  # MI300X
    with cfg.override(decode_num_splits=5):
        assert cfg.decode_config(3, 2, 32, 16, 2, 100, 0).num_splits == 5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("given", [{"k_scale": 0.5}, {"v_scale": torch.tensor([2.0])},
                                   {"k_scale": 1.0, "v_scale": 1.0}])
def test_scales_on_a_cache_that_is_not_fp8_are_refused_as_write_kv_cache_refuses_them(dtype, given):
    from kvcached.kernels import write_kv_cache

    args, kw = _case(dtype=dtype)
    q, k, v = args[:3]
    given = {n: (s.to(DEVICE) if isinstance(s, torch.Tensor) else s) for n, s in given.items()}
    with pytest.raises(ValueError) as written:
        write_kv_cache(q[:2, :2], q[:2, :2], k, v, torch.tensor([0, 1], device=DEVICE), **given)
    with pytest.raises(ValueError) as attended:
        paged_attention(*args, **kw, **given)
    assert str(attended.value) == str(written.value)
    assert "fp8 caches only" in str(attended.value)

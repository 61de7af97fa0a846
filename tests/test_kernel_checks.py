"""KVCACHED_KERNEL_CHECKS=1: a bad value in a device tensor raises ValueError naming the entry,
before any launch (these inputs segfault the interpreter or give NaN otherwise); good inputs
pass unchanged; with the mode off the check is never called. And one fp8 scale rule for all."""

from __future__ import annotations

import importlib

import pytest
import torch

from kvcached.kernels import checks, paged_attention, paged_mla_decode, write_kv_cache
from kvcached.kernels.reference import random_batch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
NAN = float("nan")


KERNEL_MODULES = [importlib.import_module(f"kvcached.kernels.{m}") for m in ("paged_attention", "write_kv",
                                                                               "mla_decode")]


@pytest.fixture
def checks_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_KERNEL_CHECKS", "1")


@pytest.fixture
def no_launch(checks_on: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bad inputs must be refused before any launch (launched, they crash the interpreter)."""
    def launched(*args, **kwargs):
        raise AssertionError("the kernel was launched on a bad input")

    for module in KERNEL_MODULES:
        monkeypatch.setattr(module, "_launch", launched)


# -- paged_attention: 64 blocks of 16 tokens; sequence 0 reads 2 table entries, sequence 1 one ------------
def attn(kv_dtype=torch.float16) -> dict:
    g = torch.Generator().manual_seed(0)
    k = torch.randn(64, 16, 2, 32, generator=g).to(DEV, kv_dtype)
    v = torch.randn(64, 16, 2, 32, generator=g).to(DEV, kv_dtype)
    q, bt, sl, qsl = random_batch([1, 4], [20, 4], 4, 32, 16, 64, torch.float16, generator=g, device=DEV)
    return {"args": [q, k, v, bt, sl, qsl], "kw": {"max_query_len": 4, "max_seq_len": 20}}


def run_attn(c: dict) -> torch.Tensor:
    return paged_attention(*c["args"], **c["kw"])


def _set(index: int, at: tuple, value: int):
    def mutate(c: dict) -> None:
        c["args"][index][at] = value

    return mutate


def _qsl(values: list[int]):
    def mutate(c: dict) -> None:
        c["args"][5].copy_(torch.tensor(values, dtype=torch.int32))

    return mutate


def _kw(**kw):
    return lambda c: c["kw"].update(kw)


ATTN_BAD = {
    "block-past-cache": (_set(3, (1, 0), 9000), r"block_table\[1, 0\] = 9000 is outside the cache's 64 blocks"),
    "block-negative": (_set(3, (0, 1), -1), r"block_table\[0, 1\] = -1 is outside the cache's 64 blocks"),
    "seq-len-above-max": (_set(4, (0,), 21), r"seq_lens\[0\] = 21 is outside \[0, max_seq_len = 20\]"),
    "seq-len-negative": (_set(4, (1,), -3), r"seq_lens\[1\] = -3 is outside"),
    "seq-shorter-than-query": (_set(4, (1,), 2), r"seq_lens\[1\] = 2 is shorter than its 4 query tokens"),
    "qsl-not-from-zero": (_qsl([1, 1, 5]), r"query_start_loc\[0\] = 1; the offsets must start at 0"),
    "qsl-decreasing": (_qsl([0, 3, 2]), r"query_start_loc\[2\] = 2 is below query_start_loc\[1\] = 3"),
    "qsl-end-not-num-tokens": (_qsl([0, 1, 4]), r"query_start_loc\[2\] = 4 but the query has 5 tokens"),
    "query-past-max-query-len": (_kw(max_query_len=3), r"sequence 1 has 4 query tokens, more than max_query_len = 3"),
    "query-below-min-query-len": (_kw(min_query_len=2), r"sequence 0 has 1 query tokens, fewer than min_query_len = 2"),
}


@pytest.mark.parametrize("kind", list(ATTN_BAD))
def test_paged_attention_bad_entry(kind: str, no_launch: None) -> None:
    mutate, pattern = ATTN_BAD[kind]
    c = attn()
    mutate(c)
    with pytest.raises(ValueError, match="paged_attention: " + pattern):
        run_attn(c)


def test_paged_attention_good_input_and_unread_entries_pass(checks_on: None, monkeypatch) -> None:
    c = attn()
    c["args"][3][1, 1:] = 9000  # past sequence 1's one block: never read, so not an error
    c["args"][3][0, 2] = -7  # the spare column of sequence 0
    got = run_attn(c)
    monkeypatch.setenv("KVCACHED_KERNEL_CHECKS", "0")
    torch.testing.assert_close(got, run_attn(c), rtol=0, atol=0)


@pytest.mark.parametrize("bad", [0.0, -1.0, NAN, float("inf")])
def test_fp8_tensor_scales_are_checked_on_the_device(bad: float, no_launch: None) -> None:
    c = attn(FP8)
    c["kw"].update(k_scale=torch.tensor([0.5], device=DEV), v_scale=torch.tensor([bad], device=DEV))
    with pytest.raises(ValueError, match=r"paged_attention: v_scale = .* must be positive and finite"):
        run_attn(c)
    c = attn()
    write = torch.zeros(2, 2, 32, dtype=torch.float16, device=DEV)
    cache = torch.zeros(4, 16, 2, 32, device=DEV).to(FP8)
    with pytest.raises(ValueError, match=r"write_kv_cache: k_scale = .* must be positive and finite"):
        write_kv_cache(write, write, cache, cache.clone(), torch.tensor([0, 1], device=DEV),
                       k_scale=torch.tensor(bad, device=DEV), v_scale=1.0)
    m = mla()
    m["kv_cache"] = m["kv_cache"].to(FP8)
    with pytest.raises(ValueError, match=r"paged_mla_decode: kv_scale = .* must be positive and finite"):
        run_mla(m, kv_scale=torch.tensor([bad], device=DEV))


@pytest.mark.parametrize("bad", [0, -1.0, NAN, float("inf"), True, "1"])
def test_one_scale_rule_for_float_scales(bad, no_launch: None) -> None:
    """Always on (no sync needed): every kernel refuses the same float scales."""
    c = attn(FP8)
    c["kw"].update(k_scale=bad)
    with pytest.raises(ValueError, match="k_scale must be a positive finite float"):
        run_attn(c)
    x = torch.zeros(2, 2, 32, dtype=torch.float16, device=DEV)
    cache = torch.zeros(4, 16, 2, 32, device=DEV).to(FP8)
    with pytest.raises(ValueError, match="v_scale must be a positive finite float"):
        write_kv_cache(x, x, cache, cache.clone(), torch.tensor([0, 1], device=DEV), k_scale=1.0, v_scale=bad)
    m = mla()
    m["kv_cache"] = m["kv_cache"].to(FP8)
    with pytest.raises(ValueError, match="kv_scale must be a positive finite float"):
        run_mla(m, kv_scale=bad)


# -- write_kv_cache: 4 blocks of 16 tokens = 64 slots ---------------------------------------------------------
@pytest.mark.parametrize("slots, pattern", [
    ([0, 64, 3], r"slot_mapping\[1\] = 64 is outside the cache's 4 blocks x 16 tokens = 64 slots"),
    ([5, -1, -5], r"slot_mapping\[2\] = -5 is outside"),
])
def test_write_kv_bad_slot(slots, pattern, no_launch: None) -> None:
    x = torch.ones(3, 2, 32, dtype=torch.float16, device=DEV)
    cache = torch.zeros(4, 16, 2, 32, dtype=torch.float16, device=DEV)
    with pytest.raises(ValueError, match="write_kv_cache: " + pattern):
        write_kv_cache(x, x, cache, cache.clone(), torch.tensor(slots, device=DEV))
    assert not cache.any(), "nothing may be written when the check fails"


def test_write_kv_good_slots_with_padding_pass(checks_on: None) -> None:
    x = torch.ones(3, 2, 32, dtype=torch.float16, device=DEV)
    kc, vc = (torch.zeros(4, 16, 2, 32, dtype=torch.float16, device=DEV) for _ in range(2))
    write_kv_cache(x, x, kc, vc, torch.tensor([63, -1, 0], dtype=torch.int32, device=DEV))
    assert kc[3, 15].eq(1).all() and kc[0, 0].eq(1).all() and int(kc.count_nonzero()) == 2 * 64


# -- paged_mla_decode: 40 blocks of 16 tokens, 2 sequences reading 3 and 1 table entries ----------------------
def mla() -> dict:
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(40, 16, 576, generator=g).to(DEV, torch.bfloat16)
    q = torch.randn(2, 16, 576, generator=g).to(DEV, torch.bfloat16)
    table = torch.tensor([[3, 7, 11, 0], [5, 0, 0, 0]], dtype=torch.int32, device=DEV)
    return {"query": q, "kv_cache": cache, "block_table": table,
            "seq_lens": torch.tensor([40, 9], dtype=torch.int32, device=DEV)}


def run_mla(m: dict, **kw) -> torch.Tensor:
    return paged_mla_decode(m["query"], m["kv_cache"], m["block_table"], m["seq_lens"], scale=0.05, **kw)


MLA_BAD = {
    "block-past-cache": (("block_table", (0, 2), 40), {}, r"block_table\[0, 2\] = 40 is outside the cache's 40 blocks"),
    "block-negative": (("block_table", (1, 0), -2), {}, r"block_table\[1, 0\] = -2 is outside"),
    "seq-len-past-table": (("seq_lens", (1,), 65), {}, r"seq_lens\[1\] = 65 is outside \[0, max_seq_len = 64\]"),
    "seq-len-above-max": (("seq_lens", (0,), 41), {"max_seq_len": 40}, r"seq_lens\[0\] = 41 is outside"),
    "seq-len-negative": (("seq_lens", (0,), -1), {}, r"seq_lens\[0\] = -1 is outside"),
}


@pytest.mark.parametrize("kind", list(MLA_BAD))
def test_mla_decode_bad_entry(kind: str, no_launch: None) -> None:
    (name, at, value), kw, pattern = MLA_BAD[kind]
    m = mla()
    m[name][at] = value
    with pytest.raises(ValueError, match="paged_mla_decode: " + pattern):
        run_mla(m, **kw)


def test_mla_decode_good_input_passes(checks_on: None, monkeypatch) -> None:
    m = mla()
    m["block_table"][1, 1:] = 9999  # never read: sequence 1 has 9 tokens
    got = run_mla(m, max_seq_len=40)
    monkeypatch.setenv("KVCACHED_KERNEL_CHECKS", "0")
    torch.testing.assert_close(got, run_mla(m, max_seq_len=40), rtol=0, atol=0)


@pytest.mark.parametrize("kw, pattern", [
    ({"max_seq_len": 65}, r"max_seq_len must be an int in \[0, 64\]"),
    ({"max_seq_len": True}, "max_seq_len must be an int"),
    ({"scale": NAN}, "scale must be a finite float"),
    ({"kv_lora_rank": True}, "kv_lora_rank must be an int"),
    ({"num_splits": True}, "num_splits must be a positive int"),
])
def test_mla_decode_host_checks(kw, pattern, no_launch: None) -> None:
    m = mla()
    with pytest.raises(ValueError, match=pattern):
        paged_mla_decode(m["query"], m["kv_cache"], m["block_table"], m["seq_lens"], **{"scale": 0.05, **kw})


# -- the mode off never calls the checks (so never syncs) -------------------------------------------------------
def test_mode_off_never_calls_the_checks(monkeypatch) -> None:
    def called(*args, **kwargs):
        raise AssertionError("a device check ran")

    for name in ("check_paged_attention", "check_write_kv", "check_mla_decode"):
        monkeypatch.setattr(checks, name, called)
    x = torch.ones(1, 2, 32, dtype=torch.float16, device=DEV)
    cache = torch.zeros(4, 16, 2, 32, dtype=torch.float16, device=DEV)
    calls = [
        lambda: run_attn(attn()),
        lambda: write_kv_cache(x, x, cache, cache.clone(), torch.tensor([2], device=DEV)),
        lambda: run_mla(mla()),
    ]
    for value in (None, "0", "false"):
        if value is None:
            monkeypatch.delenv("KVCACHED_KERNEL_CHECKS", raising=False)
        else:
            monkeypatch.setenv("KVCACHED_KERNEL_CHECKS", value)
        for call in calls:
            call()
    monkeypatch.setenv("KVCACHED_KERNEL_CHECKS", "1")  # the patch is what the kernels call
    for call in calls:
        with pytest.raises(AssertionError, match="a device check ran"):
            call()


def test_a_bad_mode_value_is_a_config_error(monkeypatch) -> None:
    from kvcached.errors import KVCachedConfigError

    monkeypatch.setenv("KVCACHED_KERNEL_CHECKS", "sometimes")
    with pytest.raises(KVCachedConfigError, match="KVCACHED_KERNEL_CHECKS='sometimes' is not a boolean"):
        run_attn(attn())

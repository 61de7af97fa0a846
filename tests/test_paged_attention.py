"""Paged attention against a float64 reference, on both layouts and both view shapes.

On a machine without a GPU this runs in Triton's interpreter at small sizes.
Tolerance: relative error of the whole output (||out - ref|| / ||ref||) below
``TOL[dtype]``; a wrong mask, a wrong stride or one unwritten (NaN-poisoned)
element all give errors far above it.
"""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch

from kvcached.kernels import attention_config as cfg
from kvcached.kernels.paged_attention import paged_attention
from kvcached.kernels.platform import fp8_kv_dtype
from kvcached.kernels.reference import paged_attention_ref, paged_kv_case, random_batch, relative_error

# fp16 output rounding alone is ~3e-4 relative; bf16 ~3e-3. On the GPU p is rounded too.
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.2e-2}
LAYOUTS = ("contiguous", "per_layer")
STYLES = ("flash_attn", "flashinfer", "sglang")  # sglang: per-token buffers as pages (token-major)
NUM_BLOCKS = 64
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter handles both fp8 flavours; a GPU only its vendor's
FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz) if DEVICE == "cpu" else (fp8_kv_dtype(),)

# decode, chunked prefill (context before the new tokens), whole prefill, decode
MIXED_Q = [1, 19, 40, 1]
MIXED_S = [45, 60, 40, 17]


def run_case(
    *,
    layout="contiguous",
    style="flash_attn",
    dtype=torch.float16,
    kv_dtype=None,
    num_heads=4,
    num_kv_heads=2,
    head_size=32,
    block_size=16,
    q_lens=MIXED_Q,
    seq_lens=MIXED_S,
    splits=3,
    seed=0,
    tol=None,
    query_mul=1.0,
    **features,
):
    gen = torch.Generator().manual_seed(seed)
    k, v, _, _ = paged_kv_case(
        layout=layout, style=style, num_kv_heads=num_kv_heads, head_size=head_size, block_size=block_size,
        dtype=kv_dtype or dtype, num_blocks=NUM_BLOCKS, generator=gen, device=DEVICE,
    )  # fmt: skip
    query, bt, sl, qsl = random_batch(q_lens, seq_lens, num_heads, head_size, block_size, k.shape[0], dtype,
                                      generator=gen, device=DEVICE)
    if query_mul != 1.0:
        query = (query.double() * query_mul).to(dtype)
    features = {n: f.to(DEVICE) if isinstance(f, torch.Tensor) else f for n, f in features.items()}
    out = torch.full_like(query, float("nan"))
    with cfg.override(decode_num_splits=splits) if splits else contextlib.nullcontext():  # None: the dispatcher's
        got = paged_attention(query, k, v, bt, sl, qsl, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
                              out=out, **features)
    assert got is out
    ref = paged_attention_ref(query, k, v, bt, sl, qsl, **features)
    err = relative_error(out, ref)
    assert err < (tol or TOL[dtype]), f"relative error {err:.3e}"
    return out, ref


def _features(name: str, num_heads: int = 4) -> dict:
    g = torch.Generator().manual_seed(7)
    alibi = torch.rand(num_heads, generator=g) * 0.5
    sinks = torch.randn(num_heads, generator=g) * 2
    return {
        "none": {},
        "window": {"sliding_window": 13},
        "softcap": {"softcap": 2.0, "scale": 0.5},
        "alibi": {"alibi_slopes": alibi},
        "sinks": {"sinks": sinks},
        "noncausal": {"causal": False},
        "all": {"sliding_window": 21, "softcap": 3.0, "alibi_slopes": alibi, "sinks": sinks, "scale": 0.3},
    }[name]


@pytest.mark.pairwise
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("feature", ["none", "window", "softcap", "alibi", "sinks", "noncausal", "all"])
def test_features_mixed_batch(feature, layout, style):
    run_case(layout=layout, style=style, **_features(feature))


@pytest.mark.pairwise
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dtypes(dtype, layout, style):
    run_case(layout=layout, style=style, dtype=dtype, seed=1)


@pytest.mark.pairwise
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp8_kv(dtype, fp8, layout, style):
    # tensor scale for K, float for V; the reference dequantises the same fp8 values exactly
    run_case(layout=layout, style=style, dtype=dtype, kv_dtype=fp8, k_scale=torch.tensor([0.37]), v_scale=1.9,
             seed=2)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_kv_bf16_queries_past_fp16_range(layout):
    # with an fp8 cache the decode's products run in fp16 (attention_common.fp8_query), a bf16 query scaled by 2^-8
    # into it: queries of up to ~1e5 (fp16's largest value is 65504) still give the right output. Here the
    # interpreter fails without the 2^-8; on a GPU this also fails if the compiler moves the multiply after the
    # conversion (LLVM did, H100 2026-12-08: NaN)
    run_case(layout=layout, dtype=torch.bfloat16, kv_dtype=FP8[0], k_scale=torch.tensor([0.37]), v_scale=1.9,
             query_mul=3e4, scale=32**-0.5 / 3e4, seed=3)


@pytest.mark.parametrize("head_size", [32, 64, 80, 96, 128, 256])
def test_head_sizes(head_size):
    run_case(head_size=head_size, num_heads=2, num_kv_heads=1, q_lens=[1, 20], seq_lens=[33, 20], seed=3)


@pytest.mark.parametrize("block_size", [1, 8, 16, 32, 64, 128])  # 1: SGLang's default page
def test_block_sizes(block_size):
    run_case(block_size=block_size, layout="per_layer", q_lens=[1, 9, 1], seq_lens=[150, 40, 129], seed=4)


# (36, 1): a group of 36 takes three decode programs per KV head (16 + 16 + 4 query heads) and two prefill
# programs (the interpreter's 32 rows); (6, 2): a group of 3 fills 30 of the prefill tile's 32 rows (10 tokens)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (8, 1), (6, 3), (6, 2), (36, 1)])
def test_gqa_mqa(num_heads, num_kv_heads):
    run_case(num_heads=num_heads, num_kv_heads=num_kv_heads, seed=5, **_features("all", num_heads))


@pytest.mark.parametrize("splits", [1, 2, 5, 16])
@pytest.mark.parametrize("feature", ["none", "sinks", "window"])
def test_decode_splits(splits, feature):
    # 16 splits of >= 32 keys leave some splits of the short sequences empty
    run_case(q_lens=[1, 1, 1], seq_lens=[200, 3, 64], splits=splits, seed=6, **_features(feature))


@pytest.mark.parametrize("feature", ["none", "all", "noncausal", "window"])
def test_prefill_hopper_tiles(feature):
    # the sm90 prefill tile (128 x 128 keys): a query tile wider than some prompts, keys past the blocks
    with cfg.override(prefill_block_m=128, prefill_block_n=128):
        run_case(q_lens=[1, 150, 40, 1], seq_lens=[45, 200, 40, 17], seed=16, **_features(feature))


@pytest.mark.parametrize("ahead", [0, 1])
@pytest.mark.parametrize(("feature", "layout"),
                         [("none", "contiguous"), ("window", "per_layer"), ("all", "contiguous")])
def test_block_ids_a_tile_ahead_or_not(ahead, feature, layout):
    # Both key loops of attention_common._tile_run (the interpreter's default loads block ids a tile ahead): the
    # window's masked lead, the unmasked middle and the masked tail of the prefill, one-column decodes with
    # splits, a short query, and (second call) the stream-K launch; block size 16 against 32-key tiles, so a
    # tile spans two blocks and the last tile of most sequences is partial
    with cfg.override(decode_bt_ahead=ahead, prefill_bt_ahead=ahead):
        run_case(layout=layout, q_lens=[1, 150, 5, 1, 40], seq_lens=[300, 200, 90, 17, 40], seed=41,
                 **_features(feature))
        run_case(layout=layout, q_lens=[1, 3, 1], seq_lens=[500, 70, 9], splits=None, seed=42, **_features(feature))


@pytest.mark.parametrize(("layout", "block_size", "heads"),
                         [("contiguous", 16, (4, 2)), ("per_layer", 64, (6, 2)), ("contiguous", 32, (8, 1))])
def test_prefill_diagonal_in_one_loop(layout, block_size, heads):
    # attn_tiles' ONE_RUN (Hopper's choice for prompts of at most ONE_RUN_KEYS keys): the diagonal tiles in the
    # interior loop behind a run-time mask; chunks after a context, prompts shorter than a tile, lengths off the
    # tile and block edges, a group of 3 in the 32-row tile (padding rows), decodes beside them; bf16 too
    with cfg.override(prefill_one_run=1):
        for dtype in (torch.float16, torch.bfloat16):
            run_case(layout=layout, block_size=block_size, num_heads=heads[0], num_kv_heads=heads[1], dtype=dtype,
                     q_lens=[150, 1, 40, 33, 7, 64], seq_lens=[200, 300, 40, 97, 7, 64], splits=None, seed=43)


@pytest.mark.parametrize("fused", [0, 1])
def test_split_merge_paths_and_repeat(fused):
    # the in-kernel merge leaves its counters at zero: a second call (other lengths) is right too
    with cfg.override(decode_fused_reduce=fused):
        run_case(q_lens=[1, 1, 1], seq_lens=[200, 3, 64], splits=5, seed=13, **_features("sinks"))
        run_case(q_lens=[1, 1], seq_lens=[90, 130], splits=7, seed=14)


@pytest.mark.pairwise
@pytest.mark.parametrize("fused", [0, 1])
@pytest.mark.parametrize("feature", ["none", "window", "sinks"])
@pytest.mark.parametrize("floor", [None, 0])
def test_balanced_splits_for_uneven_lengths(fused, feature, floor):
    # the dispatcher's own split plan for a small batch of uneven lengths: the kernel cuts each sequence into
    # runs of about the batch's mean (the longest into as many as the grid has, the shortest into one, leaving
    # splits empty), for decodes and a short query alike. The short sequences leave one wave's runs a second
    # wave (interpreter: 32 slots, runs of 125 keys, 19 runs x 2 KV heads), so the kernel plans two waves of
    # runs half as long: with floor 0 it cuts them (the default floor of 1024 keys keeps one wave's runs)
    q_lens, seq_lens = [1, 1, 1, 1, 4, 1], [16, 20, 1000, 30, 900, 25]
    knobs = {"stream": 0} if floor is None else {"split_run_floor": floor, "stream": 0}
    with cfg.override(**knobs):
        plan = cfg.decode_config(len(q_lens), 2, 32, 16, 2, max(seq_lens), 0)
    assert plan.num_splits > 1 and plan.balance > 0 and plan.waves == 2, plan
    with cfg.override(decode_fused_reduce=fused, **knobs):
        run_case(q_lens=q_lens, seq_lens=seq_lens, splits=None, seed=26, **_features(feature))


@pytest.mark.pairwise
@pytest.mark.parametrize("fused", [0, 1])
@pytest.mark.parametrize("feature", ["none", "window", "sinks", "all"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_stream_k_for_uneven_lengths(fused, feature, layout):
    # The dispatcher's stream-K plan (a batch of one-block queries with fewer programs than slots): each head
    # slot's 16 programs (interpreter: 32 slots, 2 KV heads) share the batch's 65 key tiles of 32, 5 a program,
    # so the long sequences span several programs and a program spans several short ones (and a short query)
    q_lens, seq_lens = [1, 1, 1, 1, 4, 1], [16, 20, 1000, 30, 900, 25]
    plan = cfg.decode_config(len(q_lens), 2, 32, 16, 2, max(seq_lens), 0, True)
    assert plan.stream == 16 and plan.num_splits == len(q_lens) + 16, plan
    with cfg.override(decode_fused_reduce=fused):
        run_case(layout=layout, q_lens=q_lens, seq_lens=seq_lens, splits=None, seed=27, **_features(feature))
        # again with other lengths: the fused merge's counters are back at zero
        run_case(layout=layout, q_lens=[1, 2, 1], seq_lens=[700, 40, 3], splits=None, seed=28, **_features(feature))


@pytest.mark.parametrize("fused", [0, 1])
def test_stream_k_beside_a_prefill(fused):
    # MHA (group 1): 16 rows hold 16 tokens of one head, so decodes and short queries fit one block even beside
    # a prefill, and the batch goes to the stream-K launch; the prefill and the empty query get no key tiles there
    q_lens, seq_lens = [1, 40, 3, 0, 16, 1], [300, 40, 90, 5, 500, 7]
    plan = cfg.decode_config(len(q_lens), 2, 32, 16, 2, max(seq_lens), 0, True)
    assert plan.stream > 0, plan
    with cfg.override(decode_fused_reduce=fused):
        run_case(q_lens=q_lens, seq_lens=seq_lens, num_heads=2, num_kv_heads=2, splits=None, seed=33)


@pytest.mark.parametrize("stream", [0, 1])
def test_stream_k_past_a_wave(stream):
    # 20 sequences x 2 KV heads: more programs than the interpreter's 32 slots, at most STREAM_SEQS (2) sequences
    # a stream-K program (16 a head slot): stream-K, or with the knob off the one-column launch; 33 sequences
    # are left to the one-column launch
    rng = torch.Generator().manual_seed(31)
    seq_lens = torch.randint(1, 400, (20,), generator=rng).tolist()
    assert cfg.decode_config(32, 2, 32, 16, 2, 399, 0, True).stream == 16
    assert cfg.decode_config(33, 2, 32, 16, 2, 399, 0, True).stream == 0
    with cfg.override(stream=stream):
        plan = cfg.decode_config(20, 2, 32, 16, 2, max(seq_lens), 0, True)
        assert plan.stream == 16 * stream, plan
        run_case(q_lens=[1] * 20, seq_lens=seq_lens, splits=None, seed=32, **_features("sinks"))


def test_stream_k_batch_over_one_planning_chunk():
    # 260 sequences (the kernel plans 256 lengths at a time), 1 KV head over 320 slots, runs down to one tile
    rng = torch.Generator().manual_seed(29)
    seq_lens = torch.randint(1, 48, (260,), generator=rng).tolist()
    with cfg.override(programs_per_sm=40, min_keys_per_split=16):
        plan = cfg.decode_config(260, 1, 32, 16, 2, max(seq_lens), 0, True)
        assert plan.stream == 320 and plan.min_tiles == 1, plan
        run_case(q_lens=[1] * 260, seq_lens=seq_lens, num_heads=2, num_kv_heads=1, splits=None, seed=30)


# short queries (speculative-decoding checks, drafts, a chunk's tail) beside a decode: the decode kernel's rows
SHORT_Q = [4, 1, 16, 2, 9]
SHORT_S = [45, 30, 60, 17, 33]


@pytest.mark.pairwise
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (8, 1), (4, 4), (16, 1), (32, 1)])
@pytest.mark.parametrize("splits", [1, 3])
def test_short_queries(layout, num_heads, num_kv_heads, splits):
    run_case(layout=layout, num_heads=num_heads, num_kv_heads=num_kv_heads, q_lens=SHORT_Q, seq_lens=SHORT_S,
             splits=splits, seed=21)


@pytest.mark.parametrize("feature", ["window", "softcap", "alibi", "sinks", "all"])
@pytest.mark.parametrize("splits", [1, 4])
def test_short_queries_features(feature, splits):
    run_case(q_lens=SHORT_Q, seq_lens=SHORT_S, splits=splits, seed=22, **_features(feature))


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "feature"), [(4, 2, "sinks"), (8, 1, "none"), (32, 1, "sinks"),
                                                                     (36, 1, "none")])
@pytest.mark.parametrize("rows", [0, 1])
def test_reduce_launch_merges_a_programs_rows(num_heads, num_kv_heads, feature, rows):
    # The merge's own launch (as under CUDA graphs), a row at a time or a decode program's rows together: the
    # 32-row tile (16 tokens x group 2), the 64-row tile with two token blocks (group 8) and with 2 tokens of 32
    # heads a program (group 32, eight token blocks), and 36 heads of one token (group 36), beside 1- to 9-token
    # queries; then single tokens through the stream-K launch (some sequences written by their one program)
    with cfg.override(decode_fused_reduce=0, merge_rows=rows):
        run_case(num_heads=num_heads, num_kv_heads=num_kv_heads, q_lens=SHORT_Q, seq_lens=SHORT_S, splits=3,
                 seed=43, **_features(feature, num_heads))
        run_case(num_heads=num_heads, num_kv_heads=num_kv_heads, q_lens=[1, 1, 1, 1], seq_lens=[700, 30, 5, 90],
                 splits=None, seed=44, **_features(feature, num_heads))


@pytest.mark.parametrize("fused", [0, 1])
def test_short_queries_beside_a_prefill(fused):
    # a prefill in the batch keeps the 16-row tile: the short queries take a program per few tokens
    with cfg.override(decode_fused_reduce=fused):
        run_case(q_lens=[4, 40, 1, 16, 3], seq_lens=[45, 40, 17, 70, 3], splits=3, seed=23)
        run_case(q_lens=[7, 2], seq_lens=[90, 130], num_heads=8, num_kv_heads=1, splits=5, seed=24)


@pytest.mark.parametrize("min_query_len", [None, 16, 17])
def test_prefills_only_skip_the_decode_launch(min_query_len, monkeypatch):
    # min_query_len above SHORT_MAX: every query goes to the prefill kernel, so the decode kernel is not launched;
    # without the bound (or at SHORT_MAX and below) it is, since a sequence might be short
    pa = importlib.import_module("kvcached.kernels.paged_attention")
    launched = []
    run = pa.decode_kernel.run

    def spy(*args, **kwargs):
        launched.append(1)
        return run(*args, **kwargs)

    monkeypatch.setattr(pa.decode_kernel, "run", spy)  # kernel[grid](...) calls the instance's run
    q_lens, seq_lens = [40, 17, 33], [90, 17, 70]
    gen = torch.Generator().manual_seed(28)
    k, v, _, _ = paged_kv_case(layout="contiguous", style="flash_attn", num_kv_heads=2, head_size=32, block_size=16,
                               dtype=torch.float16, num_blocks=NUM_BLOCKS, generator=gen, device=DEVICE)
    query, bt, sl, qsl = random_batch(q_lens, seq_lens, 4, 32, 16, k.shape[0], torch.float16, generator=gen,
                                      device=DEVICE)
    with cfg.override(decode_num_splits=3):
        out = paged_attention(query, k, v, bt, sl, qsl, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
                              min_query_len=min_query_len)
    assert bool(launched) == (min_query_len is None or min_query_len <= 16)
    err = relative_error(out, paged_attention_ref(query, k, v, bt, sl, qsl))
    assert err < TOL[torch.float16], f"relative error {err:.3e}"


@pytest.mark.parametrize("lookup", [None, 4, 0])
def test_prefill_slots_behind_decodes(lookup):
    # vLLM's order (decodes first), prefills of several tiles (the interpreter's BLOCK_M is 32) with decodes and
    # a short query between them: every prefill tile must find its sequence, counted over the batch's starts
    # (the default lookup, 256 sequences) or by binary search (9 sequences against a lookup of 4; none compiled)
    knobs = {} if lookup is None else {"prefill_lookup": lookup}
    with cfg.override(**knobs):
        run_case(q_lens=[1, 1, 1, 70, 1, 33, 2, 65, 1], seq_lens=[20, 9, 40, 90, 33, 33, 50, 80, 3], splits=1,
                 seed=27)


@pytest.mark.parametrize("lookup", [-1, 3, 100])
def test_prefill_lookup_knob_must_be_a_power_of_two(lookup):
    with cfg.override(prefill_lookup=lookup), pytest.raises(ValueError, match="power of two"):
        cfg.prefill_tile(128, 2, hip=False, big_smem=True, interp=False)


def test_short_query_rows_are_causal():
    # every token of a 16-token query sees a different number of keys: a row given the last token's keys
    # (or the first's) is far off
    out, ref = run_case(q_lens=[16], seq_lens=[16], splits=1, seed=25)
    assert not torch.allclose(out[0].float(), out[15].float(), atol=1e-2)


def test_direct_launch_matches_the_custom_op(monkeypatch: pytest.MonkeyPatch):
    """A plain eager call launches directly; under a dispatch mode the same public call goes
    through torch.ops.kvcached.paged_attention, whose impl launches; both give the same bits."""
    import importlib
    import sys

    from torch.utils._python_dispatch import TorchDispatchMode

    pa = importlib.import_module("kvcached.kernels.paged_attention")

    class SeenOps(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    launched_from: list[str] = []
    launch = pa._launch

    def spy(*args):
        launched_from.append(sys._getframe(1).f_code.co_name)
        return launch(*args)

    monkeypatch.setattr(pa, "_launch", spy)
    gen = torch.Generator().manual_seed(15)
    k, v, _, _ = paged_kv_case(layout="contiguous", style="flash_attn", num_kv_heads=2, head_size=32, block_size=16,
                               dtype=torch.float16, num_blocks=NUM_BLOCKS, generator=gen, device=DEVICE)
    query, bt, sl, qsl = random_batch([1, 6], [70, 6], 4, 32, 16, k.shape[0], torch.float16,
                                      generator=gen, device=DEVICE)
    args = (query, k, v, bt, sl, qsl)
    kwargs = {"max_query_len": 6, "max_seq_len": 70, "scale": 0.2}

    eager = paged_attention(*args, **kwargs)
    assert launched_from == ["paged_attention"], "a plain eager call must launch directly, not through the op"

    launched_from.clear()
    via_op = torch.full_like(query, float("nan"))
    with SeenOps() as mode:
        paged_attention(*args, **kwargs, out=via_op)
    assert torch.ops.kvcached.paged_attention.default in mode.ops, "the call did not reach the op's dispatcher"
    assert launched_from == ["paged_attention_op"], f"launched from {launched_from}, not from the op's impl"
    assert torch.equal(eager, via_op)


def test_auto_splits_decode_and_empty_sequence():
    # a zero-length query (padding) must leave its rows alone and not disturb the others
    gen = torch.Generator().manual_seed(8)
    k, v, _, _ = paged_kv_case(layout="contiguous", style="flashinfer", num_kv_heads=2, head_size=32, block_size=16,
                               dtype=torch.bfloat16, num_blocks=NUM_BLOCKS, generator=gen, device=DEVICE)
    query, bt, sl, qsl = random_batch([1, 0, 1], [300, 5, 77], 4, 32, 16, k.shape[0], torch.bfloat16,
                                      generator=gen, device=DEVICE)
    out = torch.full_like(query, float("nan"))
    paged_attention(query, k, v, bt, sl, qsl, max_query_len=1, max_seq_len=300, out=out)
    ref = paged_attention_ref(query, k, v, bt, sl, qsl)
    assert relative_error(out, ref) < TOL[torch.bfloat16]


def test_strided_out_and_query():
    gen = torch.Generator().manual_seed(9)
    k, v, _, _ = paged_kv_case(layout="per_layer", style="flash_attn", num_kv_heads=2, head_size=64, block_size=32,
                               dtype=torch.float16, num_blocks=NUM_BLOCKS, generator=gen, device=DEVICE)
    query, bt, sl, qsl = random_batch([1, 30], [50, 30], 4, 64, 32, k.shape[0], torch.float16,
                                      generator=gen, device=DEVICE)
    wide_q = torch.randn(query.shape[0], 6, 64, generator=gen).to(DEVICE, torch.float16)
    wide_q[:, 1:5] = query
    q_view = wide_q[:, 1:5]  # token stride 6*64: not contiguous
    wide_out = torch.full((query.shape[0], 9, 64), float("nan"), dtype=torch.float16, device=DEVICE)
    out = wide_out[:, 2:6]
    got = paged_attention(q_view, k, v, bt, sl, qsl, max_query_len=30, max_seq_len=50, out=out)
    assert got.data_ptr() == out.data_ptr()
    ref = paged_attention_ref(query, k, v, bt, sl, qsl)
    assert relative_error(out, ref) < TOL[torch.float16]
    assert torch.isnan(wide_out[:, :2]).all() and torch.isnan(wide_out[:, 6:]).all()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("q_lens,seq_lens", [(MIXED_Q, MIXED_S), ([4, 3, 4], [40, 3, 29])], ids=["mixed", "short"])
def test_v_cache_with_strides_of_its_own(layout, q_lens, seq_lens, monkeypatch):
    """Only head_size's stride must be 1: a V cache whose block and token strides differ from K's is read through
    its own strides (the kernels' ``SAME_KV`` False compile), one that shares K's through K's offsets."""
    pa = importlib.import_module("kvcached.kernels.paged_attention")  # the package re-exports the function
    seen = []
    real_select = pa.select
    monkeypatch.setattr(pa, "select", lambda *a, **kw: seen.append(kw["same_kv"]) or real_select(*a, **kw))
    gen = torch.Generator().manual_seed(13)
    k, v, _, _ = paged_kv_case(layout=layout, style="flash_attn", num_kv_heads=1, head_size=32, block_size=16,
                               dtype=torch.float16, num_blocks=NUM_BLOCKS, generator=gen, device=DEVICE)
    n, bs, h, d = v.shape
    wide = torch.randn(n, bs + 3, h + 1, d, generator=gen).to(DEVICE, torch.float16)
    v_own = wide[:, 2:2 + bs, 1:1 + h]
    v_own.copy_(v)
    assert v_own.stride()[:2] != k.stride()[:2] and v.stride()[:2] == k.stride()[:2]
    # group 8: the short queries (4 tokens x 8 heads) take a 32- or 64-row tile, the mixed batch a prefill too
    query, bt, sl, qsl = random_batch(q_lens, seq_lens, 8, 32, 16, n, torch.float16, generator=gen, device=DEVICE)
    ref = paged_attention_ref(query, k, v, bt, sl, qsl)
    for vc, same in ((v_own, False), (v, True)):
        seen.clear()
        out = paged_attention(query, k, vc, bt, sl, qsl, max_query_len=max(q_lens), max_seq_len=max(seq_lens))
        assert seen == [same]
        assert relative_error(out, ref) < TOL[torch.float16]


def test_default_out_allocated():
    gen = torch.Generator().manual_seed(10)
    k, v, _, _ = paged_kv_case(layout="contiguous", style="flash_attn", num_kv_heads=1, head_size=32, block_size=16,
                               dtype=torch.float16, num_blocks=NUM_BLOCKS, generator=gen, device=DEVICE)
    query, bt, sl, qsl = random_batch([3, 1], [20, 9], 2, 32, 16, k.shape[0], torch.float16,
                                      generator=gen, device=DEVICE)
    out = paged_attention(query, k, v, bt, sl, qsl, max_query_len=3, max_seq_len=20)
    assert out.shape == query.shape and out.dtype == query.dtype
    assert relative_error(out, paged_attention_ref(query, k, v, bt, sl, qsl)) < TOL[torch.float16]


@pytest.mark.parametrize("style", ["flash_attn", "sglang"])
def test_dense_stride_assumption_is_caught(style):
    """Reading the contiguous layout as if it were dense (the ROCm vendor path) is wrong; ours is right."""
    gen = torch.Generator().manual_seed(11)
    k, v, _, _ = paged_kv_case(layout="contiguous", style=style, num_kv_heads=2, head_size=32, block_size=16,
                               dtype=torch.float16, num_blocks=NUM_BLOCKS, generator=gen, device=DEVICE)
    assert not k.is_contiguous()
    query, bt, sl, qsl = random_batch([1, 12], [40, 30], 4, 32, 16, k.shape[0], torch.float16,
                                      generator=gen, device=DEVICE)
    ref = paged_attention_ref(query, k, v, bt, sl, qsl)
    dense = {"size": k.shape, "stride": torch.empty(k.shape).stride()}
    k_dense = torch.as_strided(k, dense["size"], dense["stride"], k.storage_offset())
    v_dense = torch.as_strided(v, dense["size"], dense["stride"], v.storage_offset())
    wrong = paged_attention(query, k_dense, v_dense, bt, sl, qsl, max_query_len=12, max_seq_len=40)
    right = paged_attention(query, k, v, bt, sl, qsl, max_query_len=12, max_seq_len=40)
    assert relative_error(right, ref) < TOL[torch.float16]
    assert relative_error(wrong, ref) > 0.1


def test_torch_compile_traces_the_op():
    gen = torch.Generator().manual_seed(12)
    k, v, _, _ = paged_kv_case(layout="per_layer", style="flashinfer", num_kv_heads=2, head_size=32, block_size=16,
                               dtype=torch.float16, num_blocks=NUM_BLOCKS, generator=gen, device=DEVICE)
    query, bt, sl, qsl = random_batch([1, 5], [21, 5], 4, 32, 16, k.shape[0], torch.float16,
                                      generator=gen, device=DEVICE)

    def fn(q):
        return paged_attention(q * 1.0, k, v, bt, sl, qsl, max_query_len=5, max_seq_len=21) + 0.0

    assert hasattr(torch.ops.kvcached, "paged_attention")
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    out = compiled(query)
    assert relative_error(out, paged_attention_ref(query, k, v, bt, sl, qsl)) < TOL[torch.float16]

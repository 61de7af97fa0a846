"""Paged attention on a real GPU at realistic sizes: the full feature x layout x view x dtype matrix.

Reference: float64 (``kvcached.kernels.reference``). Tolerance: relative error of the
whole output, ``TOL[dtype]`` (on the GPU probabilities are rounded to the query dtype
before P @ V, hence looser than the interpreter's).
"""

from __future__ import annotations

import pytest
import torch

from kvcached.kernels import attention_config as cfg
from kvcached.kernels.paged_attention import paged_attention
from kvcached.kernels.platform import fp8_kv_dtype
from kvcached.kernels.reference import paged_attention_ref, paged_kv_case, random_batch, relative_error

pytestmark = pytest.mark.gpu

TOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2}
LAYOUTS = ("contiguous", "per_layer")
STYLES = ("flash_attn", "flashinfer")
# decode at 8k, a chunked prefill (1k new tokens on 7k of context), a whole 2k prompt, decode at 300
MIXED_Q = [1, 1024, 2048, 1]
MIXED_S = [8192, 8192, 2048, 300]


def _features(name: str, num_heads: int) -> dict:
    g = torch.Generator().manual_seed(3)
    alibi = (torch.rand(num_heads, generator=g) * 0.05).cuda()
    sinks = (torch.randn(num_heads, generator=g) * 2).cuda()
    return {
        "none": {},
        "window": {"sliding_window": 1000},
        "softcap": {"softcap": 30.0},
        "alibi": {"alibi_slopes": alibi},
        "sinks": {"sinks": sinks},
        "noncausal": {"causal": False},
        "all": {"sliding_window": 777, "softcap": 20.0, "alibi_slopes": alibi, "sinks": sinks},
    }[name]


def _run(*, layout="contiguous", style="flash_attn", dtype=torch.bfloat16, kv_dtype=None, num_heads=32,
         num_kv_heads=8, head_size=128, block_size=16, q_lens=MIXED_Q, seq_lens=MIXED_S, splits=None, seed=0,
         v_own=False, **features):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = len(seq_lens) * (-(-max(seq_lens) // block_size) + 1) + 16  # random_batch's table
    k, v, _, _ = paged_kv_case(layout=layout, style=style, num_kv_heads=num_kv_heads, head_size=head_size,
                               block_size=block_size, dtype=kv_dtype or dtype, num_blocks=num_blocks, device="cuda")
    if v_own:  # V inside a wider tensor: block and token strides of its own (the kernels' SAME_KV False compile)
        n, bs, h, d = v.shape
        wide = torch.zeros(n, bs + 1, h + 2, d, dtype=v.dtype, device="cuda")
        wide[:, 1:, 2:] = v
        v = wide[:, 1:, 2:]
        assert v.stride()[:2] != k.stride()[:2]
    query, bt, sl, qsl = random_batch(q_lens, seq_lens, num_heads, head_size, block_size, k.shape[0], dtype,
                                      device="cuda", generator=gen)
    out = torch.full_like(query, float("nan"))
    knobs = {} if splits is None else {"decode_num_splits": splits}
    with cfg.override(**knobs):
        paged_attention(query, k, v, bt, sl, qsl, max_query_len=max(q_lens), max_seq_len=max(seq_lens), out=out,
                        **features)
    torch.cuda.synchronize()
    ref = paged_attention_ref(query, k, v, bt, sl, qsl, **features)
    err = relative_error(out, ref)
    assert err < TOL[dtype], f"relative error {err:.3e}"


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("feature", ["none", "window", "softcap", "alibi", "sinks", "noncausal", "all"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_features_layouts_views(dtype, feature, layout, style):
    _run(layout=layout, style=style, dtype=dtype, **_features(feature, 32))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prefills_in_a_batch_past_the_lookup(layout):
    """More sequences than the prefill kernel counts over in one load (``PrefillConfig.lookup``, 256 on NVIDIA):
    its programs find their sequence by binary search; prompts and chunks first, in the middle and last."""
    n = 301
    assert n > cfg.PrefillConfig(block_m=1, block_n=1, num_warps=1, num_stages=1).lookup
    q_lens = [1] * n
    seq_lens = [200 + (37 * i) % 1800 for i in range(n)]
    for i, (q, ctx) in zip((0, n // 2, n - 1), ((700, 0), (300, 900), (517, 64)), strict=True):
        q_lens[i], seq_lens[i] = q, q + ctx
    _run(layout=layout, q_lens=q_lens, seq_lens=seq_lens, seed=5)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp8_kv(dtype, layout, style):
    _run(layout=layout, style=style, dtype=dtype, kv_dtype=fp8_kv_dtype(), k_scale=torch.tensor([0.05]).cuda(),
         v_scale=0.07, seed=1)


@pytest.mark.parametrize("block_size", [1, 8, 16, 32, 64, 128])
@pytest.mark.parametrize("head_size", [32, 64, 80, 96, 128, 256])
def test_head_and_block_sizes(head_size, block_size):
    _run(head_size=head_size, block_size=block_size, num_heads=16, num_kv_heads=4, q_lens=[1, 700, 1],
         seq_lens=[3000, 1500, 17], seed=2, **_features("all", 16))


# (64, 2) and (128, 1): groups of 32 and 128 take 2 and 8 decode programs per KV head (16 heads each)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"),
                         [(32, 32), (32, 8), (64, 8), (16, 1), (40, 8), (64, 2), (128, 1)])
def test_gqa_mqa(num_heads, num_kv_heads):
    _run(num_heads=num_heads, num_kv_heads=num_kv_heads, q_lens=[1, 513, 1], seq_lens=[4096, 1000, 1], seed=4)


@pytest.mark.parametrize("splits", [1, 2, 7, 64, None])
@pytest.mark.parametrize("batch", [1, 8, 64, 256])
def test_decode_batches(batch, splits):
    g = torch.Generator().manual_seed(batch)
    seq_lens = torch.randint(1, 8193, (batch,), generator=g).tolist()
    seq_lens[0] = 8192
    _run(q_lens=[1] * batch, seq_lens=seq_lens, splits=splits, seed=5, **_features("sinks", 32))


@pytest.mark.parametrize("fused", [0, 1])
@pytest.mark.parametrize("feature", ["none", "all"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_stream_k_uneven_batch(fused, feature, layout):
    # 48 sequences of 256-16k keys (one of them a 2-token query), 8 KV heads: 384 programs, fewer than the
    # GPU's slots, so the dispatcher plans the stream-K launch; twice, so the merge counters are back at zero
    g = torch.Generator().manual_seed(11)
    seq_lens = torch.randint(256, 16385, (48,), generator=g).tolist()
    plan = cfg.decode_config(48, 8, 128, 16, 2, max(seq_lens), torch.cuda.current_device(), True)
    assert plan.stream > 0, plan
    with cfg.override(decode_fused_reduce=fused):
        for seed in (12, 13):
            _run(layout=layout, q_lens=[1] * 47 + [2], seq_lens=seq_lens, seed=seed, **_features(feature, 32))


@pytest.mark.parametrize("fused", [0, 1])
def test_decode_merge_paths_repeat(fused):
    # in-kernel merge (fused) and reduce_kernel; three calls: the merge counters must come back to zero
    with cfg.override(decode_fused_reduce=fused):
        for seed in range(3):
            _run(q_lens=[1] * 8, seq_lens=[8192, 77, 4000, 1, 5000, 6000, 8000, 129], splits=37 + seed, seed=seed,
                 **_features("sinks", 32))


@pytest.mark.parametrize("rows", [None, 32, 64])
@pytest.mark.parametrize("q", [2, 8, 16])
@pytest.mark.parametrize(("layout", "feature"), [("contiguous", "none"), ("per_layer", "none"), ("contiguous", "all")])
def test_short_queries(layout, feature, q, rows):
    # Speculative decoding's verification: q new tokens a sequence on 256 to 16k keys, beside single tokens,
    # through the decode kernel's short-query tiles: the dispatcher's (rows None), or the 32- or 64-row tile
    # forced (the 32-row tile is the one sm80 and AMD take); q = 2 fits the 16-row decode tile whatever the knob
    g = torch.Generator().manual_seed(q)
    seq_lens = torch.randint(256, 16385, (24,), generator=g).tolist()
    knobs = {} if rows is None else {"short_rows": rows}
    with cfg.override(**knobs):
        _run(layout=layout, q_lens=[q] * 20 + [1] * 4, seq_lens=seq_lens, seed=q, **_features(feature, 32))


def test_long_prefill_8k():
    _run(q_lens=[8192], seq_lens=[8192], seed=6)


@pytest.mark.parametrize("one_run", [None, 0, 1])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_short_prompts_diagonal_in_one_loop(layout, dtype, one_run):
    # Prompts and chunks of at most attention_config.ONE_RUN_KEYS keys: on Hopper-class GPUs the dispatcher (None)
    # runs the prefill's diagonal tiles in its interior loop (attn_tiles ONE_RUN); 0 / 1 force either loop. Lengths
    # off the 64-token tile and 16-key block edges, a chunk after its context, decodes beside them.
    knobs = {} if one_run is None else {"prefill_one_run": one_run}
    with cfg.override(**knobs):
        _run(layout=layout, dtype=dtype, q_lens=[2048, 1, 777, 100, 65, 1, 300],
             seq_lens=[2048, 2000, 777, 1500, 65, 17, 300], seed=7)


def test_cuda_graph_capture():
    gen = torch.Generator().manual_seed(7)
    k, v, _, _ = paged_kv_case(layout="contiguous", style="flash_attn", num_kv_heads=8, head_size=128,
                               block_size=16, dtype=torch.bfloat16, num_blocks=4096, device="cuda")
    query, bt, sl, qsl = random_batch([1] * 16, [1000 + 37 * i for i in range(16)], 32, 128, 16, k.shape[0],
                                      torch.bfloat16, device="cuda", generator=gen, extra_cols=48)
    out = torch.full_like(query, float("nan"))
    kw = {"max_query_len": 1, "max_seq_len": 2048, "out": out}
    paged_attention(query, k, v, bt, sl, qsl, **kw)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention(query, k, v, bt, sl, qsl, **kw)
    out.fill_(float("nan"))
    sl.add_(5)  # new lengths, read on the device at replay
    graph.replay()
    torch.cuda.synchronize()
    ref = paged_attention_ref(query, k, v, bt, sl, qsl)
    assert relative_error(out, ref) < TOL[torch.bfloat16]


@pytest.mark.parametrize("concurrent", [0, 1])
def test_mixed_batch_prefill_stream_eager_and_graph(concurrent):
    # chunked prefills beside decodes: the prefill launch on a stream of its own (concurrent 1) or after the
    # decodes, eagerly and replayed from a CUDA graph (fork and join captured), each against float64
    gen = torch.Generator().manual_seed(9)
    k, v, _, _ = paged_kv_case(layout="contiguous", style="flash_attn", num_kv_heads=8, head_size=128,
                               block_size=16, dtype=torch.bfloat16, num_blocks=8192, device="cuda")
    q_lens, seq_lens = [700, 1, 1, 300] + [1] * 12, [4000, 8000, 300, 300] + [2000 + 97 * i for i in range(12)]
    query, bt, sl, qsl = random_batch(q_lens, seq_lens, 32, 128, 16, k.shape[0], torch.bfloat16, device="cuda",
                                      generator=gen)
    ref = paged_attention_ref(query, k, v, bt, sl, qsl)
    out = torch.full_like(query, float("nan"))
    kw = {"max_query_len": 700, "max_seq_len": 8000, "out": out}
    with cfg.override(concurrent_prefill=concurrent):
        paged_attention(query, k, v, bt, sl, qsl, **kw)
        torch.cuda.synchronize()
        assert relative_error(out, ref) < TOL[torch.bfloat16]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            paged_attention(query, k, v, bt, sl, qsl, **kw)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert relative_error(out, ref) < TOL[torch.bfloat16]


def test_torch_compile_inductor():
    gen = torch.Generator().manual_seed(8)
    k, v, _, _ = paged_kv_case(layout="per_layer", style="flashinfer", num_kv_heads=8, head_size=128,
                               block_size=16, dtype=torch.bfloat16, num_blocks=512, device="cuda")
    query, bt, sl, qsl = random_batch([1, 300], [900, 300], 32, 128, 16, k.shape[0], torch.bfloat16,
                                      device="cuda", generator=gen)

    @torch.compile(fullgraph=True)
    def fn(q):
        return paged_attention(q * 1.0, k, v, bt, sl, qsl, max_query_len=300, max_seq_len=900) * 1.0

    ref = paged_attention_ref(query, k, v, bt, sl, qsl)
    assert relative_error(fn(query), ref) < TOL[torch.bfloat16]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("q_lens,seq_lens", [(MIXED_Q, MIXED_S), ([16] * 8, [8192] * 8), ([1] * 8, [8192] * 8)],
                         ids=["mixed", "short16", "decode"])
def test_v_cache_with_strides_of_its_own(layout, q_lens, seq_lens):
    _run(layout=layout, q_lens=q_lens, seq_lens=seq_lens, v_own=True)

"""paged_mla_decode on both layouts against the float64 reference, with and without split-KV."""

from __future__ import annotations

import pytest
import torch

from kvcached.kernels import paged_mla_decode
from kvcached.kernels.reference import mla_decode_ref
from kvcached.layout import KVGeometry, KVSpec, Layout, allocate_plain, mla_view

MiB = 1 << 20


def make_latent_cache(layout, dtype, *, layers=2, blocks=40, block_size=16, head_size=576, layer=1, seed=0,
                      device="cpu"):
    # 576 channels = 9 x 64: a 2 MiB page never holds whole blocks, 18 MiB does
    spec = KVSpec(layers, blocks, block_size, 1, head_size, dtype, kv_factor=1)
    geom = KVGeometry(spec, layout, 18 * MiB)
    bases = allocate_plain(geom, device)
    g = torch.Generator().manual_seed(seed)
    for b in bases:  # random values in every layer, so reading the wrong layer shows
        vals = torch.randn(b.numel() // spec.itemsize, generator=g)
        b.view(dtype).copy_(vals.to(dtype) if dtype.itemsize > 1 else (vals * 4).to(dtype))
    return geom, bases, mla_view(bases, geom, layer)


def random_tables(seq_lens, geom, *, seed, device):
    g = torch.Generator().manual_seed(seed)
    bs = geom.spec.block_size
    max_blocks = max(1, max((n + bs - 1) // bs for n in seq_lens))
    perm = torch.randperm(geom.num_blocks, generator=g)[: len(seq_lens) * max_blocks]
    table = perm.view(len(seq_lens), max_blocks).to(torch.int32).to(device)
    return table, torch.tensor(seq_lens, dtype=torch.int32, device=device)


def run_case(layout, dtype, num_heads, seq_lens, num_splits, device, *, kv_dtype=None, kv_scale=None, seed=0):
    geom, _, cache = make_latent_cache(layout, kv_dtype or dtype, device=device, seed=seed)
    table, lens = random_tables(seq_lens, geom, seed=seed + 1, device=device)
    g = torch.Generator().manual_seed(seed + 2)
    query = torch.randn(len(seq_lens), num_heads, 576, generator=g).to(dtype).to(device)
    scale = 576**-0.5
    out = torch.full((len(seq_lens), num_heads, 512), float("nan"), dtype=dtype, device=device)
    got = paged_mla_decode(query, cache, table, lens, scale=scale, num_splits=num_splits, out=out,
                           kv_scale=kv_scale)
    assert got is out
    want = mla_decode_ref(query, cache, table, lens, scale=scale, v_head_size=512, kv_scale=kv_scale)
    assert torch.isfinite(got).all(), "an output element was left unwritten (NaN poison)"
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_mla_decode_matches_reference(layout, dtype, num_splits, device):
    run_case(layout, dtype, 16, [37, 1, 70, 0], num_splits, device)


@pytest.mark.parametrize("layout", list(Layout))
def test_mla_split_merge_over_several_loads(layout, device):
    # 19 splits: the merge loads them 8 at a time (REDUCE_CH), the last load partial; short sequences leave whole
    # loads of empty splits after real ones (1 token) or only empty ones (0 tokens: zeros)
    run_case(layout, torch.bfloat16, 16, [300, 1, 70, 0], 19, device, seed=4)


@pytest.mark.parametrize("layout", list(Layout))
def test_mla_decode_odd_heads_auto_splits(layout, device):
    # 20 heads: two head groups, the second one partly masked; splits chosen by the heuristic
    run_case(layout, torch.bfloat16, 20, [120, 33], None, device, seed=3)


@pytest.mark.parametrize("layout", list(Layout))
def test_mla_decode_fp8_cache(layout, device):
    run_case(layout, torch.bfloat16, 16, [45, 17], 2, device, kv_dtype=torch.float8_e4m3fn, kv_scale=0.25, seed=5)


def test_mla_decode_wrong_layer_would_show(device):
    """Guard for the test itself: reading another layer's blocks gives a different answer."""
    geom, bases, cache = make_latent_cache(Layout.CONTIGUOUS, torch.bfloat16, device=device)
    other = mla_view(bases, geom, 0)
    table, lens = random_tables([40], geom, seed=1, device=device)
    q = torch.randn(1, 16, 576).to(torch.bfloat16).to(device)
    a = paged_mla_decode(q, cache, table, lens, scale=0.05)
    b = mla_decode_ref(q, other, table, lens, scale=0.05)
    assert (a.double() - b).abs().max() > 0.1


def test_mla_bad_inputs():
    geom, _, cache = make_latent_cache(Layout.PER_LAYER, torch.bfloat16, blocks=8)
    q = torch.randn(2, 16, 576).to(torch.bfloat16)
    table = torch.zeros(2, 4, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="num_seqs, num_heads, head_size"):
        paged_mla_decode(q[0], cache, table, lens, scale=1.0)
    with pytest.raises(ValueError, match="mla_view"):
        paged_mla_decode(q, cache[:, :, None], table, lens, scale=1.0)
    with pytest.raises(ValueError, match="head size 512 differs"):
        paged_mla_decode(q[..., :512], cache, table, lens, scale=1.0)
    with pytest.raises(ValueError, match="must match"):
        paged_mla_decode(q.half(), cache, table, lens, scale=1.0)
    with pytest.raises(ValueError, match="block_table"):
        paged_mla_decode(q, cache, table[:1], lens, scale=1.0)
    with pytest.raises(ValueError, match="int32"):
        paged_mla_decode(q, cache, table.float(), lens, scale=1.0)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        paged_mla_decode(q, cache, table, lens, scale=1.0, kv_lora_rank=600)
    with pytest.raises(ValueError, match="out must be"):
        paged_mla_decode(q, cache, table, lens, scale=1.0, out=torch.empty(2, 16, 576, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="fp8 caches only"):
        paged_mla_decode(q, cache, table, lens, scale=1.0, kv_scale=1.0)
    with pytest.raises(ValueError, match="kv_scale is required"):
        paged_mla_decode(q, cache.view(torch.uint8)[..., :576].view(torch.float8_e4m3fn), table, lens, scale=1.0)


def test_mla_custom_op_fake_runs_no_kernel_and_keeps_out(monkeypatch: pytest.MonkeyPatch):
    """The fake (meta) impl used by torch.compile: returns nothing, launches nothing, and ``out``
    (the one tensor it declares written) keeps its shape, dtype and device."""
    import importlib

    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    md = importlib.import_module("kvcached.kernels.mla_decode")
    op = torch.ops.kvcached.paged_mla_decode.default
    written = [a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert written == ["out"] and not op._schema.returns
    launched: list = []
    monkeypatch.setattr(md, "_launch", lambda *args: launched.append(args))
    args = (torch.zeros(2, 4, dtype=torch.int32), torch.ones(2, dtype=torch.int32))
    with FakeTensorMode() as mode:
        q = torch.empty(2, 16, 576, dtype=torch.bfloat16)
        c = torch.empty(8, 16, 576, dtype=torch.bfloat16)
        out = torch.empty(2, 16, 512, dtype=torch.bfloat16)
        result = torch.ops.kvcached.paged_mla_decode(q, c, *map(mode.from_tensor, args), out, torch.ones(1), 0.1,
                                                     512, 2)
    assert result is None
    assert isinstance(out, FakeTensor)
    assert (tuple(out.shape), out.dtype, out.device) == ((2, 16, 512), torch.bfloat16, torch.device("cpu"))
    assert launched == [], "the fake impl ran the kernel"
    real_out = torch.zeros(2, 16, 512, dtype=torch.bfloat16)
    torch.ops.kvcached.paged_mla_decode(torch.zeros(2, 16, 576, dtype=torch.bfloat16),
                                        torch.zeros(8, 16, 576, dtype=torch.bfloat16), *args, real_out,
                                        torch.ones(1), 0.1, 512, 2)
    assert len(launched) == 1  # outside fake mode the real impl runs


def test_mla_custom_op_passes_opcheck(device):
    """Real vs fake outputs and mutations agree, and only ``out`` is written."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 16, 576, dtype=torch.bfloat16, generator=gen).to(device)
    c = torch.randn(8, 16, 576, dtype=torch.bfloat16, generator=gen).to(device)
    table = torch.arange(8, dtype=torch.int32, device=device).view(2, 4)
    lens = torch.tensor([5, 40], dtype=torch.int32, device=device)
    out = torch.zeros(2, 16, 512, dtype=torch.bfloat16, device=device)
    torch.library.opcheck(torch.ops.kvcached.paged_mla_decode.default,
                          (q, c, table, lens, out, torch.ones(1, device=device), 0.1, 512, 2),
                          test_utils=("test_schema", "test_faketensor"))


def test_mla_override_knobs(device):
    from kvcached.kernels import mla_decode as m

    with pytest.raises(ValueError, match="unknown MLA knob"):
        with m.override(nope=1):
            pass
    with m.override(BLOCK_N=16, max_splits=2):
        assert m.launch_config(16, False)["BLOCK_N"] == 16
        assert m.choose_num_splits(1, 16, 10**6, torch.device("cpu"), 16) == 2
        run_case(Layout.CONTIGUOUS, torch.bfloat16, 16, [50, 9], None, device, seed=11)
    assert m.launch_config(16, False)["BLOCK_N"] == 32

"""KV write, MLA decode and the dense-stride reproducer on a real GPU, at realistic sizes."""

from __future__ import annotations

import pytest
import torch

from kvcached.kernels import paged_attention, paged_mla_decode, write_kv_cache
from kvcached.kernels.dense_reference import dense_paged_decode, dense_write_kv_cache
from kvcached.kernels.platform import fp8_kv_dtype
from kvcached.kernels.reference import mla_decode_ref, paged_attention_ref
from kvcached.layout import (
    FLASH_ATTN,
    FLASHINFER,
    KVGeometry,
    KVSpec,
    Layout,
    allocate_plain,
    kv_cache_view,
    mla_view,
)

pytestmark = pytest.mark.gpu
MiB = 1 << 20
DEV = "cuda"


def kv_setup(layout, dtype, *, layers=4, blocks=2048, block_size=16, heads=8, head=128):
    geom = KVGeometry(KVSpec(layers, blocks, block_size, heads, head, dtype), layout, 2 * MiB)
    bases = allocate_plain(geom, DEV)
    for b in bases:
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, device=DEV))
    return geom, bases


def views(bases, geom, layer, style):
    v = kv_cache_view(bases, geom, layer, style)
    return v.unbind(0) if style == FLASH_ATTN else v.unbind(1)


@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("style", [FLASH_ATTN, FLASHINFER])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 64])
def test_write_realistic(layout, style, dtype, block_size):
    geom, bases = kv_setup(layout, dtype, block_size=block_size, blocks=4096 // (block_size // 16))
    n = 8192
    qkv = torch.randn(n, 48, 128, device=DEV, dtype=dtype)  # fused projection: 32 q + 8 k + 8 v heads
    key, value = qkv[:, 32:40], qkv[:, 40:48]
    total = geom.num_blocks * block_size
    slots = torch.randperm(total, device=DEV)[:n]
    slots[::97] = -1
    want = [b.clone() for b in bases]
    wk, wv = views(want, geom, 2, style)
    keep = slots >= 0
    s = slots[keep]
    wk[s // block_size, s % block_size] = key[keep]
    wv[s // block_size, s % block_size] = value[keep]
    kc, vc = views(bases, geom, 2, style)
    write_kv_cache(key, value, kc, vc, slots.to(torch.int32))
    for a, b in zip(bases, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("layout", list(Layout))
def test_write_fp8_exact(layout):
    f8 = fp8_kv_dtype()
    geom, bases = kv_setup(layout, f8)
    n = 4096
    key = torch.randn(n, 8, 128, device=DEV, dtype=torch.bfloat16) * 4
    value = torch.randn(n, 8, 128, device=DEV, dtype=torch.bfloat16) * 4
    slots = torch.randperm(geom.num_blocks * 16, device=DEV)[:n]
    kc, vc = views(bases, geom, 1, FLASH_ATTN)
    ks = torch.tensor([0.03], device=DEV)
    write_kv_cache(key, value, kc, vc, slots, k_scale=ks, v_scale=0.02)
    fmax = torch.finfo(f8).max
    got = kc[slots // 16, slots % 16]
    want = (key.float() / 0.03).clamp(-fmax, fmax).to(f8)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    got = vc[slots // 16, slots % 16]
    want = (value.float() / 0.02).clamp(-fmax, fmax).to(f8)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_write_out_of_range_slot_never_writes():
    geom, bases = kv_setup(Layout.CONTIGUOUS, torch.bfloat16)
    kc, vc = views(bases, geom, 3, FLASH_ATTN)  # the last layer: a stray write would land past it
    before = [b.clone() for b in bases]
    x = torch.randn(4, 8, 128, device=DEV, dtype=torch.bfloat16)
    total = geom.num_blocks * 16
    write_kv_cache(x, x, kc, vc, torch.tensor([total, total + 1, 2**40, -5], device=DEV))
    torch.cuda.synchronize()
    for a, b in zip(bases, before, strict=True):
        assert torch.equal(a, b)


def test_write_cuda_graph_and_compile():
    geom, bases = kv_setup(Layout.CONTIGUOUS, torch.bfloat16)
    kc, vc = views(bases, geom, 0, FLASHINFER)
    key = torch.randn(256, 8, 128, device=DEV, dtype=torch.bfloat16)
    value = torch.randn_like(key)
    slots = torch.randperm(geom.num_blocks * 16, device=DEV)[:256]
    write_kv_cache(key, value, kc, vc, slots)  # warm up (compile) outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        write_kv_cache(key, value, kc, vc, slots)
    key.copy_(torch.randn_like(key))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(kc[slots // 16, slots % 16], key)

    @torch.compile(fullgraph=True)
    def step(k, v, kc, vc, s):
        write_kv_cache(k * 2, v, kc, vc, s)

    step(key, value, kc, vc, slots)
    assert torch.equal(kc[slots // 16, slots % 16], key * 2)


def mla_setup(layout, dtype, blocks):
    geom = KVGeometry(KVSpec(3, blocks, 16, 1, 576, dtype, kv_factor=1), layout, 18 * MiB)
    bases = allocate_plain(geom, DEV)
    for b in bases:
        v = b.view(torch.bfloat16) if dtype.itemsize == 2 else b.view(dtype)
        if dtype.itemsize == 2:
            v.normal_()
        else:
            v.copy_((torch.randn(v.shape, device=DEV) * 4).to(dtype))
    return geom, bases, mla_view(bases, geom, 1)


@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("num_splits", [None, 1])
def test_mla_realistic(layout, heads, num_splits):
    batch, ctx = 8, 4096
    geom, _, cache = mla_setup(layout, torch.bfloat16, batch * ctx // 16)
    table = torch.randperm(geom.num_blocks, device=DEV)[: batch * ctx // 16].view(batch, -1).to(torch.int32)
    lens = torch.randint(1, ctx + 1, (batch,), device=DEV, dtype=torch.int32)
    q = torch.randn(batch, heads, 576, device=DEV, dtype=torch.bfloat16)
    out = torch.full((batch, heads, 512), float("nan"), device=DEV, dtype=torch.bfloat16)
    paged_mla_decode(q, cache, table, lens, scale=576**-0.5, out=out, num_splits=num_splits)
    want = mla_decode_ref(q, cache, table, lens, scale=576**-0.5)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)


def test_mla_fp8_and_graph():
    f8 = fp8_kv_dtype()
    batch, ctx = 4, 2048
    geom, _, cache = mla_setup(Layout.CONTIGUOUS, f8, batch * ctx // 16)
    table = torch.randperm(geom.num_blocks, device=DEV)[: batch * ctx // 16].view(batch, -1).to(torch.int32)
    lens = torch.full((batch,), ctx, device=DEV, dtype=torch.int32)
    q = torch.randn(batch, 16, 576, device=DEV, dtype=torch.bfloat16)
    out = torch.empty(batch, 16, 512, device=DEV, dtype=torch.bfloat16)
    ks = torch.tensor([0.125], device=DEV)
    paged_mla_decode(q, cache, table, lens, scale=0.04, kv_scale=ks, out=out)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        paged_mla_decode(q, cache, table, lens, scale=0.04, kv_scale=ks, out=out)
    q.copy_(torch.randn_like(q))
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    want = mla_decode_ref(q, cache, table, lens, scale=0.04, kv_scale=ks)
    torch.testing.assert_close(out.double(), want, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("style", [FLASH_ATTN, FLASHINFER])
def test_dense_stride_bug_visible_at_scale(style):
    batch, ctx = 16, 2048
    for layout in Layout:
        geom, bases = kv_setup(layout, torch.bfloat16, blocks=batch * ctx // 16, layers=4)
        for b in bases:
            b.view(torch.bfloat16).normal_()
        kc, vc = views(bases, geom, 2, style)
        table = torch.randperm(geom.num_blocks, device=DEV)[: batch * ctx // 16].view(batch, -1).to(torch.int32)
        lens = torch.full((batch,), ctx, device=DEV, dtype=torch.int32)
        q = torch.randn(batch, 32, 128, device=DEV, dtype=torch.bfloat16)
        qsl = torch.arange(batch + 1, device=DEV, dtype=torch.int32)
        want = paged_attention_ref(q[:2], kc, vc, table[:2], lens[:2], qsl[:3], scale=128**-0.5)
        ours = paged_attention(q, kc, vc, table, lens, qsl, max_query_len=1, max_seq_len=ctx, scale=128**-0.5)
        dense = dense_paged_decode(q, kc, vc, table, lens, 128**-0.5)
        torch.testing.assert_close(ours[:2].double(), want, atol=2e-2, rtol=2e-2)
        err = (dense[:2].double() - want).abs().max().item()
        if layout is Layout.CONTIGUOUS:
            assert err > 0.1, f"dense addressing should be wrong on the contiguous layout (error {err})"
        else:
            assert err < 2e-2
        # and the cache write
        twin = [b.clone() for b in bases]
        key = torch.randn(512, 8, 128, device=DEV, dtype=torch.bfloat16)
        slots = torch.randperm(geom.num_blocks * 16, device=DEV)[:512]
        write_kv_cache(key, key, kc, vc, slots)
        tk, tv = views(twin, geom, 2, style)
        dense_write_kv_cache(key, key, tk, tv, slots)
        same = all(torch.equal(a, b) for a, b in zip(bases, twin, strict=True))
        assert same == (layout is Layout.PER_LAYER)

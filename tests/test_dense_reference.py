"""The ROCm failure is visible: dense-addressing kernels are wrong on the contiguous layout, ours are right.

On the per-layer layout (each layer's K and V dense) the dense kernels and ours agree.
"""

from __future__ import annotations

import pytest
import torch

from kvcached.kernels import paged_attention, write_kv_cache
from kvcached.kernels.dense_reference import dense_paged_decode, dense_write_kv_cache
from kvcached.kernels.reference import paged_attention_ref
from kvcached.layout import (
    FLASH_ATTN,
    FLASHINFER,
    SGLANG_PAGED,
    KVGeometry,
    KVSpec,
    Layout,
    allocate_plain,
    kv_cache_view,
    sglang_paged_kv,
    token_major_geometry,
)

MiB = 1 << 20
LAYERS, BLOCKS, BS, KVH, QH, D = 3, 32, 16, 2, 4, 32


STYLES = [FLASH_ATTN, FLASHINFER, SGLANG_PAGED]  # sglang: SGLang pages of BS tokens, token-major when contiguous


def make(layout, device, seed=0, style=FLASH_ATTN):
    spec = KVSpec(LAYERS, BLOCKS, BS, KVH, D, torch.float16)
    geom = token_major_geometry(spec, layout, 2 * MiB) if style == SGLANG_PAGED else KVGeometry(spec, layout, 2 * MiB)
    bases = allocate_plain(geom, device)
    g = torch.Generator().manual_seed(seed)
    for b in bases:
        b.view(torch.float16).copy_(torch.randn(b.numel() // 2, generator=g).half())
    return geom, bases


def kv(bases, geom, layer, style):
    if style == SGLANG_PAGED:
        return sglang_paged_kv(bases, geom, layer, BS)
    v = kv_cache_view(bases, geom, layer, style)
    return v.unbind(0) if style == FLASH_ATTN else v.unbind(1)


def decode_inputs(num_blocks, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    lens = [40, 23, 64]
    max_blocks = 4
    table = torch.randperm(num_blocks, generator=g)[: 3 * max_blocks].view(3, max_blocks)
    q = torch.randn(3, QH, D, generator=g).half()
    return (q.to(device), table.to(torch.int32).to(device), torch.tensor(lens, dtype=torch.int32, device=device))


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("layer", [1, 2])
def test_dense_decode_wrong_on_contiguous_ours_right(style, layer, device):
    geom, bases = make(Layout.CONTIGUOUS, device, style=style)
    kc, vc = kv(bases, geom, layer, style)
    q, table, lens = decode_inputs(kc.shape[0], device)
    qsl = torch.arange(4, dtype=torch.int32, device=device)
    want = paged_attention_ref(q, kc, vc, table, lens, qsl, scale=D**-0.5)
    ours = paged_attention(q, kc, vc, table, lens, qsl, max_query_len=1, max_seq_len=64, scale=D**-0.5)
    dense = dense_paged_decode(q, kc, vc, table, lens, D**-0.5)
    torch.testing.assert_close(ours.double(), want, atol=1e-2, rtol=1e-2)
    err = (dense.double() - want).abs().max().item()
    assert err > 0.2, f"the dense-addressing kernel should read the wrong blocks here (max error {err})"


@pytest.mark.parametrize("style", STYLES)
def test_dense_decode_right_on_per_layer(style, device):
    geom, bases = make(Layout.PER_LAYER, device, style=style)
    kc, vc = kv(bases, geom, 1, style)
    q, table, lens = decode_inputs(kc.shape[0], device)
    qsl = torch.arange(4, dtype=torch.int32, device=device)
    want = paged_attention_ref(q, kc, vc, table, lens, qsl, scale=D**-0.5)
    ours = paged_attention(q, kc, vc, table, lens, qsl, max_query_len=1, max_seq_len=64, scale=D**-0.5)
    dense = dense_paged_decode(q, kc, vc, table, lens, D**-0.5)
    torch.testing.assert_close(dense.double(), want, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(ours.double(), want, atol=1e-2, rtol=1e-2)


def _write_both(layout, style, device):
    geom, bases = make(layout, device, seed=3, style=style)
    twin = [b.clone() for b in bases]
    g = torch.Generator().manual_seed(4)
    n = 24
    key = torch.randn(n, KVH, D, generator=g).half().to(device)
    value = torch.randn(n, KVH, D, generator=g).half().to(device)
    kc, vc = kv(bases, geom, 1, style)
    slots = torch.randperm(kc.shape[0] * BS, generator=g)[:n].to(device)
    write_kv_cache(key, value, kc, vc, slots)
    tk, tv = kv(twin, geom, 1, style)
    dense_write_kv_cache(key, value, tk, tv, slots)
    s = slots.long()
    return bases, twin, (kc, vc, tk, tv), key, value, s


@pytest.mark.parametrize("style", STYLES)
def test_dense_write_wrong_on_contiguous_ours_right(style, device):
    bases, twin, (kc, vc, tk, tv), key, value, s = _write_both(Layout.CONTIGUOUS, style, device)
    assert torch.equal(kc[s // BS, s % BS], key) and torch.equal(vc[s // BS, s % BS], value)
    wrong = (tk[s // BS, s % BS] != key).any(dim=(1, 2)).float().mean().item()
    assert wrong > 0.5, f"dense addressing should miss most slots on the contiguous layout, missed {wrong:.2f}"
    assert not torch.equal(bases[0], twin[0])


@pytest.mark.parametrize("style", STYLES)
def test_dense_write_agrees_on_per_layer(style, device):
    bases, twin, *_ = _write_both(Layout.PER_LAYER, style, device)
    for a, b in zip(bases, twin, strict=True):
        assert torch.equal(a, b)

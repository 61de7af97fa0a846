"""SGLang's paged allocator (page sizes > 1) on both layouts, host backend.

The per-token buffers come from a token-major geometry on the contiguous layout
(``[tokens, layers, K/V, H, D]``) while the manager hands out blocks of ``P`` tokens;
these tests check that both agree byte for byte: what is written through the buffers
lands where :mod:`kvcached.layout` says, inside the kvcached page the manager mapped
for that SGLang page, and that our kernels read and write that layout.
"""

from __future__ import annotations

import pytest
import torch

from kvcached import vmm_ops
from kvcached.errors import KVCachedConfigError
from kvcached.integration.sglang import interfaces as sg
from kvcached.kernels import paged_attention, paged_mla_decode, write_kv_cache
from kvcached.kernels.reference import mla_decode_ref, paged_attention_ref, relative_error
from kvcached.layout import (
    KVSpec,
    Layout,
    engine_pages_per_page,
    token_major_geometry,
    token_page_view,
)
from tests.sglang_support import exact_mapping_env

MiB = 1 << 20
LAYERS, HEADS, HEAD = 2, 2, 64
DTYPE = torch.float16
TOKEN_BYTES = HEADS * HEAD * 2  # one token of one layer's K (or V)
PAGE = 2 * MiB


@pytest.fixture(params=[True, False], ids=["contiguous", "per_layer"])
def sglang_env(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    exact_mapping_env(monkeypatch, request.param, host_mb=32)  # mapping is checkable per page
    sg.init_kvcached(device="cpu")
    yield request.param
    sg.shutdown_kvcached()


def _expected_elem(contiguous: bool, layers: int, kv_factor: int, tokens_per_tensor: int, token_elems: int,
                   layer: int, kv: int, tokens: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(tensor, first element of each token): the layouts written out by hand, not taken from layout.py."""
    if contiguous:  # [tokens, layers, kv, H, D]
        return 0, ((tokens * layers + layer) * kv_factor + kv) * token_elems
    return layer, (kv * tokens_per_tensor + tokens) * token_elems  # per layer: [kv, tokens, H, D]


def _page_of_elem(contiguous: bool, elem: torch.Tensor, itemsize: int, kv_factor: int, layers: int,
                  tokens_per_tensor: int, token_bytes: int) -> torch.Tensor:
    """The kvcached page index whose physical memory holds each element."""
    byte = elem * itemsize
    if contiguous:
        return byte // (layers * kv_factor * PAGE)
    return (byte % (tokens_per_tensor * token_bytes)) // PAGE


def _alloc(mla: bool, page: int):
    if mla:
        bufs = sg.alloc_kv_cache((1000, 1, HEAD), DTYPE, "cpu", LAYERS, page_size=page, attention_type="MLA")
        per_layer = [(b,) for b in bufs]
        token_bytes, kv_factor, heads = HEAD * 2, 1, 1
    else:
        ks, vs = sg.alloc_kv_cache((1000, HEADS, HEAD), DTYPE, "cpu", LAYERS, page_size=page)
        per_layer = list(zip(ks, vs, strict=True))
        token_bytes, kv_factor, heads = TOKEN_BYTES, 2, HEADS
    return per_layer, token_bytes, kv_factor, heads


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("page", [1, 16, 64])
def test_pages_land_where_the_layout_says(sglang_env: bool, page: int, mla: bool) -> None:
    contiguous = sglang_env
    per_layer, token_bytes, kv_factor, heads = _alloc(mla, page)
    tokens = per_layer[0][0].shape[0]
    assert tokens % page == 0 and per_layer[0][0].shape[1:] == (heads, HEAD)
    token_stride = LAYERS * kv_factor * heads * HEAD if contiguous else heads * HEAD
    assert per_layer[0][0].stride(0) == token_stride  # one token stride: token-major on the contiguous layout
    rt = vmm_ops.runtime()
    geom = token_major_geometry(KVSpec(LAYERS, tokens // page, page, heads, HEAD, DTYPE, kv_factor), rt.layout,
                                rt.page_size)
    ppp = engine_pages_per_page(page, token_bytes, PAGE)
    assert ppp * page * token_bytes == PAGE

    mgr = sg.get_kv_cache_manager(tokens // page, page, token_bytes, LAYERS, num_kv_buffers=kv_factor)
    assert mgr.blocks_per_page == ppp and mgr.page_group_bytes == geom.page_group_bytes
    group = vmm_ops.get_group(0)
    assert group.geometry.num_pages == geom.num_pages >= mgr.num_pages
    raw = group.tensors
    tokens_per_tensor = raw[0].numel() // ((LAYERS if contiguous else 1) * kv_factor * token_bytes)

    ids = mgr.alloc(ppp + 3)  # the null block's page, all of it, and three SGLang pages into the next
    assert ids is not None and 0 not in ids
    alloc_pages = {0} | {b // ppp for b in ids}
    assert alloc_pages == {0, 1}
    alloc_ids = torch.tensor(ids)
    g = torch.Generator().manual_seed(page)
    written = {}
    for layer, bufs in enumerate(per_layer):
        for kv, buf in enumerate(bufs):
            vals = torch.randn(len(ids), page, heads, HEAD, generator=g).to(DTYPE)
            token_page_view(buf, page)[alloc_ids] = vals
            written[layer, kv] = vals
    # read back through the raw virtual tensors at the offsets written out by hand
    toks = (alloc_ids[:, None] * page + torch.arange(page)).reshape(-1)
    token_elems = heads * HEAD
    for (layer, kv), vals in written.items():
        t, first = _expected_elem(contiguous, LAYERS, kv_factor, tokens_per_tensor, token_elems, layer, kv, toks)
        tensor, byte = geom.block_byte_offset(layer, kv, int(toks[5]))
        assert (tensor, byte) == (t, int(first[5]) * 2)
        got = raw[t].view(DTYPE)[first[:, None] + torch.arange(token_elems)]
        want = vals.reshape(-1, token_elems)
        assert torch.equal(got, want), f"layer {layer} kv {kv}: bytes not where the layout says"
        assert got.double().sum().item() == pytest.approx(want.double().sum().item())
        # page p's physical memory holds exactly SGLang pages [p * ppp, (p + 1) * ppp)
        pages = _page_of_elem(contiguous, first, 2, kv_factor, LAYERS, tokens_per_tensor, token_bytes)
        assert torch.equal(pages, toks // page // ppp)
    allocator = mgr.page_allocator
    for p in range(mgr.num_pages):
        assert bool(allocator.is_in_use(p)) == (p in alloc_pages), f"page {p}"
    assert mgr.mapped_bytes == len(alloc_pages) * mgr.page_group_bytes
    assert mgr.get_mapped_memory_size() == len(alloc_pages) * mgr.page_group_bytes

    mgr.free(ids)
    assert not allocator.is_in_use(1) and allocator.is_in_use(0)  # the null block keeps page 0
    assert mgr.mapped_bytes == mgr.page_group_bytes
    gone = alloc_ids[alloc_ids // ppp == 1]
    for bufs in per_layer:
        for buf in bufs:
            assert torch.count_nonzero(token_page_view(buf, page)[gone]) == 0  # back on the zero page
    mgr.close()


@pytest.mark.parametrize("page", [16, 64])
def test_kernels_on_sglang_pages(sglang_env: bool, page: int) -> None:
    """write_kv_cache then paged_attention on K/V viewed as SGLang's FA3 backend does
    (``k_buffer.view(-1, page, H, D)``), against torch indexing and the float64 reference."""
    ks, vs = sg.alloc_kv_cache((1000, HEADS, HEAD), DTYPE, "cpu", LAYERS, page_size=page)
    mgr = sg.get_kv_cache_manager(ks[0].shape[0] // page, page, TOKEN_BYTES, LAYERS)
    layer = 1
    k_cache = ks[layer].view(-1, page, HEADS, HEAD)
    v_cache = vs[layer].view(-1, page, HEADS, HEAD)
    assert k_cache.stride() == token_page_view(ks[layer], page).stride()
    assert k_cache.stride(0) == page * ks[layer].stride(0)
    assert k_cache.is_contiguous() == (not sglang_env)  # strided only on the contiguous layout

    g = torch.Generator().manual_seed(page)
    seq_lens, q_lens = [page + 9, 5], [1, 5]
    cols = max(-(-s // page) for s in seq_lens)
    pages = mgr.alloc(cols * len(seq_lens))
    assert pages is not None
    table = torch.tensor(pages, dtype=torch.int32).view(len(seq_lens), cols)
    slots = torch.cat([table[i].long().repeat_interleave(page)[:s] * page + torch.arange(s) % page
                       for i, s in enumerate(seq_lens)])
    key = torch.randn(len(slots), HEADS, HEAD, generator=g).to(DTYPE)
    value = torch.randn(len(slots), HEADS, HEAD, generator=g).to(DTYPE)
    others = [t.clone() for t in (ks[0], vs[0])]
    write_kv_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(ks[layer][slots], key) and torch.equal(vs[layer][slots], value)
    assert torch.equal(ks[0], others[0]) and torch.equal(vs[0], others[1])  # the other layer untouched

    query = torch.randn(sum(q_lens), 4, HEAD, generator=g).to(DTYPE)
    qsl = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    out = paged_attention(query, k_cache, v_cache, table, sl, qsl, max_query_len=max(q_lens),
                          max_seq_len=max(seq_lens))
    ref = paged_attention_ref(query, k_cache, v_cache, table, sl, qsl)
    assert relative_error(out, ref) < 2e-3
    mgr.free(pages)
    mgr.close()


@pytest.mark.parametrize("page", [16, 64])
def test_mla_kernel_on_sglang_pages(sglang_env: bool, page: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """paged_mla_decode on SGLang's MLA pool (one latent vector of 576 per token), viewed as its FlashMLA
    backend does (``kv_buffer.view(-1, page, D)``), against the float64 reference."""
    latent = 576  # kv_lora_rank 512 + rope 64: 1152 B a token, so whole engine pages need 18 MiB pages
    sg.shutdown_kvcached()
    monkeypatch.setenv("KVCACHED_PAGE_SIZE_MB", "18")
    monkeypatch.setenv("KVCACHED_HOST_MEM_LIMIT_MB", "256")
    sg.init_kvcached(device="cpu")
    bufs = sg.alloc_kv_cache((1000, 1, latent), torch.bfloat16, "cpu", LAYERS, page_size=page,
                             attention_type="MLA")
    mgr = sg.get_kv_cache_manager(bufs[0].shape[0] // page, page, latent * 2, LAYERS, num_kv_buffers=1)
    seq_lens = [page + 9, 3 * page - 1]
    cols = max(-(-n // page) for n in seq_lens)
    pages = mgr.alloc(cols * len(seq_lens))
    assert pages is not None
    table = torch.tensor(pages, dtype=torch.int32).view(len(seq_lens), cols)
    g = torch.Generator().manual_seed(page)
    for layer in range(LAYERS):  # every layer random: reading the wrong one shows
        for p in pages:
            bufs[layer][p * page:(p + 1) * page] = torch.randn(page, 1, latent, generator=g).to(torch.bfloat16)
    cache = bufs[1].view(-1, page, latent)
    assert cache.is_contiguous() == (not sglang_env)  # strided only on the contiguous layout
    query = torch.randn(len(seq_lens), 4, latent, generator=g).to(torch.bfloat16)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    got = paged_mla_decode(query, cache, table, lens, scale=latent**-0.5, num_splits=2)
    want = mla_decode_ref(query, cache, table, lens, scale=latent**-0.5, v_head_size=512)
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)
    mgr.free(pages)
    mgr.close()


@pytest.mark.parametrize("page", [3, 48, 16384])
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_page_size_that_does_not_divide_the_page(sglang_env: bool, page: int, mla: bool) -> None:
    # 8192 (MHA) / 16384 (MLA) tokens per 2 MiB page: 3 and 48 do not divide it, nor does 16384 for MHA
    if mla and page == 16384:
        page = 32768
    with pytest.raises(KVCachedConfigError, match="does not divide"):
        _alloc(mla, page)
    assert not vmm_ops.kv_tensors_created(0)  # refused before anything was reserved


def test_manager_cell_size_must_match_the_buffers(sglang_env: bool) -> None:
    ks, _ = sg.alloc_kv_cache((1000, HEADS, HEAD), DTYPE, "cpu", LAYERS, page_size=16)
    with pytest.raises(KVCachedConfigError, match="cell_size=512 B does not match the 256 B"):
        sg.get_kv_cache_manager(ks[0].shape[0] // 16, 16, 2 * TOKEN_BYTES, LAYERS)


def test_layout_helpers_refuse_bad_pages() -> None:
    spec = KVSpec(LAYERS, 10, 48, HEADS, HEAD, DTYPE)
    with pytest.raises(KVCachedConfigError, match="does not divide"):
        token_major_geometry(spec, Layout.CONTIGUOUS, PAGE)
    with pytest.raises(KVCachedConfigError, match="page_tokens must be a positive int"):
        engine_pages_per_page(0, TOKEN_BYTES, PAGE)
    with pytest.raises(KVCachedConfigError, match="does not divide"):
        engine_pages_per_page(1, 3 * 100 * 2, PAGE)  # a token that does not divide the page
    buf = torch.zeros(100, HEADS, HEAD)
    with pytest.raises(KVCachedConfigError, match="not whole pages of 16 tokens"):
        token_page_view(buf, 16)
    with pytest.raises(KVCachedConfigError, match="page_tokens must be a positive int"):
        token_page_view(buf, True)
    # the allocator's blocks of P tokens and the buffers' one-token blocks agree on every page
    geom = token_major_geometry(KVSpec(LAYERS, 1000, 64, HEADS, HEAD, DTYPE), Layout.CONTIGUOUS, PAGE)
    assert geom.spec.block_size == 1 and geom.spec.num_blocks == 64000
    assert geom.layer_strides(1).block_stride == LAYERS * 2 * HEADS * HEAD  # token-major

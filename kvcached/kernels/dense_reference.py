"""Deliberately wrong-on-strided-views kernels: what ROCm's vendor path does. Tests only.

vLLM's ROCm attention and cache-write kernels take the cache's data pointer and
compute every address as if each layer's K (and V) cache were a dense
``[num_blocks, block_size, num_kv_heads, head_size]`` tensor: block ``n`` at
``n * block_size * num_kv_heads * head_size`` elements. That holds for the per-layer
layout and is wrong for the contiguous layout, whose block stride is
``num_layers * 2`` blocks. These kernels reproduce exactly that addressing (they
ignore every stride of the caches) so a test can show the failure is visible:
on the contiguous layout they give wrong answers where ours give right ones, and on
the per-layer layout both agree. Never dispatch to them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _dense_write_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_heads, head_size,
    s_kt, s_vt, HD: tl.constexpr, BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK)
    ok = (i < HD) & ((i.to(tl.int64) * 0 + slot) >= 0)
    # the vendor assumption: token slot s starts at s * heads * head_size elements (dense)
    dst = slot * HD + i
    tl.store(k_cache_ptr + dst, tl.load(key_ptr + t * s_kt + i, mask=ok), mask=ok)
    tl.store(v_cache_ptr + dst, tl.load(value_ptr + t * s_vt + i, mask=ok), mask=ok)


@triton.jit
def _dense_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, seq_lens_ptr, out_ptr, scale,
    num_heads, num_kv_heads, max_blocks,
    BLOCK_SIZE: tl.constexpr, HEAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // (num_heads // num_kv_heads)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD
    q = tl.load(q_ptr + (seq * num_heads + head) * HEAD + d, mask=d_ok, other=0.0).to(tl.float32)
    seq_len = tl.load(seq_lens_ptr + seq)
    m = tl.full([], float("-inf"), tl.float32)
    lsum = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for n0 in range(0, seq_len, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        p_ok = pos < seq_len
        blk = tl.load(bt_ptr + seq * max_blocks + pos // BLOCK_SIZE, mask=p_ok, other=0).to(tl.int64)
        # dense per-layer addressing, strides ignored
        tok = (blk * BLOCK_SIZE + pos % BLOCK_SIZE) * num_kv_heads * HEAD + kv_head * HEAD
        mask = p_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + tok[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + tok[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.where(p_ok, tl.sum(k * q[None, :], 1) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        lsum = lsum * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m = m_new
    res = acc / tl.where(lsum > 0, lsum, 1.0)
    tl.store(out_ptr + (seq * num_heads + head) * HEAD + d, res.to(out_ptr.dtype.element_ty), mask=d_ok)


def dense_write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> None:
    """Cache write with dense per-layer addressing from the views' data pointers (strides ignored)."""
    num_tokens, num_heads, head_size = key.shape
    if key.stride(1) != head_size or key.stride(2) != 1 or value.stride(1) != head_size or value.stride(2) != 1:
        raise ValueError("dense_write_kv_cache needs each token's heads x head_size contiguous in key/value.")
    hd = num_heads * head_size
    _dense_write_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, num_heads, head_size, key.stride(0), value.stride(0),
        HD=hd, BLOCK=triton.next_power_of_2(hd),
    )


def dense_paged_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One decode token per sequence (``query`` ``[num_seqs, H, D]`` contiguous), dense cache addressing."""
    num_seqs, num_heads, head = query.shape
    num_kv_heads = k_cache.shape[2]
    query = query.contiguous()
    block_table = block_table.contiguous()
    out = torch.empty_like(query)
    _dense_decode_kernel[(num_seqs, num_heads)](
        query, k_cache, v_cache, block_table, seq_lens, out, scale, num_heads, num_kv_heads, block_table.shape[1],
        BLOCK_SIZE=k_cache.shape[1], HEAD=head, BLOCK_D=triton.next_power_of_2(head), BLOCK_N=16,
    )
    return out

"""Prefill (and chunked-prefill) paged attention: FlashAttention-2 over query tiles.

Grid ``(q_tiles, num_heads, num_seqs)`` sized from ``max_query_len`` on the host;
a program whose tile lies past its sequence's query length returns at once, so no
host synchronization is needed. Tiles are visited last-first so the long causal
tiles start early. Key tiles are split in three runs: masked tiles at the
sliding-window edge, unmasked interior tiles, masked tiles at the diagonal.

Group size, block size and the head size within its power-of-two tile (``PAD_D``:
80 and 96 on the 128 tile) are run-time values. ``FEATURES`` False is the plain
causal kernel; ``FEATURES`` True reads ``causal``, ``window`` (0 = off), ``softcap``
(0 = off), ``has_alibi`` and ``has_sinks`` at run time.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvcached.kernels.attention_common import LOG2E, NEG_BIG, attn_tile

# run-time scalars whose value must not make Triton compile another specialisation
_NO_SPECIALISE = ["group", "bs_shift", "window", "causal", "has_alibi", "has_sinks", "short_max"]


@triton.jit(do_not_specialize=_NO_SPECIALISE)
def prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    block_table_ptr,
    seq_lens_ptr,
    qsl_ptr,
    alibi_ptr,
    sinks_ptr,
    k_scale_ptr,
    v_scale_ptr,
    sm_scale,
    softcap,
    window,
    causal,
    has_alibi,
    has_sinks,
    group,
    bs_shift,
    short_max,
    head_size,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    HEAD_PAD: tl.constexpr,
    PAD_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FEATURES: tl.constexpr,
    FP8_KV: tl.constexpr,
    INTERP: tl.constexpr,
):
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    kv_head = head // group
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    m0 = tile * BLOCK_M
    if m0 >= q_len:
        return
    if q_len <= short_max:  # the decode kernel handles single tokens and short queries
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len

    rows = m0 + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    q_pos = ctx + rows
    d = tl.arange(0, HEAD_PAD)
    if PAD_D:
        d_mask = d < head_size  # a multiple of 16: Triton specialises on it, loads stay vectorised
    else:
        d_mask = d < HEAD_PAD
    tok = (q_start + rows).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head * stride_qh + d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    qk_scale = sm_scale * LOG2E
    if FP8_KV:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    slope = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + NEG_BIG
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if FEATURES:
        if has_alibi != 0:
            slope = slope + tl.load(alibi_ptr + head) * LOG2E
        if has_sinks != 0:
            m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(sinks_ptr + head).to(tl.float32) * LOG2E
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)

    # Keys some row of the tile sees: [lo, hi). Keys every row sees: [full_lo, full_hi).
    pos_first = ctx + m0
    pos_last = ctx + tl.minimum(m0 + BLOCK_M, q_len) - 1
    hi = pos_last + 1
    full_hi = pos_first + 1
    lo = seq_len * 0
    full_lo = seq_len * 0
    if FEATURES:
        if causal == 0:
            hi = seq_len
            full_hi = seq_len
        if window > 0:
            lo = tl.maximum(pos_first - window + 1, 0)
            full_lo = tl.maximum(pos_last - window + 1, 0)
    lo = (lo // BLOCK_N) * BLOCK_N
    full_lo = tl.minimum(((full_lo + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, hi)
    full_hi = tl.maximum((full_hi // BLOCK_N) * BLOCK_N, full_lo)

    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    for start in range(lo, full_lo, BLOCK_N):
        acc, m_i, l_i = attn_tile(
            acc, m_i, l_i, q, start, hi, q_pos, slope, k_head, v_head, bt_row,
            stride_kb, stride_kt, stride_vb, stride_vt, qk_scale, softcap, window, causal, bs_shift, d, d_mask,
            BLOCK_N, PAD_D, True, True, FEATURES, FP8_KV, INTERP,
        )  # fmt: skip
    for start in range(full_lo, full_hi, BLOCK_N):
        acc, m_i, l_i = attn_tile(
            acc, m_i, l_i, q, start, hi, q_pos, slope, k_head, v_head, bt_row,
            stride_kb, stride_kt, stride_vb, stride_vt, qk_scale, softcap, window, causal, bs_shift, d, d_mask,
            BLOCK_N, PAD_D, False, True, FEATURES, FP8_KV, INTERP,
        )  # fmt: skip
    for start in range(full_hi, hi, BLOCK_N):
        acc, m_i, l_i = attn_tile(
            acc, m_i, l_i, q, start, hi, q_pos, slope, k_head, v_head, bt_row,
            stride_kb, stride_kt, stride_vb, stride_vt, qk_scale, softcap, window, causal, bs_shift, d, d_mask,
            BLOCK_N, PAD_D, True, True, FEATURES, FP8_KV, INTERP,
        )  # fmt: skip

    if FP8_KV:
        acc = acc * tl.load(v_scale_ptr)
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + tok[:, None] * stride_ot + head * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


# ints Triton specialises as multiples of 16 at run time; the ahead-of-time check marks them too
prefill_kernel.divisible_by_16 = ("head_size",)

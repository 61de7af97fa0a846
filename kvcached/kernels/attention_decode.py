"""Single-token decode over a paged cache: split-KV (flash-decoding) plus its reduce.

One program serves one (sequence, KV head, split): the ``GROUP`` query heads that
share the KV head are the rows of the ``tl.dot`` (padded to ``BLOCK_H`` >= 16), so
each K/V tile is read once per KV head. With ``SPLIT`` the context is cut in
``num_splits`` runs of whole ``BLOCK_N`` tiles; each program writes its running
max, sum and unnormalised output (fp32); the merge (which alone counts the sink
logit) is done either by the last program of each (sequence, KV head) to finish,
found with a self-resetting atomic counter (``FUSED``: one launch), or by
``reduce_kernel`` (a second launch).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvcached.kernels.attention_common import LOG2E, NEG_BIG, attn_tile


@triton.jit
def decode_kernel(
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
    part_ptr,
    lock_ptr,
    sm_scale,
    softcap,
    window,
    num_splits,
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
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    FUSED: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr,
    SINKS: tl.constexpr,
    FP8_KV: tl.constexpr,
    INTERP: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    if tl.load(qsl_ptr + seq + 1) - q_start != 1:
        return  # not a decode sequence (or an empty one): the prefill kernel or nobody
    seq_len = tl.load(seq_lens_ptr + seq)
    pos = seq_len - 1

    h = tl.arange(0, BLOCK_H)
    h_mask = h < GROUP
    heads = kv_head * GROUP + h
    d = tl.arange(0, HEAD_PAD)
    d_mask = d < HEAD_SIZE
    PAD_D: tl.constexpr = HEAD_PAD != HEAD_SIZE
    q = tl.load(
        q_ptr + q_start.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    q_pos = tl.zeros([BLOCK_H], dtype=tl.int32) + pos

    qk_scale = sm_scale
    if FP8_KV:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    if not SOFTCAP:
        qk_scale = qk_scale * LOG2E
    if ALIBI:
        slope = tl.load(alibi_ptr + heads, mask=h_mask, other=0.0) * LOG2E
    else:
        slope = tl.zeros([BLOCK_H], dtype=tl.float32)

    if SINKS and not SPLIT:
        m_i = tl.load(sinks_ptr + heads, mask=h_mask, other=0.0).to(tl.float32) * LOG2E
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32) + 1.0
    else:
        m_i = tl.zeros([BLOCK_H], dtype=tl.float32) + NEG_BIG
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_PAD], dtype=tl.float32)

    lo = 0
    if SLIDING:
        lo = tl.maximum(pos - window + 1, 0)
    lo = (lo // BLOCK_N) * BLOCK_N
    hi = seq_len
    if SPLIT:
        per = tl.cdiv(tl.cdiv(hi - lo, num_splits), BLOCK_N) * BLOCK_N
        lo = lo + split * per
        hi = tl.minimum(lo + per, hi)

    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        acc, m_i, l_i = attn_tile(
            acc, m_i, l_i, q, start, hi, q_pos, slope, k_head, v_head, bt_row,
            stride_kb, stride_kt, stride_vb, stride_vt, qk_scale, softcap, window, d, d_mask,
            BLOCK_N, BLOCK_SIZE, PAD_D, True, False, SLIDING, SOFTCAP, ALIBI, FP8_KV, INTERP,
        )  # fmt: skip
    if FP8_KV:
        acc = acc * tl.load(v_scale_ptr)

    if SPLIT:
        # part_ptr: outputs [num_seqs, num_heads, num_splits, HEAD_PAD], then (max, sum) [..., 2]
        num_heads = tl.num_programs(1) * GROUP
        rows_total = tl.num_programs(0).to(tl.int64) * num_heads * num_splits
        part_ml_ptr = part_ptr + rows_total * HEAD_PAD
        row = (seq.to(tl.int64) * num_heads + heads) * num_splits + split
        tl.store(part_ptr + row[:, None] * HEAD_PAD + d[None, :], acc, mask=h_mask[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=h_mask)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=h_mask)
        if FUSED:
            # The last program of this (sequence, KV head) to finish merges every split: one
            # launch instead of two (host launch time dominates small batches). The counter
            # is put back to 0 by that program, so the buffer is clean for the next launch.
            tl.debug_barrier()  # every thread's partial stores precede the release below
            lock = lock_ptr + seq * tl.num_programs(1) + kv_head
            ticket = tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu")
            if ticket == num_splits - 1:
                tl.debug_barrier()
                _merge_splits(out_ptr, sinks_ptr, part_ptr, part_ml_ptr, q_start, seq, kv_head * GROUP, num_heads,
                              num_splits, stride_ot, stride_oh, GROUP, HEAD_SIZE, HEAD_PAD, SPLITS_PAD, SINKS)
                tl.atomic_xchg(lock, 0, sem="relaxed", scope="gpu")
    else:
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + q_start.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=h_mask[:, None] & d_mask[None, :],
        )


@triton.jit
def _merge_splits(out_ptr, sinks_ptr, part_ptr, part_ml_ptr, q_start, seq, head0, num_heads, num_splits, stride_ot,
                  stride_oh, NUM: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
                  SPLITS_PAD: tl.constexpr, SINKS: tl.constexpr):
    """Merge the ``num_splits`` partial results of query heads ``head0 .. head0 + NUM - 1`` into ``out``."""
    # splits per load: at most 8k fp32 values (64 registers a thread at 4 warps)
    CHUNK: tl.constexpr = max(2, min(SPLITS_PAD, 8192 // HEAD_PAD))
    s = tl.arange(0, SPLITS_PAD)
    s_mask = s < num_splits
    c = tl.arange(0, CHUNK)
    d = tl.arange(0, HEAD_PAD)
    d_mask = d < HEAD_SIZE
    # unrolled: the loads of every head can be issued before the first head's arithmetic waits
    for i in tl.static_range(NUM):
        head = head0 + i
        base = (seq.to(tl.int64) * num_heads + head) * num_splits
        # .cg: partials written by other programs of this launch, never from this SM's L1
        m = tl.load(part_ml_ptr + (base + s) * 2, mask=s_mask, other=NEG_BIG, cache_modifier=".cg")
        l_s = tl.load(part_ml_ptr + (base + s) * 2 + 1, mask=s_mask, other=0.0, cache_modifier=".cg")
        m_max = tl.max(m, 0)
        if SINKS:
            sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E
            m_max = tl.maximum(m_max, sink)
        l_tot = tl.sum(l_s * tl.exp2(m - m_max), 0)
        if SINKS:
            l_tot += tl.exp2(sink - m_max)
        l_tot = tl.where(l_tot == 0.0, 1.0, l_tot)
        acc = tl.zeros([HEAD_PAD], dtype=tl.float32)
        for c0 in range(0, num_splits, CHUNK):
            cs = c0 + c
            c_mask = cs < num_splits
            mc = tl.load(part_ml_ptr + (base + cs) * 2, mask=c_mask, other=NEG_BIG, cache_modifier=".cg")
            parts = tl.load(part_ptr + (base + cs)[:, None] * HEAD_PAD + d[None, :], mask=c_mask[:, None],
                            other=0.0, cache_modifier=".cg")
            acc += tl.sum(parts * tl.exp2(mc - m_max)[:, None], 0)
        tl.store(
            out_ptr + q_start.to(tl.int64) * stride_ot + head * stride_oh + d,
            (acc / l_tot).to(out_ptr.dtype.element_ty),
            mask=d_mask,
        )


@triton.jit
def reduce_kernel(
    out_ptr,
    qsl_ptr,
    sinks_ptr,
    part_ptr,
    num_splits,
    stride_ot,
    stride_oh,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(qsl_ptr + seq)
    if tl.load(qsl_ptr + seq + 1) - q_start != 1:
        return
    num_heads = tl.num_programs(1)
    part_ml_ptr = part_ptr + tl.num_programs(0).to(tl.int64) * num_heads * num_splits * HEAD_PAD
    s = tl.arange(0, SPLITS_PAD)
    s_mask = s < num_splits
    row = (seq.to(tl.int64) * num_heads + head) * num_splits + s
    m = tl.load(part_ml_ptr + row * 2, mask=s_mask, other=NEG_BIG)
    l_s = tl.load(part_ml_ptr + row * 2 + 1, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    if SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E
        m_max = tl.maximum(m_max, sink)
    w = tl.exp2(m - m_max)
    l_tot = tl.sum(l_s * w, 0)
    if SINKS:
        l_tot += tl.exp2(sink - m_max)
    l_tot = tl.where(l_tot == 0.0, 1.0, l_tot)
    d = tl.arange(0, HEAD_PAD)
    d_mask = d < HEAD_SIZE
    parts = tl.load(part_ptr + row[:, None] * HEAD_PAD + d[None, :], mask=s_mask[:, None], other=0.0)
    out = tl.sum(parts * w[:, None], 0) / l_tot
    tl.store(
        out_ptr + q_start.to(tl.int64) * stride_ot + head * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )

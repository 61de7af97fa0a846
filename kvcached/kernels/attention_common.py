"""The inner step shared by the prefill and decode attention kernels.

One call consumes ``BLOCK_N`` keys of a paged cache: it gathers their K and V rows
through the block table (every stride explicit, offsets in int64 because the
contiguous layout's block stride times a block id overflows int32), scores them
against the ``BLOCK_M`` query rows and folds them into the online softmax.
Scores are kept in the log2 domain (``log2(e)`` is folded into the scale) so the
exponentials are ``exp2``.

The block size is a run-time value (``bs_shift`` = log2(block_size): block sizes are
powers of two), and so are the features (``causal``, ``window`` 0 = off, ``softcap``
0 = off, ALiBi through ``slope`` = 0 when off): only ``FEATURES`` (a constexpr) decides
whether their code exists at all, so the plain causal path carries none of it.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
# A finite "minus infinity" for the running max: a row that has seen only masked
# keys then gives exp2(-inf - NEG_BIG) = 0 and alpha = 1 instead of NaN.
NEG_BIG = tl.constexpr(-1.0e30)


# 2^-8: a bf16 query scaled by it fits fp16 up to 1.6e7 (see fp8_query)
FP8_Q_SHIFT = tl.constexpr(0.00390625)


@triton.jit
def fp8_query(q, qk_scale, k_scale_ptr):
    """The decode's query and score scale for an fp8 KV cache: its products run in fp16.

    e4m3 (and AMD's e4m3fnuz) values are exact in fp16, and ``cvt.rn.f16x2.e4m3x2`` converts a pair in one
    instruction on sm89+, where bf16 products need two more ``cvt.bf16.f16`` (F2F) a pair: 256 F2F a thread a
    128-key tile of the sm90 decode (Triton 3.6). H100, 64 x 8k: 563 -> 469 us, 4 x 32k 162 -> 139, 8 x 8k
    94 -> 83 (benchmarks/results/fp8_products_h100_80gb_hbm3.md). A bf16 query goes to fp16 scaled by 2^-8 (the
    scale takes it back): 11 mantissa bits instead of 8, finite up to |q| = 1.6e7; P, in [0, 1], then goes to fp16
    too (``attn_tile`` casts it to V's dtype). Not the prefill's: there Triton 3.6 keeps a converted query in
    registers for each wgmma instead of in shared memory (sm90 256-row tile: 128 -> 240 bytes of stack), and
    its conversions are shared by 256 rows."""
    qk_scale = qk_scale * tl.load(k_scale_ptr)
    if q.dtype == tl.bfloat16:
        # bf16 to f32 by its bits (the high half of the f32), not ``q.to(tl.float32)``: LLVM narrows
        # fptrunc(fmul(fpext(bf16 x), 2^-8)) to an fmul in half after the truncation, since it takes bf16 for a
        # type that fits half (both 16 bits), so queries past 65504 became inf and the output NaN (H100,
        # Triton 3.6: tests/test_paged_attention.py::test_fp8_kv_bf16_queries_past_fp16_range; the interpreter
        # has no LLVM and passed). A bitcast from an integer is nothing LLVM can narrow.
        bits = q.to(tl.int16, bitcast=True).to(tl.int32) << 16
        q = (bits.to(tl.float32, bitcast=True) * FP8_Q_SHIFT).to(tl.float16)
        qk_scale = qk_scale / FP8_Q_SHIFT
    return q, qk_scale


@triton.jit
def tanh_f32(x):
    # tl has no portable tanh across triton 3.x / ROCm; exp overflows to inf -> +-1, which is right.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def attn_tile(
    acc,
    m_i,
    l_i,
    q,
    start,
    key_hi,
    q_pos,
    slope,
    k_ptr,
    v_ptr,
    bt_row_ptr,
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    qk_scale,
    softcap,
    window,
    causal,
    bs_shift,
    d,
    d_mask,
    BLOCK_N: tl.constexpr,
    PAD_D: tl.constexpr,
    MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    FEATURES: tl.constexpr,
    FP8_KV: tl.constexpr,
    INTERP: tl.constexpr,
    SAME_KV: tl.constexpr,
    blk_ids=None,
    mask_from=None,
):
    """``k_ptr``/``v_ptr`` already point at the KV head; ``bt_row_ptr`` at the block-table row; ``blk_ids``: the
    tile's block ids when the caller has loaded them (else they are loaded here). ``mask_from`` (plain causal
    compile, ``MASK`` False, ``blk_ids`` given): tiles from this key on get the causal mask, at run time.

    ``SAME_KV``: V's block and token strides equal K's (``stride_vb``/``stride_vt`` are then not read).

    ``MASK`` False means every key of the tile is visible to every row and lies
    below ``key_hi`` (interior tiles): no per-key masks at all. Without ``FEATURES``
    the mask is causal when ``CAUSAL``; with ``FEATURES`` the run-time ``causal``,
    ``window``, ``softcap`` and ``slope`` decide.
    """
    keys = start + tl.arange(0, BLOCK_N)
    if MASK:
        in_range = keys < key_hi
    if blk_ids is not None:
        blk = blk_ids.to(tl.int64)
    elif MASK:
        blk = tl.load(bt_row_ptr + (keys >> bs_shift), mask=in_range, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row_ptr + (keys >> bs_shift)).to(tl.int64)
    off = (keys & ((1 << bs_shift) - 1)).to(tl.int64)
    row = blk * stride_kb + off * stride_kt
    k_rows = k_ptr + row
    if SAME_KV:
        # V's block and token strides are K's (the host checked): one 64-bit offset per key serves both. Those
        # offsets are most of the short-query tile's integer work (sm90, Triton 3.6: 636 -> 553 instructions an
        # iteration); H200 at its power cap, 64 x 8k x q16 566 -> 535 us, 8 x 1k prefill 234 -> 227
        # (benchmarks/results/kv_offsets_h200.md)
        v_rows = v_ptr + row
    else:
        v_rows = v_ptr + blk * stride_vb + off * stride_vt
    if MASK:
        if PAD_D:
            kv_mask = in_range[:, None] & d_mask[None, :]
        else:
            kv_mask = in_range[:, None]
        k = tl.load(k_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
    elif PAD_D:
        k = tl.load(k_rows[:, None] + d[None, :], mask=d_mask[None, :], other=0.0)
    else:
        k = tl.load(k_rows[:, None] + d[None, :])
    if FP8_KV:
        k = k.to(q.dtype)  # the decode: fp16 (fp8_query); the prefill: the query's dtype
    if INTERP:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
    else:
        s = tl.dot(q, tl.trans(k))
    if FEATURES:
        s = s * qk_scale
        if softcap > 0:
            # s is log2(e) * x; softcap applies to x: cap * tanh(x / cap), kept in the log2 domain
            cap2 = softcap * LOG2E
            s = cap2 * tanh_f32(s / cap2)
        rel = (keys[None, :] - q_pos[:, None]).to(tl.float32)
        s = s + slope[:, None] * rel  # slope 0 without ALiBi
    if MASK:
        visible = in_range[None, :]
        if FEATURES:
            visible = visible & ((keys[None, :] <= q_pos[:, None]) | (causal == 0))
            visible = visible & ((keys[None, :] > q_pos[:, None] - window) | (window == 0))
        elif CAUSAL:
            visible = visible & (keys[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
    elif mask_from is not None:
        if start >= mask_from:  # keys past the tile's last row are 0 block ids (the caller's mask), then hidden
            s = tl.where(keys[None, :] <= q_pos[:, None], s, float("-inf"))
    if FEATURES:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
    else:
        # The scale (> 0: the callers refuse other scales) goes into one multiply-add with the max
        # instead of a pass of its own over the scores (with the P.V change below, one 8k prompt on an
        # H200 went from 1705 to 1676 us: benchmarks/results/prefill_tiles_h200.md, run 2).
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASK:
        v = tl.load(v_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
    elif PAD_D:
        v = tl.load(v_rows[:, None] + d[None, :], mask=d_mask[None, :], other=0.0)
    else:
        v = tl.load(v_rows[:, None] + d[None, :])
    if FP8_KV:
        v = v.to(q.dtype)
    # The product accumulates into acc itself: a separate P.V result would hold a second
    # accumulator's worth of registers (64 a thread in the 128 x 128 prefill tile at 8 warps).
    acc = acc * alpha[:, None]
    if INTERP:
        acc = tl.dot(p, v.to(tl.float32), acc)
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


@triton.jit
def _tile_run(
    acc, m_i, l_i, q, run_lo, run_hi, hi, q_pos, slope, k_ptr, v_ptr, bt_row_ptr, stride_kb, stride_kt, stride_vb,
    stride_vt, qk_scale, softcap, window, causal, bs_shift, d, d_mask,
    BLOCK_N: tl.constexpr, PAD_D: tl.constexpr, MASK: tl.constexpr, FEATURES: tl.constexpr, FP8_KV: tl.constexpr,
    BT_AHEAD: tl.constexpr, INTERP: tl.constexpr, SAME_KV: tl.constexpr, mask_from=None,
):
    """:func:`attn_tile` over the tiles from ``run_lo`` to ``run_hi`` (keys past ``hi`` masked when ``MASK``;
    ``mask_from``: see :func:`attn_tile`, with ``BT_AHEAD`` only).

    ``BT_AHEAD``: each iteration loads the next tile's block ids into registers. Loaded in the iteration that
    uses them, they are a global load the K/V addresses wait on, and Triton 3.6's pipeliner then issues the
    next tile's K/V copies only at the end of the iteration and waits for all copies at its top
    (``async_wait {num = 0}`` in the sm90 TTGIR): no load overlaps the QK product or the softmax. With the ids
    a tile ahead, the copies go two tiles ahead (``num = 2``; one more K/V buffer in shared memory).
    """
    if BT_AHEAD:
        ar = tl.arange(0, BLOCK_N)
        nxt = run_lo + ar
        blk_n = tl.load(bt_row_ptr + (nxt >> bs_shift), mask=nxt < run_hi, other=0)  # run_hi <= hi
        for start in range(run_lo, run_hi, BLOCK_N):
            blk = blk_n
            nxt = start + BLOCK_N + ar
            blk_n = tl.load(bt_row_ptr + (nxt >> bs_shift), mask=nxt < run_hi, other=0)
            acc, m_i, l_i = attn_tile(
                acc, m_i, l_i, q, start, hi, q_pos, slope, k_ptr, v_ptr, bt_row_ptr, stride_kb, stride_kt, stride_vb,
                stride_vt, qk_scale, softcap, window, causal, bs_shift, d, d_mask, BLOCK_N, PAD_D, MASK, True,
                FEATURES, FP8_KV, INTERP, SAME_KV, blk, mask_from,
            )
    else:
        for start in range(run_lo, run_hi, BLOCK_N):
            acc, m_i, l_i = attn_tile(
                acc, m_i, l_i, q, start, hi, q_pos, slope, k_ptr, v_ptr, bt_row_ptr, stride_kb, stride_kt, stride_vb,
                stride_vt, qk_scale, softcap, window, causal, bs_shift, d, d_mask, BLOCK_N, PAD_D, MASK, True,
                FEATURES, FP8_KV, INTERP, SAME_KV,
            )
    return acc, m_i, l_i


@triton.jit
def attn_tiles(
    acc, m_i, l_i, q, lo, full_lo, full_hi, hi, q_pos, slope, k_ptr, v_ptr, bt_row_ptr, stride_kb, stride_kt,
    stride_vb, stride_vt, qk_scale, softcap, window, causal, bs_shift, d, d_mask,
    BLOCK_N: tl.constexpr, PAD_D: tl.constexpr, LEAD: tl.constexpr, FEATURES: tl.constexpr, FP8_KV: tl.constexpr,
    INTERP: tl.constexpr, SAME_KV: tl.constexpr, BT_AHEAD: tl.constexpr = False, ONE_RUN: tl.constexpr = False,
):
    """:func:`attn_tile` over keys ``[lo, hi)`` a tile at a time: the tiles from ``full_lo`` to ``full_hi`` whole
    for every row (no masks), the others masked. ``LEAD`` False: there are no masked tiles before ``full_lo``
    (the caller passes ``full_lo == lo``, and the loop is not compiled). ``BT_AHEAD``: see :func:`_tile_run`.
    ``ONE_RUN`` (plain causal compile with ``BT_AHEAD``): the tiles from ``full_hi`` on go through the interior
    run's loop, their mask behind a run-time test, so a program fills one K/V pipeline instead of two."""
    if LEAD:
        acc, m_i, l_i = _tile_run(
            acc, m_i, l_i, q, lo, full_lo, hi, q_pos, slope, k_ptr, v_ptr, bt_row_ptr, stride_kb, stride_kt,
            stride_vb, stride_vt, qk_scale, softcap, window, causal, bs_shift, d, d_mask, BLOCK_N, PAD_D, True,
            FEATURES, FP8_KV, BT_AHEAD, INTERP, SAME_KV,
        )
    if ONE_RUN:
        tl.static_assert(BT_AHEAD and not FEATURES, "ONE_RUN: the plain causal compile with BT_AHEAD only")
        run_hi = hi
        mask_from = full_hi
    else:
        run_hi = full_hi
        mask_from = None
    acc, m_i, l_i = _tile_run(
        acc, m_i, l_i, q, full_lo, run_hi, hi, q_pos, slope, k_ptr, v_ptr, bt_row_ptr, stride_kb, stride_kt,
        stride_vb, stride_vt, qk_scale, softcap, window, causal, bs_shift, d, d_mask, BLOCK_N, PAD_D, False,
        FEATURES, FP8_KV, BT_AHEAD, INTERP, SAME_KV, mask_from,
    )
    if not ONE_RUN:
        acc, m_i, l_i = _tile_run(
            acc, m_i, l_i, q, full_hi, hi, hi, q_pos, slope, k_ptr, v_ptr, bt_row_ptr, stride_kb, stride_kt,
            stride_vb, stride_vt, qk_scale, softcap, window, causal, bs_shift, d, d_mask, BLOCK_N, PAD_D, True,
            FEATURES, FP8_KV, BT_AHEAD, INTERP, SAME_KV,
        )
    return acc, m_i, l_i

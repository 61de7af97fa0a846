"""Prefill (and chunked-prefill) paged attention: FlashAttention-2 over query tiles.

The rows of a program are (query token, query head) pairs: ``per`` = ``BLOCK_M //
group`` tokens times the heads that share a KV head (a group above ``BLOCK_M`` takes
several programs), so a K/V tile is loaded once for the whole group instead of once
per query head: a quarter of the loads at 32 query / 8 KV heads.

Grid ``(slots x head_slots,)``: ``slots = num_tokens // per + num_seqs``, ``head_slots``
= KV heads x head chunks. Sequence ``i``'s tiles take the slots from
``query_start_loc[i] // per + i`` on, a bound the host knows without reading the
device, and each program finds its sequence among those starts (one load and a count
below ``LOOKUP`` sequences, ``attention_config.PrefillConfig.lookup``; a binary search
otherwise). A
grid of ``max_query_len`` tiles for every sequence would launch a program for each
tile of each decode in a mixed batch (60 decodes beside 4 chunks of 1024: 15k
programs that return at once; about 18 us of that batch's 1559 on an H200,
benchmarks/results/prefill_tiles_h200.md). Slots past a sequence's tiles return at
once.

Launch order: slots last-first, so a sequence's long causal tiles start early, and
the head slots of one slot side by side. The GPU hands out programs in launch order;
with the heads outermost, the last head's long tiles started after the first heads'
short ones and ran on alone at the end. H200, bf16 32/8 heads d128, graph replay
(benchmarks/results/prefill_launch_order_h200.md): 8 x 1k 254 -> 234 us, 4 x 2k 413 ->
376, 4 chunks of 1024 after 3072 cached tokens 587 -> 551; one 8k prompt unchanged.

Key tiles are split in three runs: masked tiles at the sliding-window edge, unmasked
interior tiles, masked tiles at the diagonal; with ``ONE_RUN`` (plain causal, block
ids a tile ahead) the diagonal's tiles go through the interior loop behind a run-time
mask, one K/V pipeline to fill instead of two (short prompts:
``attention_config.prefill_tile``).

Group size, block size and the head size within its power-of-two tile (``PAD_D``:
80 and 96 on the 128 tile) are run-time values. ``FEATURES`` False is the plain
causal kernel; ``FEATURES`` True reads ``causal``, ``window`` (0 = off), ``softcap``
(0 = off), ``has_alibi`` and ``has_sinks`` at run time. ``SAME_KV``: V's block and token strides are K's, and
one offset per key addresses both (``attention_common.attn_tile``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvcached.kernels.attention_common import LOG2E, NEG_BIG, attn_tiles

# run-time scalars whose value must not make Triton compile another specialisation
_NO_SPECIALISE = ["group", "bs_shift", "window", "causal", "has_alibi", "has_sinks", "short_max", "num_seqs",
                  "head_slots"]


@triton.jit
def _search_seq(qsl_ptr, num_seqs, per, slot):
    """Binary search: the last sequence whose first slot is <= slot (log2(num_seqs) loads in a row)."""
    seq = 0
    above = num_seqs
    while above - seq > 1:
        mid = (seq + above) // 2
        if tl.load(qsl_ptr + mid) // per + mid <= slot:
            seq = mid
        else:
            above = mid
    return seq


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
    num_seqs,
    head_slots,
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
    BT_AHEAD: tl.constexpr,
    ONE_RUN: tl.constexpr,
    LOOKUP: tl.constexpr,
    INTERP: tl.constexpr,
    SAME_KV: tl.constexpr,
):
    pid = tl.program_id(0)
    slot = tl.num_programs(0) // head_slots - 1 - pid // head_slots
    hslot = pid % head_slots  # kv_head * chunks + chunk
    chunks = tl.cdiv(group, BLOCK_M)
    hc = tl.minimum(group, BLOCK_M)  # heads of the group in one program
    per = BLOCK_M // hc  # query tokens in one program
    kv_head = hslot // chunks
    h0 = (hslot % chunks) * BLOCK_M  # first head of this chunk within the group
    # the last sequence whose first slot (query_start_loc[i] // per + i, increasing in i) is <= slot: counted
    # over one load of the batch's starts below LOOKUP sequences (one round trip on the program's way to its
    # first key tile, where a binary search makes log2(num_seqs) in a row), searched otherwise
    if LOOKUP > 0:
        if num_seqs < LOOKUP:
            b = tl.arange(0, LOOKUP)
            starts = tl.load(qsl_ptr + b, mask=b < num_seqs, other=0)
            seq = tl.maximum(tl.sum(((starts // per + b <= slot) & (b < num_seqs)).to(tl.int32), 0) - 1, 0)
        else:
            seq = _search_seq(qsl_ptr, num_seqs, per, slot)
    else:
        seq = _search_seq(qsl_ptr, num_seqs, per, slot)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    # volatile: the compiler may not sink the load below the returns, so it leaves beside the query's bounds,
    # not one round trip after them on this program's way to its first key tile
    seq_len = tl.load(seq_lens_ptr + seq, volatile=True)
    t0 = (slot - q_start // per - seq) * per
    if t0 < 0 or t0 >= q_len:  # below: slots before a query_start_loc[0] > 0
        return
    if q_len <= short_max:  # the decode kernel handles single tokens and short queries
        return
    ctx = seq_len - q_len

    r = tl.arange(0, BLOCK_M)
    t = t0 + r // hc
    h = h0 + r % hc
    row_mask = (r < per * hc) & (h < group) & (t < q_len)
    heads = kv_head * group + h
    q_pos = ctx + t
    d = tl.arange(0, HEAD_PAD)
    if PAD_D:
        d_mask = d < head_size  # a multiple of 16: Triton specialises on it, loads stay vectorised
    else:
        d_mask = d < HEAD_PAD
    tok = (q_start + t).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
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
            slope = tl.load(alibi_ptr + heads, mask=row_mask, other=0.0) * LOG2E
        if has_sinks != 0:
            m_i = tl.load(sinks_ptr + heads, mask=row_mask, other=0.0).to(tl.float32) * LOG2E
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)

    # Keys some row of the tile sees: [lo, hi). Keys every row sees: [full_lo, full_hi).
    pos_first = ctx + t0
    pos_last = ctx + tl.minimum(t0 + per, q_len) - 1
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
    # masked tiles before the interior (LEAD) only at a sliding window's edge: without features lo = full_lo = 0,
    # and a compiled lead run, empty, still cost every program its pipeline prologue and a wait for all copies
    # (H200, benchmarks/results/prefill_setup_h200.md)
    acc, m_i, l_i = attn_tiles(
        acc, m_i, l_i, q, lo, full_lo, full_hi, hi, q_pos, slope, k_head, v_head, bt_row, stride_kb, stride_kt,
        stride_vb, stride_vt, qk_scale, softcap, window, causal, bs_shift, d, d_mask, BLOCK_N, PAD_D, FEATURES,
        FEATURES, FP8_KV, INTERP, SAME_KV, BT_AHEAD, ONE_RUN,
    )

    if FP8_KV:
        acc = acc * tl.load(v_scale_ptr)
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


# ints Triton specialises as multiples of 16 at run time; the ahead-of-time check marks them too
prefill_kernel.divisible_by_16 = ("head_size",)

"""Decode and short queries over a paged cache: split-KV (flash-decoding) plus its reduce.

One program serves one (sequence, KV head, head chunk, token block, split): the rows
of the ``tl.dot`` are (query token, query head) pairs, up to ``BLOCK_H`` of them, for
the heads that share the KV head. A decode (one token) fills them with heads (16 a
program); a short query (2 to ``SHORT_MAX``, 16, tokens: speculative-decoding checks,
draft tokens, the tail of a chunked prefill) with all of its tokens times the group
(32 or 64 rows a program, the smallest that holds them), so each K/V tile is read once
for every row that needs it instead of once per prefill tile of up to 64 tokens. Rows are causal: token ``t`` of a
``q_len``-token query sits at ``seq_len - q_len + t``. The split
count is a run-time value: with ``num_splits`` 1 the program writes the output; with
more, the context is cut in up to ``num_splits`` runs of whole ``BLOCK_N`` tiles (with
``balance``, runs of about the batch's mean share of keys, so a long sequence takes
more programs than a short one) and each program with a run writes its running max,
sum and unnormalised output (fp32), the others return at once; the merge (which alone
counts the sink logit) takes the runs a row has, done either by the last program of each
(sequence, KV head, head chunk) to finish, found with a self-resetting atomic counter
(``fused`` 1: one launch), or by ``reduce_kernel`` (a second launch). The stream-K launch
(``STREAM``, for batches whose queries each fit one program) has a fixed set of programs per
head slot instead, which share the batch's key tiles equally in sequence order; a program
writes a partial for every sequence it touches and the same merge combines them. Group size,
block size, split count and every feature are run-time values, and so is the head
size within its power-of-two tile (80 and 96 share the 128 tile, ``PAD_D``), so one
compile per (dtypes, tile, ``FEATURES``, ``SAME_KV``: V's strides are K's) serves every shape.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvcached.kernels.attention_common import LOG2E, NEG_BIG, attn_tiles, fp8_query

# run-time scalars whose value must not make Triton compile another specialisation
_NO_SPECIALISE = ["group", "bs_shift", "num_splits", "balance", "waves", "run_floor", "fused", "window", "causal",
                  "has_alibi", "has_sinks", "qmax", "tblocks", "tb_inner", "stream_seqs", "min_tiles"]


@triton.jit(do_not_specialize=_NO_SPECIALISE)
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
    causal,
    has_alibi,
    has_sinks,
    group,
    bs_shift,
    num_splits,
    balance,
    waves,
    run_floor,
    fused,
    qmax,
    tblocks,
    tb_inner,
    stream_seqs,
    min_tiles,
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
    BLOCK_H: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    PAD_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FEATURES: tl.constexpr,
    FP8_KV: tl.constexpr,
    UNMASKED: tl.constexpr,
    STREAM: tl.constexpr,
    BT_AHEAD: tl.constexpr,
    INTERP: tl.constexpr,
    SAME_KV: tl.constexpr,
):
    hslot = tl.program_id(1)  # kv_head * chunks + chunk
    if STREAM:
        # Stream-K (one token block a sequence): the ``tl.num_programs(0)`` programs of this head slot share the
        # batch's key tiles equally, in sequence order, so uneven lengths leave no program with more than its
        # share (with a run per sequence, the longest sets the time). A program's tiles may span the end of one
        # sequence and the start of the next: a partial for each, at slot ``sequence + program``, which is unique
        # (the programs over sequence i + 1 start where those over i end) and below ``num_splits`` (sequences +
        # programs). Every program plans from the lengths on the device, so a replayed CUDA graph plans afresh.
        p = tl.program_id(0)
        total = tl.sum(tl.zeros([256], dtype=tl.int32), 0)
        for b0 in range(0, stream_seqs, 256):
            total += tl.sum(_batch_tiles(b0, stream_seqs, seq_lens_ptr, qsl_ptr, window, qmax, BLOCK_N, FEATURES), 0)
        per_prog = tl.maximum(tl.cdiv(total, tl.num_programs(0)), min_tiles)
        a = p * per_prog
        b = tl.minimum(a + per_prog, total)
        # the first sequence that ends past tile ``a``, and the tiles before it (lengths are in order: one count)
        seq = total * 0
        s = total * 0
        chunk_base = total * 0
        for b0 in range(0, stream_seqs, 256):
            tiles = _batch_tiles(b0, stream_seqs, seq_lens_ptr, qsl_ptr, window, qmax, BLOCK_N, FEATURES)
            before = chunk_base + tl.cumsum(tiles, 0) <= a
            seq += tl.sum(before.to(tl.int32), 0)
            s += tl.sum(tl.where(before, tiles, 0), 0)
            chunk_base += tl.sum(tiles, 0)
        cur = a
        while cur < b:
            q_start = tl.load(qsl_ptr + seq)
            q_len = tl.load(qsl_ptr + seq + 1) - q_start
            seq_len = tl.load(seq_lens_ptr + seq)
            e = s + _seq_tiles(seq_len, q_len, window, qmax, BLOCK_N, FEATURES)
            if e > cur:
                lo = _seq_lo(seq_len, q_len, window, BLOCK_N, FEATURES)
                first = s // per_prog
                end = tl.minimum(b, e)
                rows = _rows(q_start, q_len, seq_len, hslot, 0, group, head_size, BLOCK_H, HEAD_PAD, PAD_D)
                t, h_mask, heads, tok, d, d_mask, q_pos = rows
                acc, m_i, l_i = _keys(
                    q_ptr, k_ptr, v_ptr, block_table_ptr, alibi_ptr, sinks_ptr, k_scale_ptr, v_scale_ptr, sm_scale,
                    softcap, window, causal, has_alibi, has_sinks, group, bs_shift, num_splits, stride_qt, stride_qh,
                    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt, seq, hslot,
                    seq_len - q_len, lo + (cur - s) * BLOCK_N, tl.minimum(lo + (end - s) * BLOCK_N, seq_len), 0, 1,
                    h_mask, heads, tok, d, d_mask, q_pos, BLOCK_H, HEAD_PAD, PAD_D, BLOCK_N, FEATURES, FP8_KV, False,
                    BT_AHEAD, INTERP, SAME_KV,
                )
                _finish(out_ptr, sinks_ptr, part_ptr, lock_ptr, acc, m_i, l_i, has_sinks, group, num_splits, fused,
                        qmax, tblocks, head_size, stride_ot, stride_oh, seq, stream_seqs, hslot, 0, q_start, q_len,
                        seq + p, (e - 1) // per_prog - first + 1, seq + first, p == first, t, h_mask, heads, tok, d,
                        d_mask, BLOCK_H, HEAD_PAD, True)
                cur = end
            seq += 1
            s = e
    else:
        _columns(q_ptr, k_ptr, v_ptr, out_ptr, block_table_ptr, seq_lens_ptr, qsl_ptr, alibi_ptr, sinks_ptr,
                 k_scale_ptr, v_scale_ptr, part_ptr, lock_ptr, sm_scale, softcap, window, causal, has_alibi, has_sinks,
                 group, bs_shift, num_splits, balance, waves, run_floor, fused, qmax, tblocks, tb_inner, head_size,
                 stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_ot,
                 stride_oh, stride_bt, BLOCK_H, HEAD_PAD, PAD_D, BLOCK_N, FEATURES, FP8_KV, UNMASKED, BT_AHEAD,
                 INTERP, SAME_KV)


@triton.jit
def _columns(q_ptr, k_ptr, v_ptr, out_ptr, block_table_ptr, seq_lens_ptr, qsl_ptr, alibi_ptr, sinks_ptr, k_scale_ptr,
             v_scale_ptr, part_ptr, lock_ptr, sm_scale, softcap, window, causal, has_alibi, has_sinks, group, bs_shift,
             num_splits, balance, waves, run_floor, fused, qmax, tblocks, tb_inner, head_size, stride_qt, stride_qh,
             stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_ot, stride_oh, stride_bt,
             BLOCK_H: tl.constexpr, HEAD_PAD: tl.constexpr, PAD_D: tl.constexpr, BLOCK_N: tl.constexpr,
             FEATURES: tl.constexpr, FP8_KV: tl.constexpr, UNMASKED: tl.constexpr, BT_AHEAD: tl.constexpr,
             INTERP: tl.constexpr, SAME_KV: tl.constexpr):
    """The launch of a column of up to ``num_splits`` programs per (sequence, head slot, token block)."""
    hslot = tl.program_id(1)
    if tb_inner != 0:
        # every token block has work (a batch of short queries): a sequence's blocks are launched side by
        # side, so they read the same K/V tiles at about the same time and all but the first find them in L2
        seq = tl.program_id(0) // tblocks
        tb = tl.program_id(0) % tblocks
        split = tl.program_id(2)
        num_seqs = tl.num_programs(0) // tblocks
    else:
        # beside a prefill most sequences are single tokens: the first token block of every sequence is
        # launched first and spread evenly over the GPU; the other blocks (most return at once) follow
        seq = tl.program_id(0)
        tb = tl.program_id(2) % tblocks
        split = tl.program_id(2) // tblocks
        num_seqs = tl.num_programs(0)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    # loaded before the test below so that both round trips to memory overlap (a batch-1 decode is a chain of them)
    seq_len = tl.load(seq_lens_ptr + seq)
    if (q_len < 1) | (q_len > qmax):
        return  # a longer query (the prefill kernel's) or an empty one
    hc = tl.minimum(group, BLOCK_H)  # heads of the group in one program
    per = BLOCK_H // hc  # query tokens in one program
    t0 = tb * per
    if t0 >= q_len:
        return
    t, h_mask, heads, tok, d, d_mask, q_pos = _rows(q_start, q_len, seq_len, hslot, tb, group, head_size, BLOCK_H,
                                                    HEAD_PAD, PAD_D)
    ctx = seq_len - q_len
    last = ctx + tl.minimum(t0 + per, q_len) - 1  # the position of this program's last token
    lo = seq_len * 0
    if FEATURES:
        if window > 0:
            lo = tl.maximum(ctx + t0 - window + 1, 0)
    lo = (lo // BLOCK_N) * BLOCK_N
    hi = tl.where(causal != 0, last + 1, seq_len)  # causal rows see nothing past the last one
    # runs of this program's range, never more than its tiles (the last may still fall past the end: an
    # empty run writes a neutral partial); splits past ``parts`` return below and write nothing
    parts = tl.minimum(tl.cdiv(hi - lo, BLOCK_N), num_splits)
    if (num_splits > 1) & (balance > 0):
        # Uneven lengths: cut every sequence into runs of at most about the batch's keys / ``balance``
        # (one wave of programs), instead of each into num_splits equal parts (the longest would set
        # the time). The sum is read here, not on the host, so a replayed CUDA graph plans afresh. Token
        # blocks are not counted here: the host divides ``balance`` by those it expects to have work.
        total = (seq_len * 0).to(tl.int64)
        for b0 in range(0, num_seqs, 256):
            bs = b0 + tl.arange(0, 256)
            total += tl.sum(tl.load(seq_lens_ptr + bs, mask=bs < num_seqs, other=0).to(tl.int64), 0)
        per_program = tl.maximum(tl.cdiv(total * tl.num_programs(1), balance), 1)
        if waves > 1:
            # One wave's runs leave a second, mostly idle wave when lengths are uneven (every short sequence
            # still takes a program): then runs ``waves`` times shorter, but not below ``run_floor`` keys
            # (nor above one wave's), so the GPU's scheduler packs them. Equal lengths keep one wave.
            run1 = per_program + per_program // 8
            n1 = (seq_len * 0).to(tl.int64)
            for b0 in range(0, num_seqs, 256):
                bs = b0 + tl.arange(0, 256)
                ln = tl.load(seq_lens_ptr + bs, mask=bs < num_seqs, other=0)
                runs = tl.minimum(tl.maximum(tl.cdiv(ln, run1), 1), num_splits)
                n1 += tl.sum(tl.where(bs < num_seqs, runs, 0).to(tl.int64), 0)
            if n1 * tl.num_programs(1) > balance:
                per_program = tl.maximum(tl.cdiv(per_program, waves), tl.minimum(per_program, run_floor))
        # up to 1/8 over the mean stays whole: a batch of equal lengths that fills the GPU keeps one run each
        parts = tl.minimum(tl.cdiv(hi - lo, per_program + per_program // 8), parts).to(tl.int32)
    parts = tl.maximum(parts, 1)
    if split >= parts:
        return  # the merge takes the first ``parts`` partials only
    acc, m_i, l_i = _keys(
        q_ptr, k_ptr, v_ptr, block_table_ptr, alibi_ptr, sinks_ptr, k_scale_ptr, v_scale_ptr, sm_scale, softcap,
        window, causal, has_alibi, has_sinks, group, bs_shift, num_splits, stride_qt, stride_qh, stride_kb, stride_kt,
        stride_kh, stride_vb, stride_vt, stride_vh, stride_bt, seq, hslot, ctx + t0, lo, hi, split, parts, h_mask,
        heads, tok, d, d_mask, q_pos, BLOCK_H, HEAD_PAD, PAD_D, BLOCK_N, FEATURES, FP8_KV, UNMASKED, BT_AHEAD, INTERP,
        SAME_KV,
    )
    _finish(out_ptr, sinks_ptr, part_ptr, lock_ptr, acc, m_i, l_i, has_sinks, group, num_splits, fused, qmax, tblocks,
            head_size, stride_ot, stride_oh, seq, num_seqs, hslot, tb, q_start, q_len, split, parts, 0, split == 0, t,
            h_mask, heads, tok, d, d_mask, BLOCK_H, HEAD_PAD, False)


@triton.jit
def _seq_lo(seq_len, q_len, window, BLOCK_N: tl.constexpr, FEATURES: tl.constexpr):
    """The first key (a whole tile) a one-block query sees: 0, or its window's start."""
    lo = seq_len * 0
    if FEATURES:
        if window > 0:
            lo = tl.maximum(seq_len - q_len - window + 1, 0)
    return (lo // BLOCK_N) * BLOCK_N


@triton.jit
def _seq_tiles(seq_len, q_len, window, qmax, BLOCK_N: tl.constexpr, FEATURES: tl.constexpr):
    """Key tiles of a one-block query (0 for a query the kernel does not take); scalars or vectors."""
    tiles = tl.cdiv(seq_len - _seq_lo(seq_len, q_len, window, BLOCK_N, FEATURES), BLOCK_N)
    return tl.where((q_len >= 1) & (q_len <= qmax), tiles, 0)


@triton.jit
def _batch_tiles(b0, num_seqs, seq_lens_ptr, qsl_ptr, window, qmax, BLOCK_N: tl.constexpr, FEATURES: tl.constexpr):
    """:func:`_seq_tiles` of sequences ``b0`` to ``b0 + 255`` (0 past the batch: an empty query)."""
    b = b0 + tl.arange(0, 256)
    ok = b < num_seqs
    q_start = tl.load(qsl_ptr + b, mask=ok, other=0)
    q_len = tl.load(qsl_ptr + b + 1, mask=ok, other=0) - q_start
    seq_len = tl.load(seq_lens_ptr + b, mask=ok, other=0)
    return _seq_tiles(seq_len, q_len, window, qmax, BLOCK_N, FEATURES)


@triton.jit
def _rows(q_start, q_len, seq_len, hslot, tb, group, head_size, BLOCK_H: tl.constexpr, HEAD_PAD: tl.constexpr,
          PAD_D: tl.constexpr):
    """A program's rows (query token ``t``, head ``heads``) and head dimensions: (t, row mask, heads, token
    index, d, d mask, the rows' positions)."""
    chunks = tl.cdiv(group, BLOCK_H)
    hc = tl.minimum(group, BLOCK_H)  # heads of the group in one program
    per = BLOCK_H // hc  # query tokens in one program
    r = tl.arange(0, BLOCK_H)
    t = tb * per + r // hc
    h = (hslot % chunks) * BLOCK_H + r % hc
    h_mask = (r < per * hc) & (h < group) & (t < q_len)
    heads = (hslot // chunks) * group + h
    tok = (q_start + t).to(tl.int64)
    d = tl.arange(0, HEAD_PAD)
    if PAD_D:
        d_mask = d < head_size  # a multiple of 16: Triton specialises on it, loads stay vectorised
    else:
        d_mask = d < HEAD_PAD
    return t, h_mask, heads, tok, d, d_mask, seq_len - q_len + t


@triton.jit
def _keys(q_ptr, k_ptr, v_ptr, block_table_ptr, alibi_ptr, sinks_ptr, k_scale_ptr, v_scale_ptr, sm_scale, softcap,
          window, causal, has_alibi, has_sinks, group, bs_shift, num_splits, stride_qt, stride_qh, stride_kb,
          stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt, seq, hslot, first_pos, lo, hi, run, runs,
          h_mask, heads, tok, d, d_mask, q_pos,
          BLOCK_H: tl.constexpr, HEAD_PAD: tl.constexpr, PAD_D: tl.constexpr, BLOCK_N: tl.constexpr,
          FEATURES: tl.constexpr, FP8_KV: tl.constexpr, UNMASKED: tl.constexpr, BT_AHEAD: tl.constexpr,
          INTERP: tl.constexpr, SAME_KV: tl.constexpr):
    """Run ``run`` of ``runs`` (equal runs of whole tiles) of keys ``[lo, hi)`` for the rows: (acc, max, sum).
    ``first_pos``: the first row's position."""
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    qk_scale = sm_scale * LOG2E
    if FP8_KV:
        q, qk_scale = fp8_query(q, qk_scale, k_scale_ptr)
    m_i = tl.zeros([BLOCK_H], dtype=tl.float32) + NEG_BIG
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    slope = tl.zeros([BLOCK_H], dtype=tl.float32)
    if FEATURES:
        if has_alibi != 0:
            slope = tl.load(alibi_ptr + heads, mask=h_mask, other=0.0) * LOG2E
        if (has_sinks != 0) & (num_splits == 1):  # with splits the merge counts the sink
            m_i = tl.load(sinks_ptr + heads, mask=h_mask, other=0.0).to(tl.float32) * LOG2E
            l_i = tl.zeros([BLOCK_H], dtype=tl.float32) + 1.0
    acc = tl.zeros([BLOCK_H, HEAD_PAD], dtype=tl.float32)

    # runs 1: span >= hi - lo, the whole range (here, after the query's load: sm90's 32-row tile spills otherwise)
    span = tl.cdiv(tl.cdiv(hi - lo, runs), BLOCK_N) * BLOCK_N
    lo = lo + run * span
    hi = tl.minimum(lo + span, hi)
    kv_head = hslot // tl.cdiv(group, BLOCK_H)
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    # UNMASKED (the 64-row tile on NVIDIA, without features): the tiles below the first row's position are seen
    # whole by every row, so they go without masks. H200, bf16 d128, graph replay (decode_knobs_h200.md, run G):
    # 64 x 8k x q16 658 -> 641 us; the 16- and 32-row tiles lost 1-2 % (registers spilled), so they keep one loop.
    full_hi = lo
    if UNMASKED:
        full_hi = tl.maximum(tl.minimum(((first_pos + 1) // BLOCK_N) * BLOCK_N, hi), lo)
    acc, m_i, l_i = attn_tiles(
        acc, m_i, l_i, q, lo, lo, full_hi, hi, q_pos, slope, k_head, v_head, bt_row, stride_kb, stride_kt, stride_vb,
        stride_vt, qk_scale, softcap, window, causal, bs_shift, d, d_mask, BLOCK_N, PAD_D, False, FEATURES, FP8_KV,
        INTERP, SAME_KV, BT_AHEAD,
    )
    if FP8_KV:
        acc = acc * tl.load(v_scale_ptr)
    return acc, m_i, l_i


@triton.jit
def _workspace(part_ptr, seq, num_seqs, stream, qmax, num_heads, num_splits, HEAD_PAD: tl.constexpr):
    """The split workspace (paged_attention._launch sizes it): partial outputs [rows, HEAD_PAD], then (max, sum)
    [rows, 2], then how many partials each (sequence, token row, head) has and the slot of its first [2, num_seqs *
    qmax * num_heads] (0 partials: the decode kernel wrote the output), where rows = (num_seqs, or 1 for the
    stream-K launch, whose sequences share one set of slots) x qmax x num_heads x num_splits.
    Returns (the (max, sum) pointer, the count pointer, the first-slot pointer, the sequence's slot set)."""
    pseq = seq
    pseqs = num_seqs
    if stream != 0:
        pseq = seq * 0
        pseqs = num_seqs * 0 + 1
    rows_total = pseqs.to(tl.int64) * qmax * num_heads * num_splits
    ml_ptr = part_ptr + rows_total * HEAD_PAD
    count_ptr = ml_ptr + rows_total * 2
    return ml_ptr, count_ptr, count_ptr + num_seqs.to(tl.int64) * qmax * num_heads, pseq


@triton.jit
def _finish(out_ptr, sinks_ptr, part_ptr, lock_ptr, acc, m_i, l_i, has_sinks, group, num_splits, fused, qmax,
            tblocks, head_size, stride_ot, stride_oh, seq, num_seqs, hslot, tb, q_start, q_len, split, parts, first,
            is_first, t, h_mask, heads, tok, d, d_mask,
            BLOCK_H: tl.constexpr, HEAD_PAD: tl.constexpr, STREAMED: tl.constexpr):
    """The output (``num_splits`` 1, or the sequence's only partial: ``parts`` 1), or partial slot ``split`` (one of
    ``parts``, from slot ``first``) of the sequence's workspace rows and the merge if this is the last of them to
    end. ``STREAMED``: the stream-K launch, whose sequences share one set of rows."""
    chunks = tl.cdiv(group, BLOCK_H)
    num_heads = tl.num_programs(1) // chunks * group
    part_ml_ptr, meta_ptr, first_ptr, pseq = _workspace(part_ptr, seq, num_seqs, STREAMED, qmax, num_heads,
                                                        num_splits, HEAD_PAD)
    prow = seq.to(tl.int64) * qmax + t
    direct = num_splits == 1
    if STREAMED:
        # A sequence that one stream-K program covers whole (short ones; equal lengths of up to a program's share)
        # gets its output written here, not a partial to write, read back and merge. H200, bf16 32/8 heads d128,
        # graph replay with max_seq_len 32k (benchmarks/results/decode_ahead_h200.md, run C), us: 132 x 256 keys
        # 77.5 -> 59.9 (one-column launch 53.3), 128 x 1k 167 -> 150 (143), 100 x 512 90 -> 85 (76); uneven and
        # long batches unchanged. Not in the one-column launch: its 32-row short tile then spills (sm90: 48 bytes
        # of stack).
        direct = parts == 1
    if direct:
        if num_splits > 1:  # the merge counts the sink when there are splits, so here this program does
            if has_sinks != 0:
                acc, l_i = _with_sinks(acc, m_i, l_i, sinks_ptr, heads, h_mask)
            tl.store(meta_ptr + prow * num_heads + heads, (heads * 0).to(tl.float32), mask=h_mask)
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=h_mask[:, None] & d_mask[None, :],
        )
    else:
        prow_part = pseq.to(tl.int64) * qmax + t
        row = (prow_part * num_heads + heads) * num_splits + split
        tl.store(part_ptr + row[:, None] * HEAD_PAD + d[None, :], acc, mask=h_mask[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=h_mask)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=h_mask)
        if is_first:
            tl.store(meta_ptr + prow * num_heads + heads, (heads * 0 + parts).to(tl.float32), mask=h_mask)
            if STREAMED:  # a column's first partial is at slot 0
                tl.store(first_ptr + prow * num_heads + heads, (heads * 0 + first).to(tl.float32), mask=h_mask)
        if fused != 0:
            # The last program of this (sequence, KV head, chunk) to finish merges every split: one
            # launch instead of two (host launch time dominates small batches). The counter is put
            # back to 0 by that program, so the buffer is clean for the next launch.
            tl.debug_barrier()  # every thread's partial stores precede the release below
            lock = lock_ptr + seq * (tl.num_programs(1) * tblocks) + hslot * tblocks + tb
            ticket = tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu")
            if ticket == parts - 1:
                tl.debug_barrier()
                hc = tl.minimum(group, BLOCK_H)
                per = BLOCK_H // hc
                t0 = tb * per
                h0 = (hslot % chunks) * BLOCK_H
                heads_here = tl.minimum(hc, group - h0)
                for i in range(0, tl.minimum(per, q_len - t0) * heads_here):
                    ti = t0 + i // heads_here
                    head = (hslot // chunks) * group + h0 + i % heads_here
                    merge_splits(out_ptr, sinks_ptr, part_ptr, part_ml_ptr, q_start + ti,
                                 ((pseq.to(tl.int64) * qmax + ti) * num_heads + head) * num_splits + first, head,
                                 parts, has_sinks, head_size, stride_ot, stride_oh, HEAD_PAD, 4096)
                tl.atomic_xchg(lock, 0, sem="relaxed", scope="gpu")


@triton.jit
def _with_sinks(acc, m_run, l_run, sinks_ptr, heads, h_mask):
    """Rows' (acc, sum) with each row's sink logit folded into its softmax (running max ``m_run``, log2 domain)."""
    sink = tl.load(sinks_ptr + heads, mask=h_mask, other=0.0).to(tl.float32) * LOG2E
    m_new = tl.maximum(m_run, sink)
    alpha = tl.exp2(m_run - m_new)
    return acc * alpha[:, None], l_run * alpha + tl.exp2(sink - m_new)


@triton.jit
def merge_splits(out_ptr, sinks_ptr, part_ptr, part_ml_ptr, out_row, base, head, count, has_sinks, head_size,
                 stride_ot, stride_oh, HEAD_PAD: tl.constexpr, CHUNK_ELEMS: tl.constexpr):
    """Merge the ``count`` partials of ``head`` at workspace rows ``base``... into ``out`` row ``out_row``
    (online, a chunk of splits at a time)."""
    # splits per load: at most CHUNK_ELEMS fp32 values (reduce_kernel: 64 registers a thread at 4 warps)
    CHUNK: tl.constexpr = max(2, min(64, CHUNK_ELEMS // HEAD_PAD))
    c = tl.arange(0, CHUNK)
    d = tl.arange(0, HEAD_PAD)
    d_mask = d < head_size
    m_run = tl.max(tl.zeros([CHUNK], dtype=tl.float32) + NEG_BIG, 0)
    l_run = tl.sum(tl.zeros([CHUNK], dtype=tl.float32), 0)
    acc = tl.zeros([HEAD_PAD], dtype=tl.float32)
    for c0 in range(0, count, CHUNK):
        cs = c0 + c
        c_mask = cs < count
        # .cg: partials written by other programs of this launch, never from this SM's L1
        mc = tl.load(part_ml_ptr + (base + cs) * 2, mask=c_mask, other=NEG_BIG, cache_modifier=".cg")
        lc = tl.load(part_ml_ptr + (base + cs) * 2 + 1, mask=c_mask, other=0.0, cache_modifier=".cg")
        parts = tl.load(part_ptr + (base + cs)[:, None] * HEAD_PAD + d[None, :], mask=c_mask[:, None], other=0.0,
                        cache_modifier=".cg")
        m_new = tl.maximum(m_run, tl.max(mc, 0))
        alpha = tl.exp2(m_run - m_new)
        w = tl.exp2(mc - m_new)
        l_run = l_run * alpha + tl.sum(lc * w, 0)
        acc = acc * alpha + tl.sum(parts * w[:, None], 0)
        m_run = m_new
    if has_sinks != 0:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E
        m_new = tl.maximum(m_run, sink)
        alpha = tl.exp2(m_run - m_new)
        l_run = l_run * alpha + tl.exp2(sink - m_new)
        acc = acc * alpha
    l_run = tl.where(l_run == 0.0, 1.0, l_run)
    tl.store(
        out_ptr + out_row.to(tl.int64) * stride_ot + head * stride_oh + d,
        (acc / l_run).to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


@triton.jit(do_not_specialize=["num_splits", "has_sinks", "stream"])
def reduce_kernel(
    out_ptr,
    qsl_ptr,
    sinks_ptr,
    part_ptr,
    num_splits,
    has_sinks,
    stream,
    head_size,
    stride_ot,
    stride_oh,
    HEAD_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    t = tl.program_id(2)  # grid: (sequences, heads, qmax)
    qmax = tl.num_programs(2)  # the longest query the decode kernel took
    num_heads = tl.num_programs(1)
    part_ml_ptr, meta_ptr, first_ptr, pseq = _workspace(part_ptr, seq, tl.num_programs(0), stream, qmax, num_heads,
                                                        num_splits, HEAD_PAD)
    prow = seq.to(tl.int64) * qmax + t
    # The query's bounds, the row's partial count and its first slot in one round trip to memory, not three in
    # a row: this kernel is a chain of dependent loads (a row's meta entries exist whatever its query length;
    # rows the decode kernel did not take return below, before their values are used).
    q_start = tl.load(qsl_ptr + seq)
    q_end = tl.load(qsl_ptr + seq + 1)
    count = tl.load(meta_ptr + prow * num_heads + head)
    first_at = tl.load(first_ptr + prow * num_heads + head)  # written by the stream-K launch only
    q_len = q_end - q_start
    if (q_len < 1) | (q_len > qmax) | (t >= q_len):
        return
    count = count.to(tl.int32)
    if count == 0:
        return  # the decode kernel wrote this row's output (its only partial)
    first = count * 0
    if stream != 0:
        first = first_at.to(tl.int32)
    # 8k values a load: a batch-1 decode's 40-64 splits merge in one step (its latency is the reduce's time)
    merge_splits(out_ptr, sinks_ptr, part_ptr, part_ml_ptr, q_start + t,
                 ((pseq.to(tl.int64) * qmax + t) * num_heads + head) * num_splits + first, head, count, has_sinks,
                 head_size, stride_ot, stride_oh, HEAD_PAD, 8192)


@triton.jit(do_not_specialize=["group", "num_splits", "has_sinks", "stream", "qmax"])
def reduce_rows_kernel(
    out_ptr,
    qsl_ptr,
    sinks_ptr,
    part_ptr,
    group,
    num_splits,
    has_sinks,
    stream,
    qmax,
    head_size,
    stride_ot,
    stride_oh,
    BLOCK_H: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    """The split merge as a second launch (CUDA graphs), for batches whose rows have few partials each: one
    program a decode program's rows (grid: sequences, head slots, token blocks, as the decode grid's), so the
    ``BLOCK_H`` (token, head) rows that share a KV head merge together, ``CH`` partials an iteration.
    :func:`reduce_kernel` takes a row a program and up to 64 partials a load: the one for many partials a row.
    H200, bf16 32/8 heads d128, graph replay (benchmarks/results/decode_ahead_h200.md, run D), us, this against
    reduce_kernel: 64 x 8k 523 -> 516, 64 x 8k x q4 562 -> 524, q2 537 -> 520, 8 x 8k x q16 109 -> 91.6, 132 x 256
    keys 60.2 -> 58.0; but 1 x 8k (66 partials a row) 26.4 -> 40.9, 4 x 32k 146 -> 150, 8 x 8k 86.2 -> 87.4
    (attention_config.merge_rows draws the line).
    """
    seq = tl.program_id(0)
    hslot = tl.program_id(1)
    tb = tl.program_id(2)
    hc = tl.minimum(group, BLOCK_H)  # heads of the group in one program
    per = BLOCK_H // hc  # query tokens in one program
    # the program's rows as if the query had qmax tokens: their meta entries exist whatever its length, so they
    # are loaded beside the query's bounds (one round trip to memory instead of three in a row, as in
    # reduce_kernel) and the rows past its length are masked out afterwards
    t, rows_ok, heads, _, d, d_mask, _ = _rows(0, qmax, qmax, hslot, tb, group, head_size, BLOCK_H, HEAD_PAD, True)
    num_heads = tl.num_programs(1) // tl.cdiv(group, BLOCK_H) * group
    part_ml_ptr, meta_ptr, first_ptr, pseq = _workspace(part_ptr, seq, tl.num_programs(0), stream, qmax, num_heads,
                                                        num_splits, HEAD_PAD)
    prow = (seq.to(tl.int64) * qmax + t) * num_heads + heads
    q_start = tl.load(qsl_ptr + seq)
    q_end = tl.load(qsl_ptr + seq + 1)
    counts = tl.load(meta_ptr + prow, mask=rows_ok, other=0.0)
    firsts = tl.load(first_ptr + prow, mask=rows_ok, other=0.0)  # written by the stream-K launch only
    q_len = q_end - q_start
    if (q_len < 1) | (q_len > qmax) | (tb * per >= q_len):
        return  # a query the decode kernel did not take, or a token block past it
    h_mask = rows_ok & (t < q_len)
    tok = (q_start + t).to(tl.int64)
    # the rows of one decode program have the same partials (count 0: it wrote the output itself)
    count = tl.max(tl.where(h_mask, counts, 0.0), 0).to(tl.int32)
    if count == 0:
        return
    base = ((pseq.to(tl.int64) * qmax + t) * num_heads + heads) * num_splits  # each row's first partial
    if stream != 0:
        base += tl.max(tl.where(h_mask, firsts, 0.0), 0).to(tl.int64)
    # CH partials an iteration, loaded before any is merged (at most 64 fp32 values a thread at 8 warps); one
    # [CH, rows, HEAD_PAD] load instead took sm90 253 registers and 64 KiB of shared memory at 16 x 128
    CH: tl.constexpr = max(1, min(8, 16384 // (BLOCK_H * HEAD_PAD)))
    m_run = tl.zeros([BLOCK_H], dtype=tl.float32) + NEG_BIG
    l_run = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_PAD], dtype=tl.float32)
    for c0 in range(0, count, CH):
        for k in tl.static_range(CH):
            ok = h_mask & (t * 0 + c0 + k < count)  # a vector compare: the interpreter refuses a scalar one here
            idx = base + c0 + k
            mc = tl.load(part_ml_ptr + idx * 2, mask=ok, other=NEG_BIG)
            lc = tl.load(part_ml_ptr + idx * 2 + 1, mask=ok, other=0.0)
            pc = tl.load(part_ptr + idx[:, None] * HEAD_PAD + d[None, :], mask=ok[:, None], other=0.0)
            m_new = tl.maximum(m_run, mc)
            alpha = tl.exp2(m_run - m_new)
            w = tl.exp2(mc - m_new)
            l_run = l_run * alpha + lc * w
            acc = acc * alpha[:, None] + pc * w[:, None]
            m_run = m_new
    if has_sinks != 0:
        acc, l_run = _with_sinks(acc, m_run, l_run, sinks_ptr, heads, h_mask)
    l_run = tl.where(l_run == 0.0, 1.0, l_run)
    tl.store(
        out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
        (acc / l_run[:, None]).to(out_ptr.dtype.element_ty),
        mask=h_mask[:, None] & d_mask[None, :],
    )


# ints Triton specialises as multiples of 16 at run time (every supported head size is one);
# the ahead-of-time check marks them the same way
decode_kernel.divisible_by_16 = ("head_size",)
reduce_kernel.divisible_by_16 = ("head_size",)
reduce_rows_kernel.divisible_by_16 = ("head_size",)

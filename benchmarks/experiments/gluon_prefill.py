"""Experiment, not used by kvcached: a warp-specialised causal paged prefill for Hopper in Gluon (Triton 3.6 only).

Measurements (removed from the tree; name@commit: ``git show commit:benchmarks/results/name``):
gluon_prefill_steps_h200.md@3208548 and the gluon_prefill_h200*.md runs of that commit. Why it exists: the
portable prefill (``kvcached.kernels.attention_prefill``) leaves what plain Triton 3.6 cannot express on Hopper:
the tensor cores idle through each softmax (Triton waits for every wgmma right after issuing it), and a
program's set-up overlaps nothing. This kernel tries FlashAttention-3's structure with Gluon:

* a loader partition (one warpgroup, few registers) gathers the paged K/V tiles (``cp.async``, or TMA bulk
  copies of whole pages with ``use_tma``) and each work item's query rows (``cp.async``) into a ring of
  shared-memory stages, signalling mbarriers, and hands the compute side what it needs of each item through
  shared memory (so the compute side never looks items up);
* two compute partitions, one warpgroup each, take the two row halves of every item; being separate partitions,
  no barrier ties them together, so one's softmax can run beside the other's tensor-core products;
* one program an SM walks the work items (query slot x head slot, rows = (token, head of the group) pairs, long
  causal slots first) exactly as the portable kernel enumerates them, so the loader fetches the next item's query
  and first tiles while the last ones compute.

It is correct (float64 reference and the portable kernel, per-layer and contiguous layouts) and, on an H200,
slower than the portable kernel (0.83-0.99x; 64 prompts of 128 tie or lose), so it is not wired into the
dispatcher. Measured limits: the compute partitions alone (copies skipped) reach 506-517 TFLOP/s on one 8k
prompt against the portable kernel's ~450. With the copies, the ``cp.async`` loader's per-row address arithmetic
competes with them for issue slots (halving it: 1390 -> 1279 us); ``use_tma`` moves whole pages with bulk copies
from one thread instead (1235-1249 us, 0.98-0.99x the portable kernel). ``overlap`` issues tile j's QK product
before tile j - 1's PV product (FlashAttention-3's order), but ptxas still places the wait for the PV product
before the softmax (1262 -> 1247 us). Next steps: an explicit ping-pong of the two warpgroups, and fewer K/V
bytes a query token (a 128-row item reads each K/V tile once per 32 tokens). Gluon's API moves between releases
(Triton 3.9 renamed ``thread_barrier`` and removed ``async_copy_global_to_shared``), so a kernel like this one
pins its Triton.

Scope: causal, no window, softcap, ALiBi or sinks; query and KV cache of one 16-bit dtype; head size 128 (64
compiles, not run).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

_LOG2E = gl.constexpr(1.4426950408889634)
_NEG = gl.constexpr(-1.0e30)  # finite: a fully masked row of a tile must not make exp2(-inf - -inf)

FIRST = gl.constexpr(0)
SECOND = gl.constexpr(1)
_NO_SPECIALISE = ["group", "bs_shift", "short_max", "num_seqs", "head_slots", "num_slots"]


@gluon.jit
def _item(item, qsl_ptr, seq_lens_ptr, num_slots, num_seqs, head_slots, group, short_max,
          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Work item ``item`` (query slot x head slot, long causal slots first): its sequence, rows and key tiles.
    ``n_tiles`` is 0 for an item with no rows (slots past a sequence's query, short queries)."""
    slot = num_slots - 1 - item // head_slots
    hslot = item % head_slots
    chunks = gl.cdiv(group, BLOCK_M)
    hc = gl.minimum(group, BLOCK_M)
    per = BLOCK_M // hc
    kv_head = hslot // chunks
    h0 = (hslot % chunks) * BLOCK_M
    seq = 0
    above = num_seqs
    while above - seq > 1:
        mid = (seq + above) // 2
        if gl.load(qsl_ptr + mid) // per + mid <= slot:
            seq = mid
        else:
            above = mid
    q_start = gl.load(qsl_ptr + seq)
    q_len = gl.load(qsl_ptr + seq + 1) - q_start
    t0 = (slot - q_start // per - seq) * per
    seq_len = gl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len
    hi = ctx + gl.minimum(t0 + per, q_len)  # keys some row sees: [0, hi)
    n_tiles = gl.cdiv(hi, BLOCK_N)
    if (t0 < 0) | (t0 >= q_len) | (q_len <= short_max):
        n_tiles = 0
    return seq, q_start, q_len, t0, ctx, seq_len, kv_head, h0, hc, per, n_tiles


@gluon.jit
def _pick(v, i: gl.constexpr):
    """Element ``i`` of a small int vector every thread holds whole."""
    idx = gl.arange(0, v.shape[0], layout=v.type.layout)
    return gl.sum(gl.where(idx == i, v, 0), axis=0)


@gluon.jit
def _tma_tile(desc, stage, ready, blocks, j, kv_head, bs_mask, HEAD: gl.constexpr, BLOCK_N: gl.constexpr,
              PAGE_ROWS: gl.constexpr):
    """Key tile ``j`` of one KV head into ``stage`` ([BLOCK_N, HEAD], 128-byte swizzle), a bulk copy per page and
    64 channels: that layout keeps each 64-channel half of the tile whole, so a (page, half) box is one contiguous
    2 KiB piece of the stage (for 16-key pages)."""
    PAGES: gl.constexpr = BLOCK_N // PAGE_ROWS
    HALVES: gl.constexpr = HEAD // 64
    chunk_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
    chunks = stage._reinterpret(stage.dtype, [HALVES * PAGES, 1, PAGE_ROWS, 64], chunk_l)
    mbarrier.expect(ready, BLOCK_N * HEAD * 2)
    for pg in gl.static_range(PAGES):
        page_block = _pick(blocks, pg)
        row = (j * BLOCK_N + pg * PAGE_ROWS) & bs_mask
        for hf in gl.static_range(HALVES):
            tma.async_copy_global_to_shared(desc, [page_block, row, kv_head * HEAD + 64 * hf], ready,
                                            chunks.index(hf * PAGES + pg))


@gluon.jit
def _load_partition(q_ptr, k_ptr, v_ptr, block_table_ptr, seq_lens_ptr, qsl_ptr, q_smem, k_smem, v_smem, info_smem,
                    q_ready, q_free, k_ready, v_ready, kv_free, num_items, num_slots, num_seqs, head_slots, group,
                    short_max, bs_shift, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                    stride_vh, stride_bt, kv_gap, k_desc, v_desc, num_blocks, HEAD: gl.constexpr,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, KV_DELTA: gl.constexpr,
                    PAGE_ROWS: gl.constexpr):
    # 16-byte copies: HEAD // 8 threads across a row, the warp's other threads and the warps down the rows
    tpr: gl.constexpr = HEAD // 8
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [32 // tpr, tpr], [gl.num_warps(), 1], [1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(1, blk)
    info_l: gl.constexpr = gl.BlockedLayout([8], [32], [gl.num_warps()], [0])
    d = gl.arange(0, HEAD, layout=gl.SliceLayout(0, blk))
    rq = gl.arange(0, BLOCK_M, layout=rows_l)
    rk = gl.arange(0, BLOCK_N, layout=rows_l)
    i8 = gl.arange(0, 8, layout=info_l)
    bs_mask = (1 << bs_shift) - 1
    it = 0  # key tiles loaded so far (ring position)
    n = 0  # items with rows so far (query buffer position)
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        seq, q_start, q_len, t0, ctx, seq_len, kv_head, h0, hc, per, n_tiles = _item(
            item, qsl_ptr, seq_lens_ptr, num_slots, num_seqs, head_slots, group, short_max, BLOCK_M, BLOCK_N)
        if n_tiles > 0:
            bt_row = block_table_ptr + seq.to(gl.int64) * stride_bt
            qb = n % 2
            mbarrier.wait(q_free.index(qb), ((n // 2) & 1) ^ 1)
            # what the compute partition needs of the item, so that it never looks items up itself
            info = gl.where(i8 == 0, q_start, gl.where(i8 == 1, q_len, gl.where(i8 == 2, t0, gl.where(
                i8 == 3, ctx, gl.where(i8 == 4, kv_head * group + h0, gl.where(i8 == 5, n_tiles, 0))))))
            info_smem.index(qb).store(info)
            t = t0 + rq // hc
            h = h0 + rq % hc
            ok = (rq < per * hc) & (h < group) & (t < q_len)
            q_rows = (q_start + t).to(gl.int64) * stride_qt + (kv_head * group + h) * stride_qh
            async_copy.async_copy_global_to_shared(q_smem.index(qb), q_ptr + q_rows[:, None] + d[None, :],
                                                   mask=ok[:, None])
            async_copy.mbarrier_arrive(q_ready.index(qb), increment_count=False)
            mbarrier.arrive(q_ready.index(qb), count=1)  # after the info store (release)
            n += 1
            if k_desc is not None:
                # bulk copies of whole pages (PAGE_ROWS keys x 64 channels each): one thread issues them, the
                # hardware computes the addresses; a page past the sequence reads block num_blocks, out of the
                # descriptor's bounds, which the copy fills with zeros
                PAGES: gl.constexpr = BLOCK_N // PAGE_ROWS
                pg_l: gl.constexpr = gl.BlockedLayout([PAGES], [32], [gl.num_warps()], [0])
                pidx = gl.arange(0, PAGES, layout=pg_l)
                for j in range(n_tiles):
                    keys0 = j * BLOCK_N + pidx * PAGE_ROWS
                    blocks = gl.load(bt_row + (keys0 >> bs_shift), mask=keys0 < seq_len, other=num_blocks)
                    s = it % STAGES
                    mbarrier.wait(kv_free.index(s), ((it // STAGES) & 1) ^ 1)
                    _tma_tile(k_desc, k_smem.index(s), k_ready.index(s), blocks, j, kv_head, bs_mask, HEAD, BLOCK_N,
                              PAGE_ROWS)
                    _tma_tile(v_desc, v_smem.index(s), v_ready.index(s), blocks, j, kv_head, bs_mask, HEAD, BLOCK_N,
                              PAGE_ROWS)
                    it += 1
            else:
                live = rk < seq_len
                block = gl.load(bt_row + (rk >> bs_shift), mask=live, other=0)  # the first tile's, early
                k_head = k_ptr + kv_head * stride_kh
                if KV_DELTA:  # V at a fixed distance from K: half the address arithmetic (1 x 8k 1390 -> 1279 us)
                    v_head = k_head + kv_gap
                else:
                    v_head = v_ptr + kv_head * stride_vh
                for j in range(n_tiles):
                    # the next tile's block ids before this tile's wait: their latency off the copy path
                    key_next = (j + 1) * BLOCK_N + rk
                    live_next = key_next < seq_len
                    block_next = gl.load(bt_row + (key_next >> bs_shift), mask=live_next, other=0)
                    s = it % STAGES
                    mbarrier.wait(kv_free.index(s), ((it // STAGES) & 1) ^ 1)
                    within = (j * BLOCK_N + rk) & bs_mask
                    b64 = block.to(gl.int64)
                    k_rows = b64 * stride_kb + within * stride_kt
                    if KV_DELTA:
                        v_rows = k_rows
                    else:
                        v_rows = b64 * stride_vb + within * stride_vt
                    async_copy.async_copy_global_to_shared(k_smem.index(s), k_head + k_rows[:, None] + d[None, :],
                                                           mask=live[:, None])
                    async_copy.mbarrier_arrive(k_ready.index(s), increment_count=False)
                    async_copy.async_copy_global_to_shared(v_smem.index(s), v_head + v_rows[:, None] + d[None, :],
                                                           mask=live[:, None])
                    async_copy.mbarrier_arrive(v_ready.index(s), increment_count=False)
                    block = block_next
                    live = live_next
                    it += 1
    # no more items: an empty one ends the compute partition's loop
    qb = n % 2
    mbarrier.wait(q_free.index(qb), ((n // 2) & 1) ^ 1)
    info_smem.index(qb).store(gl.zeros([8], gl.int32, info_l))
    async_copy.mbarrier_arrive(q_ready.index(qb), increment_count=False)
    mbarrier.arrive(q_ready.index(qb), count=1)


@gluon.jit
def _softmax_tile(s, m_i, l_i, key0, q_pos, full_hi, qk_scale, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """One key tile's online softmax in the log2 domain: (probabilities, new max, new sum, rescale factor)."""
    s = s * qk_scale
    if key0 + BLOCK_N > full_hi:  # the diagonal: some row of the item sees only part of the tile
        key = key0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = gl.where(key[None, :] <= q_pos[:, None], s, _NEG)
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_i, alpha


@gluon.jit
def _compute_partition(out_ptr, q_smem, k_smem, v_smem, info_smem, q_ready, q_free, k_ready, v_ready, kv_free,
                       sm_scale, group, stride_ot, stride_oh, HALF: gl.constexpr, HEAD: gl.constexpr,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                       OVERLAP: gl.constexpr, RELEASE_BARRIER: gl.constexpr):
    """One warpgroup: rows ``HALF * BLOCK_M // 2`` on of every item. The two warpgroups are separate partitions,
    so no barrier ties them together and one's softmax runs beside the other's tensor-core products."""
    nw: gl.constexpr = gl.num_warps()
    ROWS: gl.constexpr = BLOCK_M // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[nw, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[nw, 1],
                                                       instr_shape=[16, HEAD, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
    orow_l: gl.constexpr = gl.SliceLayout(1, o_layout)
    info_l: gl.constexpr = gl.BlockedLayout([8], [32], [nw], [0])
    dtype: gl.constexpr = q_smem.dtype
    qk_scale = sm_scale * _LOG2E
    hc = gl.minimum(group, BLOCK_M)
    per = BLOCK_M // hc
    rq = HALF * ROWS + gl.arange(0, ROWS, layout=row_l)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    it = 0
    n = 0
    more = True
    while more:
        qb = n % 2
        mbarrier.wait(q_ready.index(qb), (n // 2) & 1)
        info = info_smem.index(qb).load(info_l)
        n_tiles = _pick(info, 5)
        more = n_tiles > 0
        if more:
            q_start = _pick(info, 0)
            q_len = _pick(info, 1)
            t0 = _pick(info, 2)
            ctx = _pick(info, 3)
            head0 = _pick(info, 4)
            fence_async_shared()
            # the query in registers (the QK product then reads only K from shared memory), its buffer free
            # for the loader's next item at once
            q = q_smem.index(qb).slice(HALF * ROWS, ROWS).load(
                gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
            gl.thread_barrier()
            mbarrier.arrive(q_free.index(qb), count=1)
            q_pos = ctx + t0 + rq // hc
            full_hi = ctx + t0 + 1  # keys below this every row of the item sees
            m_i = gl.full([ROWS], _NEG, gl.float32, row_l)
            l_i = gl.zeros([ROWS], gl.float32, row_l)
            acc = gl.zeros([ROWS, HEAD], gl.float32, o_layout)
            if OVERLAP:
                # FlashAttention-3's order: the QK product of tile j is issued before the PV product of tile j - 1,
                # and tile j's softmax runs while that PV product does
                s = it % STAGES
                mbarrier.wait(k_ready.index(s), (it // STAGES) & 1)
                fence_async_shared()
                sc = warpgroup_mma(q, k_smem.index(s).permute((1, 0)), s_zero, use_acc=False)
                p, m_i, l_i, alpha = _softmax_tile(sc, m_i, l_i, 0, q_pos, full_hi, qk_scale, BLOCK_N, s_layout)
                for j in range(1, n_tiles):
                    sp = s
                    s = (it + j) % STAGES
                    mbarrier.wait(k_ready.index(s), ((it + j) // STAGES) & 1)
                    fence_async_shared()
                    sc_tok = warpgroup_mma(q, k_smem.index(s).permute((1, 0)), s_zero, use_acc=False,
                                           is_async=True)
                    # tile j - 2's stage, whose PV product was waited for last iteration: released an iteration
                    # late so that nothing follows that wait (ptxas still puts it before the softmax: SASS in
                    # gluon_prefill_steps_h200.md@3208548). No barrier first: a warpgroup's wgmma is one operation,
                    # and CUTLASS releases its stages the same way.
                    if j >= 2:
                        mbarrier.arrive(kv_free.index((it + j - 2) % STAGES), count=1)
                    acc = acc * gl.convert_layout(alpha, orow_l)[:, None]
                    pv = gl.convert_layout(p.to(dtype), p_layout)
                    mbarrier.wait(v_ready.index(sp), ((it + j - 1) // STAGES) & 1)
                    acc_tok = warpgroup_mma(pv, v_smem.index(sp), acc, is_async=True)
                    sc = warpgroup_mma_wait(1, deps=(sc_tok, ))
                    p, m_i, l_i, alpha = _softmax_tile(sc, m_i, l_i, j * BLOCK_N, q_pos, full_hi, qk_scale,
                                                       BLOCK_N, s_layout)
                    # pv as a dep keeps the running product's operand registers from being reused by the softmax
                    acc, pv = warpgroup_mma_wait(0, deps=(acc_tok, pv))
                if n_tiles >= 2:
                    mbarrier.arrive(kv_free.index((it + n_tiles - 2) % STAGES), count=1)
                acc = acc * gl.convert_layout(alpha, orow_l)[:, None]
                pv = gl.convert_layout(p.to(dtype), p_layout)
                mbarrier.wait(v_ready.index(s), ((it + n_tiles - 1) // STAGES) & 1)
                acc = warpgroup_mma(pv, v_smem.index(s), acc)
                mbarrier.arrive(kv_free.index(s), count=1)
            else:
                for j in range(n_tiles):
                    s = (it + j) % STAGES
                    mbarrier.wait(k_ready.index(s), ((it + j) // STAGES) & 1)
                    fence_async_shared()  # cp.async wrote through the generic proxy; wgmma reads through the async one
                    sc = warpgroup_mma(q, k_smem.index(s).permute((1, 0)), s_zero, use_acc=False)
                    p, m_i, l_i, alpha = _softmax_tile(sc, m_i, l_i, j * BLOCK_N, q_pos, full_hi, qk_scale, BLOCK_N,
                                                       s_layout)
                    acc = acc * gl.convert_layout(alpha, orow_l)[:, None]
                    pv = gl.convert_layout(p.to(dtype), p_layout)
                    mbarrier.wait(v_ready.index(s), ((it + j) // STAGES) & 1)
                    acc = warpgroup_mma(pv, v_smem.index(s), acc)
                    if RELEASE_BARRIER:
                        gl.thread_barrier()  # the whole warpgroup is done with the stage
                    mbarrier.arrive(kv_free.index(s), count=1)
            it += n_tiles

            l_i = gl.convert_layout(gl.where(l_i == 0.0, 1.0, l_i), orow_l)
            o = (acc / l_i[:, None]).to(dtype)
            r = HALF * ROWS + gl.arange(0, ROWS, layout=orow_l)
            t = t0 + r // hc
            h = r % hc
            ok = (r < per * hc) & (head0 + h < (head0 // group + 1) * group) & (t < q_len)
            rows = (q_start + t).to(gl.int64) * stride_ot + (head0 + h) * stride_oh
            d = gl.arange(0, HEAD, layout=gl.SliceLayout(0, o_layout))
            gl.store(out_ptr + rows[:, None] + d[None, :], o, mask=ok[:, None])
        n += 1


@gluon.jit(do_not_specialize=_NO_SPECIALISE)
def prefill_hopper_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    block_table_ptr,
    seq_lens_ptr,
    qsl_ptr,
    sm_scale,
    group,
    bs_shift,
    short_max,
    num_seqs,
    head_slots,
    num_slots,
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
    kv_gap,
    k_desc,
    v_desc,
    num_blocks,
    HEAD: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    LOAD_WARPS: gl.constexpr,
    LOAD_REGS: gl.constexpr,
    COMPUTE_REGS: gl.constexpr,
    KV_DELTA: gl.constexpr,
    OVERLAP: gl.constexpr,
    RELEASE_BARRIER: gl.constexpr,
    PAGE_ROWS: gl.constexpr,
):
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD], kv_layout)
    bar_l: gl.constexpr = mbarrier.MBarrierLayout()
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    q_free = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_l)
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_l)
    kv_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_l)
    info_smem = gl.allocate_shared_memory(gl.int32, [2, 8], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    for i in gl.static_range(2):
        # every loader thread arrives once its copies land (cp.async noinc), and one more time after the item's info
        mbarrier.init(q_ready.index(i), count=LOAD_WARPS * 32 + 1)
        mbarrier.init(q_free.index(i), count=2)  # one arrival a compute warpgroup
    # cp.async: every loader thread arrives once its copies land; TMA: one arrival with the bytes to expect
    ready_count: gl.constexpr = 1 if k_desc is not None else LOAD_WARPS * 32
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=ready_count)
        mbarrier.init(v_ready.index(i), count=ready_count)
        mbarrier.init(kv_free.index(i), count=2)
    num_items = num_slots * head_slots
    gl.warp_specialize(
        [
            (_compute_partition, (out_ptr, q_smem, k_smem, v_smem, info_smem, q_ready, q_free, k_ready, v_ready,
                                  kv_free, sm_scale, group, stride_ot, stride_oh, FIRST, HEAD, BLOCK_M, BLOCK_N,
                                  STAGES, OVERLAP, RELEASE_BARRIER)),
            (_compute_partition, (out_ptr, q_smem, k_smem, v_smem, info_smem, q_ready, q_free, k_ready, v_ready,
                                  kv_free, sm_scale, group, stride_ot, stride_oh, SECOND, HEAD, BLOCK_M, BLOCK_N,
                                  STAGES, OVERLAP, RELEASE_BARRIER)),
            (_load_partition, (q_ptr, k_ptr, v_ptr, block_table_ptr, seq_lens_ptr, qsl_ptr, q_smem, k_smem, v_smem,
                               info_smem, q_ready, q_free, k_ready, v_ready, kv_free, num_items, num_slots, num_seqs,
                               head_slots, group, short_max, bs_shift, stride_qt, stride_qh, stride_kb, stride_kt,
                               stride_kh, stride_vb, stride_vt, stride_vh, stride_bt, kv_gap, k_desc, v_desc,
                               num_blocks, HEAD, BLOCK_M, BLOCK_N, STAGES, KV_DELTA, PAGE_ROWS)),
        ],
        [4, LOAD_WARPS],
        [COMPUTE_REGS, LOAD_REGS],
    )


def launch_prefill_hopper(query, k_cache, v_cache, out, block_table, seq_lens, query_start_loc, scale: float,
                          short_max: int, units: int, *, block_m: int = 128, block_n: int = 64, stages: int = 3,
                          load_warps: int = 4, load_regs: int = 80, compute_regs: int = 208, overlap: bool = False,
                          release_barrier: bool = True, use_tma: bool = False) -> None:
    """One persistent launch over every query longer than ``short_max`` (the decode kernel takes the rest).

    ``overlap``: FlashAttention-3's in-warpgroup order; ``release_barrier``: a warpgroup barrier before each stage's
    release (the plain order); ``stages``: K/V stages of ``block_n`` keys; the register split between the loader
    and the compute warpgroups in ``load_regs`` / ``compute_regs``."""
    num_tokens, num_heads, head = query.shape
    # what the kernel is built for; anything else would hang on a barrier count or compute garbage
    if block_m != 128 or load_warps != 4:
        raise ValueError(f"block_m must be 128 (a warpgroup's 64 rows a compute partition) and load_warps 4 (one "
                         f"mbarrier arrival a 128-thread partition), got {block_m} and {load_warps}.")
    if head not in (64, 128) or query.dtype not in (torch.bfloat16, torch.float16) or k_cache.dtype != query.dtype:
        raise ValueError(f"head size 64 or 128 and one 16-bit dtype for query and cache, got head {head}, "
                         f"{query.dtype} query, {k_cache.dtype} cache: use kvcached.paged_attention.")
    num_seqs = block_table.shape[0]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    per = block_m // min(group, block_m)
    head_slots = num_kv_heads * -(-group // block_m)
    num_slots = num_tokens // per + num_seqs
    bs_shift = k_cache.shape[1].bit_length() - 1
    grid = (min(units, num_slots * head_slots),)
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    page_rows = min(block_size, block_n)
    descs = [None, None]  # no descriptors: the cp.async loader
    if use_tma:
        # [blocks, block slots, heads x channels]: needs each token's heads side by side (stride(2) == head size)
        if k_cache.stride(2) != head or v_cache.stride(2) != head:
            raise ValueError("use_tma needs each token's heads side by side in the cache (stride(2) == head size).")
        chunk = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
        descs = [TensorDescriptor(c, [num_blocks, block_size, c.shape[2] * head], [c.stride(0), c.stride(1), 1],
                                  [1, page_rows, 64], chunk) for c in (k_cache, v_cache)]
    gap = v_cache.data_ptr() - k_cache.data_ptr()
    kv_delta = k_cache.stride() == v_cache.stride() and gap % (16 * k_cache.element_size()) == 0
    gap //= k_cache.element_size()
    prefill_hopper_kernel[grid](
        query, k_cache, v_cache, out, block_table, seq_lens, query_start_loc, scale, group, bs_shift, short_max,
        num_seqs, head_slots, num_slots, query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        block_table.stride(0), gap, descs[0], descs[1], num_blocks, HEAD=head, BLOCK_M=block_m, BLOCK_N=block_n,
        STAGES=stages, LOAD_WARPS=load_warps, LOAD_REGS=load_regs, COMPUTE_REGS=compute_regs, KV_DELTA=kv_delta,
        OVERLAP=overlap, RELEASE_BARRIER=release_barrier, PAGE_ROWS=page_rows, num_warps=4,
    )

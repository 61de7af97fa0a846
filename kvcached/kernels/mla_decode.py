"""MLA decode over a paged latent cache of any layout (``kvcached::paged_mla_decode``).

DeepSeek-style multi-head latent attention: one latent KV head of ``D`` channels
(576 = ``kv_lora_rank`` 512 + 64 rope) shared by every query head. Keys are the
whole latent, values its first ``kv_lora_rank`` channels. Because all heads share
the one KV head, a program packs ``BLOCK_H`` query heads into the M dimension of
``tl.dot`` and reads each KV tile once for all of them.

When ``num_seqs x head groups`` programs would underfill the GPU, each sequence's
context is split into ``num_splits`` chunks (flash-decoding); partial outputs and
their log-sum-exp are combined by a second kernel. No host synchronisation: the
split count comes from shapes (and the optional ``max_seq_len``), never from
``seq_lens``' values.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import triton
import triton.language as tl

from kvcached.kernels import checks
from kvcached.kernels.platform import (
    FP8_DTYPES,
    CompileVariant,
    cdiv,
    direct_launch_ok,
    interpreting,
    is_hip,
    next_pow2,
    override_knobs,
)
from kvcached.kernels.write_kv import unit_scale

_LOG2E = 1.4426950408889634
REDUCE_CH = 8  # splits the merge kernel loads at once (a [8, 512] fp32 tile: 32 registers a thread at 4 warps)
_TL_NAME = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8e4nv",
            torch.float8_e4m3fnuz: "fp8e4b8", torch.float8_e5m2: "fp8e5"}


@triton.jit
def _mla_decode_kernel(
    q_ptr, kv_ptr, bt_ptr, seq_lens_ptr, out_ptr, part_ptr, lse_ptr, kv_scale_ptr,
    qk_scale, num_heads, block_size, num_splits,
    s_qs, s_qh, s_qd,
    s_cb, s_ct, s_cd,
    s_bts, s_btb,
    s_os, s_oh, s_od,
    KV_LORA: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_DPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, KV_FP8: tl.constexpr, DOT_FP32: tl.constexpr,
):
    seq = tl.program_id(0)
    hg = tl.program_id(1)
    split = tl.program_id(2)
    heads = hg * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < num_heads
    dv = tl.arange(0, BLOCK_DV)
    dpe = tl.arange(0, BLOCK_DPE)
    dv_ok = dv < KV_LORA
    dpe_ok = dpe < ROPE

    seq_len = tl.load(seq_lens_ptr + seq)
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    q_row = q_ptr + seq.to(tl.int64) * s_qs + heads[:, None].to(tl.int64) * s_qh
    q_nope = tl.load(q_row + dv[None, :] * s_qd, mask=h_ok[:, None] & dv_ok[None, :], other=0.0)
    q_pe = tl.load(q_row + (KV_LORA + dpe[None, :]) * s_qd, mask=h_ok[:, None] & dpe_ok[None, :], other=0.0)
    if DOT_FP32:  # the interpreter's bf16 tl.dot is wrong (FACTS.md); GPU code never takes this branch
        q_nope = q_nope.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    if KV_FP8:
        kv_scale = tl.load(kv_scale_ptr)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * s_bts
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        p_ok = pos < end
        blk = tl.load(bt_row + (pos // block_size) * s_btb, mask=p_ok, other=0).to(tl.int64)
        tok = blk * s_cb + (pos % block_size).to(tl.int64) * s_ct
        kv = tl.load(kv_ptr + tok[:, None] + dv[None, :] * s_cd, mask=p_ok[:, None] & dv_ok[None, :], other=0.0)
        kpe = tl.load(kv_ptr + tok[:, None] + (KV_LORA + dpe[None, :]) * s_cd,
                      mask=p_ok[:, None] & dpe_ok[None, :], other=0.0)
        if KV_FP8:
            kv = (kv.to(tl.float32) * kv_scale).to(q_ptr.dtype.element_ty)
            kpe = (kpe.to(tl.float32) * kv_scale).to(q_ptr.dtype.element_ty)
        if DOT_FP32:
            kv = kv.to(tl.float32)
            kpe = kpe.to(tl.float32)
        s = tl.dot(q_nope, tl.trans(kv)) + tl.dot(q_pe, tl.trans(kpe))
        s = tl.where(p_ok[None, :], s * qk_scale, float("-inf"))
        # every iteration has at least one valid position, so m_new is finite
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv)
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    res = acc / l_safe[:, None]
    if SPLIT:
        # partials [num_seqs, num_heads, num_splits, BLOCK_DV] fp32, lse [num_seqs, num_heads, num_splits] (log2)
        row = (seq.to(tl.int64) * num_heads + heads) * num_splits + split
        tl.store(part_ptr + row[:, None] * BLOCK_DV + dv[None, :], res, mask=h_ok[:, None] & dv_ok[None, :])
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + row, lse, mask=h_ok)
    else:
        o = out_ptr + seq.to(tl.int64) * s_os + heads[:, None].to(tl.int64) * s_oh + dv[None, :] * s_od
        tl.store(o, res.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & dv_ok[None, :])


@triton.jit
def _mla_reduce_kernel(
    part_ptr, lse_ptr, out_ptr, num_heads, num_splits,
    s_os, s_oh, s_od,
    KV_LORA: tl.constexpr, BLOCK_DV: tl.constexpr, CH: tl.constexpr,
):
    # CH splits a load: one split a step with a branch on its lse put every split's loads in series (a
    # memory latency each: 64 splits at batch 1). H200, graph replay (benchmarks/results/mla_reduce_h200.md):
    # batch 1 x 8k 29.7 -> 27.1 us at 16 heads, 44.4 -> 41.7 at 128; few splits a sequence unchanged.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    dv = tl.arange(0, BLOCK_DV)
    ks = tl.arange(0, CH)
    row0 = (seq.to(tl.int64) * num_heads + head) * num_splits
    m = tl.full([], float("-inf"), tl.float32)
    denom = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for k0 in range(0, num_splits, CH):
        k_ok = k0 + ks < num_splits
        # empty splits (short sequences) have lse -inf: weight 0
        lse = tl.load(lse_ptr + row0 + k0 + ks, mask=k_ok, other=float("-inf"))
        part = tl.load(part_ptr + (row0 + k0 + ks)[:, None] * BLOCK_DV + dv[None, :],
                       mask=k_ok[:, None] & (lse > float("-inf"))[:, None], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, 0))
        ref = tl.where(m_new > float("-inf"), m_new, 0.0)  # all empty so far: keep exp2 away from -inf - -inf
        alpha = tl.exp2(m - ref)
        w = tl.exp2(lse - ref)
        acc = acc * alpha + tl.sum(w[:, None] * part, 0)
        denom = denom * alpha + tl.sum(w, 0)
        m = m_new
    res = acc / tl.where(denom > 0, denom, 1.0)
    o = out_ptr + seq.to(tl.int64) * s_os + head.to(tl.int64) * s_oh + dv * s_od
    tl.store(o, res.to(out_ptr.dtype.element_ty), mask=dv < KV_LORA)


@functools.lru_cache(maxsize=16)
def _num_units(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# Tuning knobs, set only through override() (for sweeps on a GPU): BLOCK_H, BLOCK_N, num_warps,
# num_stages, waves_per_eu, programs_per_unit, min_tokens_per_split, max_splits.
_OVERRIDES: dict[str, int] = {}


def override(**knobs: int) -> contextlib.AbstractContextManager[None]:
    """Temporarily replace launch heuristics, e.g. ``with override(BLOCK_N=64, programs_per_unit=8): ...``."""
    known = ("BLOCK_H", "BLOCK_N", "num_warps", "num_stages", "waves_per_eu", "programs_per_unit",
             "min_tokens_per_split", "max_splits")
    return override_knobs(_OVERRIDES, known, "MLA", knobs)


def launch_config(num_heads: int, hip: bool) -> dict[str, int]:
    """Heads per program, KV tile, warps and stages (per vendor: HIP has 64 KiB of LDS on gfx942)."""
    block_h = 16 if num_heads <= 16 else 32
    # CUDA: 4 warps spill part of the [16, 512] fp32 accumulator on sm90, yet measured 1.3-1.6x faster than
    # 8 on the H200 (benchmarks/experiments/_tune_mla.py, 2026-11-30: b32 h16 8k 216 -> 153 us; b128 h16 4k 403 ->
    # 282 us).
    cfg = {"BLOCK_H": block_h, "BLOCK_N": 16 if hip else 32, "num_warps": 8 if hip and block_h > 16 else 4,
           "num_stages": 2}
    if hip:
        cfg["waves_per_eu"] = 1
    for key in ("BLOCK_H", "BLOCK_N", "num_warps", "num_stages", "waves_per_eu"):
        if key in _OVERRIDES:
            cfg[key] = _OVERRIDES[key]
    return cfg


def choose_num_splits(num_seqs: int, num_heads: int, max_seq_len: int, device: torch.device,
                      block_h: int) -> int:
    """Enough (seq, head group, split) programs to give every compute unit several, each split >= 128 tokens.

    On the H200 (first measurement) one MLA program fills an SM's registers (sm90: 162 regs x 8 warps),
    so the grid, not occupancy, must hide memory latency.
    """
    if device.type != "cuda":
        units = 2  # interpreter: small, but still exercises the split path
    else:
        units = _num_units(device.index if device.index is not None else torch.cuda.current_device())
    programs = num_seqs * cdiv(num_heads, block_h)
    want = cdiv(_OVERRIDES.get("programs_per_unit", 4) * units, max(programs, 1))
    by_len = cdiv(max(max_seq_len, 1), _OVERRIDES.get("min_tokens_per_split", 128))
    return max(1, min(want, by_len, _OVERRIDES.get("max_splits", 128)))


def _launch(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    kv_scale: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    num_splits: int,
) -> None:
    num_seqs, num_heads, head_size = query.shape
    if num_seqs == 0 or num_heads == 0:
        return
    hip = is_hip()
    cfg = launch_config(num_heads, hip)
    rope = head_size - kv_lora_rank
    block_dv = next_pow2(kv_lora_rank)
    split = num_splits > 1
    if split:
        part = torch.empty(num_seqs, num_heads, num_splits, block_dv, dtype=torch.float32, device=query.device)
        lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    else:
        part = lse = out  # unused
    opts = {k: cfg[k] for k in ("num_warps", "num_stages", "waves_per_eu") if k in cfg}
    grid = (num_seqs, cdiv(num_heads, cfg["BLOCK_H"]), num_splits)
    _mla_decode_kernel[grid](
        query, kv_cache, block_table, seq_lens, out, part, lse, kv_scale,
        scale * _LOG2E, num_heads, kv_cache.shape[1], num_splits,
        *query.stride(), *kv_cache.stride(), *block_table.stride(), *out.stride(),
        KV_LORA=kv_lora_rank, ROPE=rope, BLOCK_DV=block_dv, BLOCK_DPE=next_pow2(max(rope, 1)),
        BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], SPLIT=split, KV_FP8=kv_cache.dtype in FP8_DTYPES,
        DOT_FP32=interpreting(), **opts,
    )
    if split:
        _mla_reduce_kernel[(num_seqs, num_heads)](
            part, lse, out, num_heads, num_splits, *out.stride(),
            KV_LORA=kv_lora_rank, BLOCK_DV=block_dv, CH=REDUCE_CH, num_warps=4,
        )


@torch.library.custom_op("kvcached::paged_mla_decode", mutates_args=("out",))
def _paged_mla_decode_op(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    kv_scale: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    num_splits: int,
) -> None:
    _launch(query, kv_cache, block_table, seq_lens, out, kv_scale, scale, kv_lora_rank, num_splits)


@_paged_mla_decode_op.register_fake
def _(query, kv_cache, block_table, seq_lens, out, kv_scale, scale, kv_lora_rank, num_splits) -> None:
    return None


def _validate(query, kv_cache, block_table, seq_lens, kv_lora_rank, out) -> None:
    for name, t in (("query", query), ("kv_cache", kv_cache), ("block_table", block_table), ("seq_lens", seq_lens)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
    if query.dim() != 3:
        raise ValueError(f"query must be [num_seqs, num_heads, head_size], got {tuple(query.shape)}.")
    if kv_cache.dim() != 3:
        raise ValueError(
            f"kv_cache must be the latent cache [num_blocks, block_size, head_size], got {tuple(kv_cache.shape)} "
            "(build it with kvcached.layout.mla_view)."
        )
    head_size = query.shape[2]
    if kv_cache.shape[2] != head_size:
        raise ValueError(f"query head size {head_size} differs from the cache's {kv_cache.shape[2]}.")
    if not isinstance(kv_lora_rank, int) or isinstance(kv_lora_rank, bool) or not 0 < kv_lora_rank <= head_size:
        raise ValueError(f"kv_lora_rank must be an int in (0, {head_size}], got {kv_lora_rank!r}.")
    if query.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"query must be fp16 or bf16, got {query.dtype}.")
    if kv_cache.dtype not in FP8_DTYPES and kv_cache.dtype != query.dtype:
        raise ValueError(f"kv_cache is {kv_cache.dtype} but query is {query.dtype}; they must match (or fp8 cache).")
    if block_table.dim() != 2 or block_table.shape[0] != query.shape[0]:
        raise ValueError(
            f"block_table must be [num_seqs={query.shape[0]}, max_blocks_per_seq], got {tuple(block_table.shape)}."
        )
    if seq_lens.dim() != 1 or seq_lens.shape[0] != query.shape[0]:
        raise ValueError(f"seq_lens must be [num_seqs={query.shape[0]}], got {tuple(seq_lens.shape)}.")
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 (or int64), got {t.dtype}.")
    if out is not None:
        want = (query.shape[0], query.shape[1], kv_lora_rank)
        if tuple(out.shape) != want or out.dtype != query.dtype:
            raise ValueError(f"out must be {want} {query.dtype}, got {tuple(out.shape)} {out.dtype}.")
    devices = {t.device for t in (query, kv_cache, block_table, seq_lens)}
    if out is not None:
        devices.add(out.device)
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}.")


def paged_mla_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    kv_lora_rank: int = 512,
    max_seq_len: int | None = None,
    kv_scale: torch.Tensor | float | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step of MLA over a paged latent cache; returns ``[num_seqs, num_heads, kv_lora_rank]``.

    ``query`` ``[num_seqs, num_heads, D]`` (first ``kv_lora_rank`` channels absorbed
    "nope" part, then rope); ``kv_cache`` ``[num_blocks, block_size, D]`` with any
    strides; ``block_table`` int32 ``[num_seqs, max_blocks_per_seq]``; ``seq_lens``
    int32 ``[num_seqs]`` (a zero-length sequence gives zeros). ``max_seq_len`` (a host
    int, optional) bounds the context for the split heuristic; ``num_splits`` forces the
    split count. fp8 caches are dequantised with the per-tensor ``kv_scale``.
    """
    _validate(query, kv_cache, block_table, seq_lens, kv_lora_rank, out)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float, got {scale!r}.")
    table_tokens = block_table.shape[1] * kv_cache.shape[1]
    if max_seq_len is None:
        max_seq_len = table_tokens
    elif isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or not 0 <= max_seq_len <= table_tokens:
        raise ValueError(f"max_seq_len must be an int in [0, {table_tokens}] (block_table columns x block size) or "
                         f"None, got {max_seq_len!r}.")
    if out is None:
        out = torch.empty(query.shape[0], query.shape[1], kv_lora_rank, dtype=query.dtype, device=query.device)
    fp8 = kv_cache.dtype in FP8_DTYPES
    if fp8:
        ks = checks.scale_tensor("", "kv_scale", kv_scale, query.device)
    else:
        checks.refuse_scales(kv_cache.dtype, kv_scale=kv_scale)
        ks = unit_scale(query.device)
    if checks.enabled(query):
        checks.check_mla_decode(kv_cache, block_table, seq_lens, max_seq_len, ks if fp8 else None)
    if num_splits is None:
        block_h = launch_config(query.shape[1], is_hip())["BLOCK_H"]
        num_splits = choose_num_splits(query.shape[0], query.shape[1], max_seq_len, query.device, block_h)
    elif not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}.")
    if direct_launch_ok(query):
        _launch(query, kv_cache, block_table, seq_lens, out, ks, float(scale), kv_lora_rank, num_splits)
    else:
        torch.ops.kvcached.paged_mla_decode(query, kv_cache, block_table, seq_lens, out, ks, float(scale),
                                            kv_lora_rank, num_splits)
    return out


def compile_variants(target: str) -> list[CompileVariant]:
    """Every specialisation the dispatcher can pick on ``target`` (``sm90``, ``gfx942``...)."""
    from kvcached.kernels.write_kv import _target_fp8  # one rule for both modules

    hip = target.startswith("gfx")
    fp8 = _target_fp8(target)
    variants = []
    for num_heads in (16, 128):
        cfg = launch_config(num_heads, hip)
        opts = {k: cfg[k] for k in ("num_warps", "num_stages", "waves_per_eu") if k in cfg}
        pairs = [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)]
        pairs += [(torch.bfloat16, f) for f in fp8]
        for q_dt, kv_dt in pairs:
            for split in (False, True):
                sig = {"q_ptr": f"*{_TL_NAME[q_dt]}", "kv_ptr": f"*{_TL_NAME[kv_dt]}", "bt_ptr": "*i32",
                       "seq_lens_ptr": "*i32", "out_ptr": f"*{_TL_NAME[q_dt]}", "part_ptr": "*fp32",
                       "lse_ptr": "*fp32", "kv_scale_ptr": "*fp32", "qk_scale": "fp32"}
                for name in ("num_heads", "block_size", "num_splits"):
                    sig[name] = "i32"
                for name in ("s_qs", "s_qh", "s_cb", "s_ct", "s_bts", "s_os", "s_oh"):
                    sig[name] = "i64"
                const = {"s_qd": 1, "s_cd": 1, "s_btb": 1, "s_od": 1, "KV_LORA": 512, "ROPE": 64, "BLOCK_DV": 512,
                         "BLOCK_DPE": 64, "BLOCK_H": cfg["BLOCK_H"], "BLOCK_N": cfg["BLOCK_N"], "SPLIT": split,
                         "KV_FP8": kv_dt in FP8_DTYPES, "DOT_FP32": False}
                sig.update({k: "constexpr" for k in const})
                name = f"mla_decode[{_TL_NAME[kv_dt]},bh{cfg['BLOCK_H']},{'split' if split else 'direct'}]"
                if any(v.name == name for v in variants):
                    continue
                variants.append(CompileVariant(name, _mla_decode_kernel, sig, const, opts))
    for q_dt in (torch.bfloat16, torch.float16):
        sig = {"part_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": f"*{_TL_NAME[q_dt]}", "num_heads": "i32",
               "num_splits": "i32", "s_os": "i64", "s_oh": "i64", "s_od": "constexpr", "KV_LORA": "constexpr",
               "BLOCK_DV": "constexpr", "CH": "constexpr"}
        const = {"s_od": 1, "KV_LORA": 512, "BLOCK_DV": 512, "CH": REDUCE_CH}
        variants.append(CompileVariant(f"mla_reduce[{_TL_NAME[q_dt]}]", _mla_reduce_kernel, sig, const,
                                       {"num_warps": 4}))
    return variants

"""Paged attention over KV caches with any strides: public entry point and custom op.

``paged_attention`` validates its inputs (metadata only: it never reads a device
tensor on the host) and launches the split-KV decode kernel (plus, under graph
capture, its reduce) for single tokens and causal queries of up to ``SHORT_MAX``
(16) tokens and, when ``max_query_len`` is longer, the prefill kernel for the
longer ones. Both kernels read each sequence's query length
on the device, so one call serves any mixed batch. Under torch.compile (or a
dispatch mode) the launch goes through the ``kvcached::paged_attention`` custom op;
plain eager calls skip its dispatcher, whose host cost exceeds a small decode.
"""

# No ``from __future__ import annotations``: torch.library reads the op's annotations.

import contextlib
import functools
import math

import torch

from kvcached.kernels import attention_config as cfg
from kvcached.kernels import checks
from kvcached.kernels.attention_decode import decode_kernel, reduce_kernel, reduce_rows_kernel
from kvcached.kernels.attention_prefill import prefill_kernel
from kvcached.kernels.platform import (
    FP8_DTYPES,
    CompileVariant,
    cdiv,
    direct_launch_ok,
    interpreting,
    is_hip,
    next_pow2,
)
from kvcached.kernels.write_kv import _target_fp8 as _write_kv_target_fp8

HEAD_SIZES = (32, 64, 80, 96, 128, 256)
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
QUERY_DTYPES = (torch.float16, torch.bfloat16)

Scale = torch.Tensor | float | None


BLOCK_H = 16  # query rows (heads) per decode program (a larger group takes several programs per KV head)
SHORT_ROWS = (32, 64)  # query rows (tokens x heads) per program of a short query: the smallest that holds it
SHORT_MAX = 16  # causal queries up to this many tokens go through the decode kernel's rows


@functools.lru_cache(maxsize=16)
def device_target(device: torch.device) -> str:
    """The compile target name of ``device``: ``sm90``, ``gfx942``...; ``cpu`` for the interpreter."""
    if device.type != "cuda":
        return "cpu"
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    if is_hip():
        return str(getattr(props, "gcnArchName", "gfx")).split(":")[0]
    return f"sm{props.major}{props.minor}"


def _fp8_kv_dtypes(device: torch.device) -> tuple:
    if device.type == "cpu":  # the interpreter handles both
        return (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
    return tuple(target_fp8(device_target(device)))


def target_fp8(target: str) -> list:
    """The fp8 KV dtype of ``target``, one rule with write_kv and mla_decode (none on sm80 and gfx90a)."""
    return _write_kv_target_fp8(target)


def _fail(msg: str) -> None:
    raise ValueError(f"paged_attention: {msg}")


def _check_vector(name: str, t: torch.Tensor | None, length: int, device: torch.device) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a tensor or None, got {type(t).__name__}.")
    if t.dtype != torch.float32 or t.dim() != 1 or t.shape[0] != length or t.stride(0) != 1:
        _fail(f"{name} must be a contiguous float32 [{length}] tensor (one per query head), got "
              f"{t.dtype} {tuple(t.shape)}; pass {name}.float().contiguous().")
    if t.device != device:
        _fail(f"{name} is on {t.device}, the query on {device}; move it to the query's device.")


_DUMMIES: dict = {}


def _as_scale(name: str, value: Scale, device: torch.device, needed: bool) -> torch.Tensor | None:
    """The fp8 scale tensor (1.0 when None), or None for a cache that needs none (a value given is
    checked first, then refused by the caller as write_kv_cache and paged_mla_decode refuse it)."""
    if value is None and not needed:
        return None
    t = checks.scale_tensor("paged_attention: ", name, value, device, default=1.0)
    return t if needed else None


def _dummy(device: torch.device) -> torch.Tensor:
    """A float32 stand-in for pointer arguments a specialisation never reads."""
    t = _DUMMIES.get(device)
    if t is None:
        t = _DUMMIES[device] = torch.zeros(1, dtype=torch.float32, device=device)
    return t


_LOCKS: dict = {}
_LOCKS_KEPT: list = []


def _stream_id(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return raw(index) if raw is not None else torch.cuda.current_stream(device).cuda_stream


_SIDE: dict = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream a mixed batch's prefill launch runs on beside its decodes, one per (device, stream)."""
    key = (device, _stream_id(device))
    s = _SIDE.get(key)
    if s is None:
        s = _SIDE[key] = torch.cuda.Stream(device)
    return s


def _lock_buffer(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters for the fused split merge, one set per (device, stream).

    Each launch leaves them at zero again. Per stream, so that calls on concurrent
    streams never share a counter. Buffers are never freed: a captured CUDA graph keeps
    using the address it was captured with.
    """
    key = (device, _stream_id(device))
    t = _LOCKS.get(key)
    if t is None or t.numel() < n:
        t = torch.zeros(max(n, 4096, 2 * (0 if t is None else t.numel())), dtype=torch.int32, device=device)
        _LOCKS_KEPT.append(t)
        _LOCKS[key] = t
    return t


def _validate(query, k_cache, v_cache, block_table, seq_lens, query_start_loc, max_query_len, max_seq_len,
              scale, causal, sliding_window, softcap, alibi_slopes, sinks, out, min_query_len=None) -> None:
    # Runs on every call, ahead of a ~10 us kernel: each shape/stride/device is read once.
    for name, t in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache), ("block_table", block_table),
                    ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if not isinstance(t, torch.Tensor):
            _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
    dev = query.device
    q_shape = query.shape
    if len(q_shape) != 3:
        _fail(f"query must be [num_tokens, num_heads, head_size], got shape {tuple(q_shape)}.")
    if query.dtype not in QUERY_DTYPES:
        _fail(f"query dtype {query.dtype} is not supported; use float16 or bfloat16.")
    num_tokens, num_heads, head_size = q_shape
    if head_size not in HEAD_SIZES:
        _fail(f"head size {head_size} is not supported; supported: {HEAD_SIZES}.")
    k_shape = k_cache.shape
    for name, c, shape in (("k_cache", k_cache, k_shape), ("v_cache", v_cache, v_cache.shape)):
        if len(shape) != 4:
            _fail(f"{name} must be [num_blocks, block_size, num_kv_heads, head_size], got {tuple(shape)}.")
        if c.device != dev:
            _fail(f"{name} is on {c.device}, the query on {dev}; all tensors must share one device.")
        if c.stride(3) != 1:
            _fail(f"{name}'s head_size dimension must have stride 1 (got {c.stride(3)}); other strides are free.")
    if k_shape != v_cache.shape:
        _fail(f"k_cache {tuple(k_shape)} and v_cache {tuple(v_cache.shape)} differ in shape.")
    kv_dtype = k_cache.dtype
    if kv_dtype != v_cache.dtype:
        _fail(f"k_cache ({kv_dtype}) and v_cache ({v_cache.dtype}) differ in dtype.")
    _, block_size, num_kv_heads, kv_head_size = k_shape
    if kv_head_size != head_size:
        _fail(f"cache head size {kv_head_size} differs from the query's {head_size}.")
    if block_size not in BLOCK_SIZES:
        _fail(f"block size {block_size} is not supported; supported: {BLOCK_SIZES}.")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        _fail(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}.")
    if kv_dtype != query.dtype and kv_dtype not in _fp8_kv_dtypes(dev):
        allowed = _fp8_kv_dtypes(dev)
        if kv_dtype in FP8_DTYPES and not allowed:
            _fail(f"KV cache dtype {kv_dtype}: this GPU ({device_target(dev)}) has no fp8 support in these kernels "
                  f"(fp8 KV needs sm89+ or gfx942/gfx950); use a {query.dtype} cache.")
        names = ", ".join(str(d) for d in allowed) or "none on this GPU"
        _fail(f"KV cache dtype {kv_dtype} must equal the query's ({query.dtype}) or be this GPU's fp8 "
              f"({names}).")
    if query.stride(2) != 1:
        _fail("query's head_size dimension must have stride 1; call .contiguous() on it.")
    bt_shape = block_table.shape
    if block_table.dtype != torch.int32 or len(bt_shape) != 2 or block_table.stride(1) != 1:
        _fail(f"block_table must be a 2-D int32 tensor with unit column stride, got {block_table.dtype} "
              f"{tuple(bt_shape)}.")
    num_seqs = bt_shape[0]
    if num_seqs > 65535:  # no grid axis needs it now; kept: no test covers more
        _fail(f"{num_seqs} sequences in one call; at most 65535 are supported, split the batch.")
    sl_shape = seq_lens.shape
    if seq_lens.dtype != torch.int32 or len(sl_shape) != 1 or sl_shape[0] != num_seqs:
        _fail(f"seq_lens must be int32 [num_seqs={num_seqs}], got {seq_lens.dtype} {tuple(sl_shape)}.")
    qsl_shape = query_start_loc.shape
    if query_start_loc.dtype != torch.int32 or len(qsl_shape) != 1 or qsl_shape[0] != num_seqs + 1:
        _fail(f"query_start_loc must be int32 [num_seqs + 1 = {num_seqs + 1}], got {query_start_loc.dtype} "
              f"{tuple(qsl_shape)}.")
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if t.device != dev:
            _fail(f"{name} is on {t.device}, the query on {dev}; all tensors must share one device.")
    if seq_lens.stride(0) != 1 or query_start_loc.stride(0) != 1:
        _fail("seq_lens and query_start_loc must be contiguous.")
    for name, v in (("max_query_len", max_query_len), ("max_seq_len", max_seq_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            _fail(f"{name} must be a positive int (host-side bound used to size the grid), got {v!r}.")
    if max_query_len > max_seq_len:
        _fail(f"max_query_len {max_query_len} exceeds max_seq_len {max_seq_len}; seq_lens include the new tokens.")
    if min_query_len is not None and (isinstance(min_query_len, bool) or not isinstance(min_query_len, int)
                                      or not 1 <= min_query_len <= max_query_len):
        _fail(f"min_query_len must be None or an int in [1, max_query_len = {max_query_len}] (a bound on every "
              f"sequence's query tokens, like max_query_len), got {min_query_len!r}.")
    if bt_shape[1] * block_size < max_seq_len:
        _fail(f"block_table has {bt_shape[1]} columns x block size {block_size} = "
              f"{bt_shape[1] * block_size} tokens, fewer than max_seq_len {max_seq_len}.")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale) or scale <= 0):
        # the kernels fold the scale into the running max (max(s) * scale): it must be positive
        _fail(f"scale must be a positive finite float or None (1/sqrt(head_size)), got {scale!r}.")
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
            _fail(f"sliding_window must be a positive int or None, got {sliding_window!r}.")
        if not causal:
            _fail("sliding_window needs causal=True (a query at position p sees keys in (p - window, p]).")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not math.isfinite(softcap) or softcap <= 0):
        _fail(f"softcap must be a positive finite float or None, got {softcap!r}.")
    _check_vector("alibi_slopes", alibi_slopes, num_heads, dev)
    _check_vector("sinks", sinks, num_heads, dev)
    if out is not None:
        if not isinstance(out, torch.Tensor):
            _fail(f"out must be a tensor or None, got {type(out).__name__}.")
        if out.shape != q_shape or out.dtype != query.dtype or out.device != dev:
            _fail(f"out must match the query ({query.dtype} {tuple(q_shape)} on {dev}), got "
                  f"{out.dtype} {tuple(out.shape)} on {out.device}.")
        if out.stride(2) != 1:
            _fail("out's head_size dimension must have stride 1.")


def select(q_dtype: torch.dtype, kv_dtype: torch.dtype, head_size: int, block_size: int, group: int, *,
           causal: bool, window: int, softcap: float, alibi: bool, sinks: bool, max_query_len: int, num_splits: int,
           fused: bool, hip: bool, big_smem: bool, interp: bool, stream: bool = False,
           merge_rows: bool = False, short_keys: bool = False, same_kv: bool = True) -> tuple:
    """The dispatcher: the kernels (with constexprs and options) one call launches, in order.

    Everything the dispatcher sees goes in; a tuple of ``CompileVariant`` comes out (decode,
    then the split reduce when ``num_splits > 1`` and not ``fused``, then prefill when
    ``max_query_len > 1``); ``stream``: the decode kernel's stream-K launch (its own compile); ``merge_rows``:
    the split reduce a decode program's rows at a time (``reduce_rows_kernel``), not a row at a time;
    ``short_keys``: no sequence has more keys than ``attention_config.ONE_RUN_KEYS`` (the prefill's tile choice);
    ``same_kv``: the V cache's block and token strides equal the K cache's (one address computation serves both).
    Block size, group size, split count, feature values and the head
    size within its power-of-two tile are run-time kernel arguments: only the dtypes, the
    tile (32, 64, 128, masked 128 for 80/96, 256), "any feature" and ``same_kv`` pick a compile.
    ``compile_variants`` lists exactly what this can return for a target.
    """
    # cached per inputs and override knobs: one dict lookup per call (host time matters at batch 1)
    return _select(q_dtype, kv_dtype, head_size, block_size, group, causal, window, softcap, alibi, sinks,
                   max_query_len, num_splits, fused, hip, big_smem, interp, stream, merge_rows, short_keys,
                   same_kv, cfg.overrides_key())


def short_max(causal: bool) -> int:
    """The longest query the decode kernel takes (non-causal queries of several tokens go to prefill)."""
    return SHORT_MAX if causal else 1


def decode_rows(group: int, max_query_len: int, causal: bool, hip: bool = False, big_smem: bool = False) -> int:
    """The decode kernel's rows: 16 for single tokens; 32 or 64 (tokens x heads) for a batch of short queries
    that 16 cannot hold. A batch with a prefill keeps 16: its short queries, if any, take a program per few
    tokens, and its single-token sequences (the usual mix) keep the decode tile.

    The 32-row tile where it holds the query, except where the 64-row tile loads its block ids a tile ahead
    (``big_smem``, NVIDIA: attention_config.decode_bt_ahead). H200, bf16 32/8 heads d128, q = 8, graph replay,
    us at 32 / 64 rows: before the block ids ahead (benchmarks/results/decode_knobs_h200.md, run E) 64 x 8k 547
    / 656; with them (benchmarks/results/decode_short_rows_h200.md) 64 x 8k 533 / 505, 8 x 8k 134 / 89, 1 x 32k
    82 / 58, 64 x 256-16k 877 / 688.
    """
    rows = max_query_len * min(group, BLOCK_H)
    if max_query_len > short_max(causal) or rows <= BLOCK_H:
        return BLOCK_H
    if big_smem and not hip:
        return cfg.short_rows(SHORT_ROWS[-1])
    return cfg.short_rows(next(r for r in SHORT_ROWS if r >= rows or r == SHORT_ROWS[-1]))


@functools.lru_cache(maxsize=4096)
def _select(q_dtype, kv_dtype, head_size, block_size, group, causal, window, softcap, alibi, sinks, max_query_len,
            num_splits, fused, hip, big_smem, interp, stream, merge_rows, short_keys, same_kv, overrides) -> tuple:
    qt, kt = _TRITON_DTYPE[q_dtype], _TRITON_DTYPE[kv_dtype]
    head_pad = next_pow2(head_size)
    fp8 = kv_dtype != q_dtype
    itemsize = 1 if fp8 else 2
    decode_features = window > 0 or softcap > 0 or alibi or sinks
    features = decode_features or not causal
    feat = "-features" if features else ""
    pad = head_pad != head_size
    tile = f"d{head_pad}{'-masked' if pad else ''}"  # 80 and 96 share the masked 128 tile
    kvs = "" if same_kv else "-kvstrides"  # V's strides differ from K's: each gets its own addresses
    out = []
    dc = cfg.decode_tile(head_pad, itemsize, hip, interp)
    block_h = decode_rows(group, max_query_len, causal, hip, big_smem)
    stream = stream and block_h == BLOCK_H  # the stream-K launch has the 16-row tile only (attention_config)
    const = {"BLOCK_H": block_h, "HEAD_PAD": head_pad, "PAD_D": pad, "BLOCK_N": dc.block_n,
             "FEATURES": decode_features, "FP8_KV": fp8,
             "UNMASKED": block_h == SHORT_ROWS[-1] and not decode_features and not hip, "STREAM": stream,
             "BT_AHEAD": cfg.decode_bt_ahead(block_h, hip, big_smem, interp), "INTERP": interp, "SAME_KV": same_kv}
    short = f"-short{block_h}" if block_h > BLOCK_H else ("-stream" if stream else "")
    warps = cfg.decode_warps(block_h, head_pad, itemsize, hip, interp, hopper=big_smem)
    out.append(CompileVariant(f"attn_decode{short}[{qt}-{kt}-{tile}{'-features' if decode_features else ''}{kvs}]",
                              decode_kernel, _signature(decode_kernel, qt, kt), const,
                              cfg.launch_options(warps, dc.num_stages, dc.waves_per_eu, hip, interp, dc.maxnreg)))
    if num_splits > 1 and not fused and merge_rows:
        out.append(CompileVariant(f"attn_reduce_rows{block_h}[{qt}-d{head_pad}]", reduce_rows_kernel,
                                  _signature(reduce_rows_kernel, qt, kt), {"BLOCK_H": block_h, "HEAD_PAD": head_pad},
                                  {"num_warps": 8, "num_stages": 1}))
    elif num_splits > 1 and not fused:
        out.append(CompileVariant(f"attn_reduce[{qt}-d{head_pad}]", reduce_kernel, _signature(reduce_kernel, qt, kt),
                                  {"HEAD_PAD": head_pad}, {"num_warps": 4, "num_stages": 1}))
    if max_query_len > short_max(causal):
        pc = cfg.prefill_tile(head_pad, itemsize, hip, big_smem, interp, features, short_keys)
        const = {"HEAD_PAD": head_pad, "PAD_D": pad, "BLOCK_M": pc.block_m, "BLOCK_N": pc.block_n,
                 "FEATURES": features, "FP8_KV": fp8, "BT_AHEAD": pc.bt_ahead,
                 "ONE_RUN": pc.one_run, "LOOKUP": pc.lookup, "INTERP": interp, "SAME_KV": same_kv}
        one = "-onerun" if pc.one_run else ""
        out.append(CompileVariant(f"attn_prefill{one}[{qt}-{kt}-{tile}{feat}{kvs}]", prefill_kernel,
                                  _signature(prefill_kernel, qt, kt), const,
                                  cfg.launch_options(pc.num_warps, pc.num_stages, pc.waves_per_eu, hip, interp,
                                                     pc.maxnreg)))
    return tuple(out)



def _launch(query, k_cache, v_cache, block_table, seq_lens, query_start_loc, out, max_query_len, max_seq_len,
            scale, causal, sliding_window, softcap, alibi_slopes, sinks, k_scale, v_scale, min_query_len=1) -> None:
    num_tokens, num_heads, head_size = query.shape
    num_seqs = block_table.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    head_pad = next_pow2(head_size)
    fp8 = k_cache.dtype != query.dtype
    dev = query.device
    dummy = _dummy(dev)
    alibi = alibi_slopes if alibi_slopes is not None else dummy
    sink_t = sinks if sinks is not None else dummy
    ks = k_scale if fp8 else dummy
    vs = v_scale if fp8 else dummy
    interp = interpreting()
    hip = is_hip()
    q_strides = query.stride()[:2]
    ks_, vs_ = k_cache.stride(), v_cache.stride()
    kv_strides = (ks_[0], ks_[1], ks_[2], vs_[0], vs_[1], vs_[2])
    o_strides = out.stride()[:2]
    dev_index = dev.index if dev.type == "cuda" and dev.index is not None else 0
    bs_shift = block_size.bit_length() - 1  # block sizes are powers of two (validated)
    has_alibi = int(alibi_slopes is not None)
    has_sinks = int(sinks is not None)

    # the longest query the decode kernel takes in this call; the prefill kernel takes every longer one (a
    # max_query_len below the real one then leaves rows to nobody, as before, but never writes out of bounds)
    qmax = max(1, min(max_query_len, short_max(causal)))
    big_smem = cfg.large_shared_memory(dev_index)
    block_h = decode_rows(group, max_query_len, causal, hip, big_smem)
    chunks = cdiv(group, block_h)
    tblocks = cdiv(qmax, block_h // min(group, block_h))
    # Token blocks that will have work: all of them in a batch of short queries, one in a batch with a prefill
    # (mostly single tokens beside a few chunks; H200, 4 chunks of 1024 + 60 decodes x 8k, prefill_tiles_h200.md
    # runs 3-4: counting all four blocks left the decodes unsplit, 770 us against 487 for the decodes alone)
    busy = tblocks if max_query_len <= short_max(causal) else 1
    dc = cfg.decode_config(num_seqs, num_kv_heads * chunks * busy, head_pad, block_h, k_cache.element_size(),
                           max_seq_len, dev_index, tblocks == 1)
    num_splits = dc.num_splits
    balance = max(1, dc.balance // busy) if dc.balance else 0
    fused = num_splits > 1 and cfg.fused_reduce(dev)
    merge_rows = False
    if num_splits > 1 and not fused:  # a second launch merges the partials (CUDA graphs): which one
        # partials a row has, about: a stream-K program's share is (sequences + programs) / sequences runs
        partials = (num_seqs + dc.stream) / num_seqs if dc.stream else num_splits
        merge_rows = cfg.merge_rows(partials, min(group, block_h) * min(block_h // min(group, block_h), qmax))
    plan = select(query.dtype, k_cache.dtype, head_size, block_size, group, causal=causal, window=sliding_window,
                  softcap=softcap, alibi=alibi_slopes is not None, sinks=sinks is not None,
                  max_query_len=max_query_len, num_splits=num_splits, fused=fused, hip=hip,
                  big_smem=big_smem, interp=interp, stream=dc.stream > 0,
                  merge_rows=merge_rows, short_keys=max_seq_len <= cfg.ONE_RUN_KEYS,
                  same_kv=kv_strides[:2] == kv_strides[3:5])
    # every query longer than the decode kernel takes (a caller's bound): no decode launch, whose programs would
    # all return at once, and none of its host time
    decodes = min_query_len <= short_max(causal)
    lock = dummy
    if decodes and num_splits > 1:
        # one workspace: outputs [rows, HEAD_PAD], (max, sum) [rows, 2], then the partials each (sequence, token
        # row, head) has and the slot of its first [2, num_seqs * qmax * num_heads]; rows: (num_seqs or, for the
        # stream-K launch, whose sequences share one set, 1) x qmax x num_heads x num_splits
        rows = (1 if dc.stream else num_seqs) * qmax * num_heads * num_splits
        part = torch.empty(rows * (head_pad + 2) + 2 * num_seqs * qmax * num_heads, dtype=torch.float32, device=dev)
        if fused:
            lock = _lock_buffer(dev, num_seqs * num_kv_heads * chunks * tblocks)
    else:
        part = dummy
    tb_inner = cfg.token_blocks_inner(busy == tblocks > 1)
    if dc.stream:
        decode_grid = (dc.stream, num_kv_heads * chunks, 1)
    elif tb_inner:
        decode_grid = (num_seqs * tblocks, num_kv_heads * chunks, num_splits)
    else:
        decode_grid = (num_seqs, num_kv_heads * chunks, tblocks * num_splits)
    side = None
    if decodes and plan[-1].fn is prefill_kernel and dev.type == "cuda" and cfg.concurrent_prefill(hip):
        # the compute-bound prefill beside the bandwidth-bound decodes: launched first, on a stream of its own
        # that forks from this one and joins it again (under graph capture too)
        side = _side_stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        plan = (plan[-1], *plan[:-1])
    for v in plan:
        if v.fn is not prefill_kernel and not decodes:
            continue
        if v.fn is decode_kernel:
            decode_kernel[decode_grid](
                query, k_cache, v_cache, out, block_table, seq_lens, query_start_loc, alibi, sink_t, ks, vs,
                part, lock, scale, softcap, sliding_window, int(causal), has_alibi, has_sinks, group, bs_shift,
                num_splits, balance, dc.waves, dc.run_floor, int(fused), qmax, tblocks, int(tb_inner),
                num_seqs if dc.stream else 0, dc.min_tiles, head_size,
                *q_strides, *kv_strides, *o_strides, block_table.stride(0), **v.constexprs, **v.options,
            )
        elif v.fn is reduce_rows_kernel:
            reduce_rows_kernel[(num_seqs, num_kv_heads * chunks, tblocks)](
                out, query_start_loc, sink_t, part, group, num_splits, has_sinks, int(dc.stream > 0), qmax, head_size,
                *o_strides, **v.constexprs, **v.options,
            )
        elif v.fn is reduce_kernel:
            reduce_kernel[(num_seqs, num_heads, qmax)](
                out, query_start_loc, sink_t, part, num_splits, has_sinks, int(dc.stream > 0), head_size, *o_strides,
                **v.constexprs, **v.options,
            )
        else:
            # rows are (token, head of the group) pairs: ``per`` tokens a program; slots as prefill_kernel says
            block_m = v.constexprs["BLOCK_M"]
            per = block_m // min(group, block_m)
            head_slots = num_kv_heads * cdiv(group, block_m)
            grid = ((num_tokens // per + num_seqs) * head_slots,)
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                prefill_kernel[grid](
                    query, k_cache, v_cache, out, block_table, seq_lens, query_start_loc, alibi, sink_t, ks, vs,
                    scale, softcap, sliding_window, int(causal), has_alibi, has_sinks, group, bs_shift, qmax,
                    num_seqs, head_slots, head_size,
                    *q_strides, *kv_strides, *o_strides, block_table.stride(0), **v.constexprs, **v.options,
                )
    if side is not None:
        torch.cuda.current_stream(dev).wait_stream(side)


@torch.library.custom_op("kvcached::paged_attention", mutates_args=("out",))
def paged_attention_op(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    causal: bool,
    sliding_window: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    min_query_len: int,
) -> None:
    """Validated inputs only (``paged_attention`` checks them). ``sliding_window``/``softcap`` 0 = off."""
    _launch(query, k_cache, v_cache, block_table, seq_lens, query_start_loc, out, max_query_len, max_seq_len,
            scale, causal, sliding_window, softcap, alibi_slopes, sinks, k_scale, v_scale, min_query_len)


@paged_attention_op.register_fake
def _paged_attention_fake(query, k_cache, v_cache, block_table, seq_lens, query_start_loc, out, max_query_len,
                          max_seq_len, scale, causal, sliding_window, softcap, alibi_slopes, sinks, k_scale,
                          v_scale, min_query_len) -> None:
    return None


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    max_query_len: int,
    max_seq_len: int,
    scale: float | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: Scale = None,
    v_scale: Scale = None,
    out: torch.Tensor | None = None,
    min_query_len: int | None = None,
) -> torch.Tensor:
    """Attention of packed query tokens over a paged KV cache; returns ``out`` ``[num_tokens, H, D]``.

    Query token j of sequence i is at position ``seq_lens[i] - q_len_i + j``; causal
    masking is relative to that. ``sliding_window`` W: a query at p sees keys in
    ``(p - W, p]``. ``softcap``: scores become ``softcap * tanh(s / softcap)``.
    ``alibi_slopes`` (fp32 ``[H]``): ``+ slope * (key_pos - query_pos)``. ``sinks``
    (fp32 ``[H]``): one extra logit per head in the softmax denominator. fp8 caches
    are dequantised with the per-tensor ``k_scale``/``v_scale``.

    Caches: ``[num_blocks, block_size, num_kv_heads, head_size]``, any strides but a unit one
    for ``head_size``. Where V's block and token strides are K's (every engine's layout) one
    address computation serves both; a V cache with strides of its own takes another compile.

    ``min_query_len`` (optional, a host-side bound like ``max_query_len``): no sequence has
    fewer query tokens. Above ``SHORT_MAX`` (16) it spares the decode kernel's launch in a
    batch of prefills only. Never pass it to a call captured in a CUDA graph that later
    batches of another make-up replay.

    Streams: on NVIDIA a batch with prefills and decodes runs its prefill launch on a side stream that forks
    from the current stream and joins it before the call returns (also under graph capture), so the call is
    ordered on the current stream like any other op (``attention_config.override(concurrent_prefill=0)``: one
    stream).
    """
    _validate(query, k_cache, v_cache, block_table, seq_lens, query_start_loc, max_query_len, max_seq_len,
              scale, causal, sliding_window, softcap, alibi_slopes, sinks, out, min_query_len)
    min_q = 1 if min_query_len is None else min_query_len
    dev = query.device
    fp8 = k_cache.dtype != query.dtype
    ks = _as_scale("k_scale", k_scale, dev, fp8)
    vs = _as_scale("v_scale", v_scale, dev, fp8)
    if not fp8:
        checks.refuse_scales(k_cache.dtype, k_scale=k_scale, v_scale=v_scale)
    if checks.enabled(query):
        checks.check_paged_attention(query, k_cache, block_table, seq_lens, query_start_loc, max_query_len,
                                     max_seq_len, {"k_scale": ks, "v_scale": vs} if fp8 else {}, min_q)
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    scale = 1.0 / math.sqrt(query.shape[2]) if scale is None else float(scale)
    # The custom op's dispatch (schema defaults, ADInplaceOrView, autograd) costs more host time
    # than a whole batch-1 decode on the GPU; plain eager calls launch directly. Under
    # torch.compile, a dispatch mode (FakeTensor, functionalization...) or on a tensor subclass,
    # the op runs so that those machineries see it.
    if direct_launch_ok(query):
        _launch(query, k_cache, v_cache, block_table, seq_lens, query_start_loc, out, max_query_len, max_seq_len,
                scale, bool(causal), int(sliding_window or 0), float(softcap or 0.0), alibi_slopes, sinks, ks, vs,
                min_q)
        return out
    paged_attention_op(query, k_cache, v_cache, block_table, seq_lens, query_start_loc, out, max_query_len,
                       max_seq_len, scale, bool(causal), int(sliding_window or 0), float(softcap or 0.0),
                       alibi_slopes, sinks, ks, vs, min_q)
    return out


# -- ahead-of-time compile list ------------------------------------------------------------------
_TRITON_DTYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8e4nv",
                 torch.float8_e4m3fnuz: "fp8e4b8", torch.float8_e5m2: "fp8e5"}
_FP_ARGS = ("sm_scale", "softcap")
_PTR_Q = ("q_ptr", "out_ptr")
_PTR_KV = ("k_ptr", "v_ptr")
_PTR_I32 = ("block_table_ptr", "seq_lens_ptr", "qsl_ptr", "lock_ptr")


@functools.lru_cache(maxsize=256)
def _signature_cached(fn, qt: str, kt: str) -> tuple:
    sig = {}
    for name in fn.arg_names:
        if name.isupper():
            continue  # constexprs
        if name in _PTR_Q:
            sig[name] = f"*{qt}"
        elif name in _PTR_KV:
            sig[name] = f"*{kt}"
        elif name in _PTR_I32:
            sig[name] = "*i32"
        elif name.endswith("_ptr"):
            sig[name] = "*fp32"
        elif name in _FP_ARGS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return tuple(sig.items())


def _signature(fn, qt: str, kt: str) -> dict:
    return dict(_signature_cached(fn, qt, kt))


def _target_info(target: str) -> tuple[bool, bool]:
    """(hip, large shared memory) of a compile target name; ValueError for an unknown one."""
    if target.startswith("gfx") and len(target) > 3:
        return True, False
    if target.startswith("sm") and target[2:].isdigit():
        return False, target in ("sm90", "sm100")  # >= 200 KiB shared memory per block
    raise ValueError(f"unknown compile target {target!r}; use e.g. sm80, sm90, gfx942, gfx90a, gfx950.")


def compile_variants(target: str) -> list[CompileVariant]:
    """Every kernel specialisation the dispatcher (:func:`select`) can pick on ``target`` (``sm90``, ``gfx942``...).

    Only the query dtype, the KV dtype (the target's fp8 or the query's), the head size, "any
    feature" and whether V's strides are K's reach a constexpr, so this walks those axes (with a
    prefill and both split merges so that every kernel appears); ``tests/test_paged_attention_inputs.py``
    checks that every other input (block sizes, groups, feature subsets, split counts) maps into this list.
    """
    hip, big_smem = _target_info(target)
    fp8 = target_fp8(target)
    seen: dict = {}
    for qdt in QUERY_DTYPES:
        for kdt in [qdt, *fp8]:
            for head in HEAD_SIZES:
                for any_feature in (False, True):
                    for fused in (False, True):
                        # max_query_len 2 (16 rows hold it at group 4), 8 (the 32-row tile where a target takes it)
                        # and 16 (the 64-row tile), 17 (with a prefill); the stream-K launch: the 16-row tile only
                        for qlen, stream in ((2, False), (2, True), (8, False), (SHORT_MAX, False),
                                             (SHORT_MAX + 1, False)):
                            # the split merge a row or a program's rows at a time; prompts up to ONE_RUN_KEYS keys
                            for rows, short in ((False, False), (True, False), (False, True)):
                                for same in (True, False):
                                    for v in select(qdt, kdt, head, 16, 4, causal=True, window=0, softcap=0.0,
                                                    alibi=any_feature, sinks=False, max_query_len=qlen, num_splits=2,
                                                    fused=fused, hip=hip, big_smem=big_smem, interp=False,
                                                    stream=stream, merge_rows=rows, short_keys=short, same_kv=same):
                                        seen.setdefault(variant_key(v), v)
    return list(seen.values())


def variant_key(v: CompileVariant) -> tuple:
    """What makes two variants the same compile (the name is only a label)."""
    return (v.fn.__name__, tuple(sorted(v.signature.items())), tuple(sorted(v.constexprs.items())),
            tuple(sorted(v.options.items())))

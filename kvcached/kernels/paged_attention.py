"""Paged attention over KV caches with any strides: public entry point and custom op.

``paged_attention`` validates its inputs (metadata only: it never reads a device
tensor on the host) and launches the split-KV decode kernel (plus, under graph
capture, its reduce) for single-token sequences and, when ``max_query_len > 1``,
the prefill kernel for the others. Both kernels read each sequence's query length
on the device, so one call serves any mixed batch. Under torch.compile (or a
dispatch mode) the launch goes through the ``kvcached::paged_attention`` custom op;
plain eager calls skip its dispatcher, whose host cost exceeds a small decode.
"""

# No ``from __future__ import annotations``: torch.library reads the op's annotations.

import math

import torch
import triton

from kvcached.kernels import attention_config as cfg
from kvcached.kernels.attention_decode import decode_kernel, reduce_kernel
from kvcached.kernels.attention_prefill import prefill_kernel
from kvcached.kernels.platform import CompileVariant, interpreting, is_hip

HEAD_SIZES = (32, 64, 80, 96, 128, 256)
BLOCK_SIZES = (16, 32, 64, 128)
QUERY_DTYPES = (torch.float16, torch.bfloat16)

Scale = torch.Tensor | float | None


def _fp8_kv_dtypes(device: torch.device) -> tuple:
    if device.type == "cpu":  # the interpreter handles both
        return (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
    if is_hip():
        return (torch.float8_e4m3fnuz, torch.float8_e4m3fn)
    if torch.cuda.get_device_capability(device) < (8, 9):  # no fp8 conversions before Ada/Hopper
        return ()
    return (torch.float8_e4m3fn,)


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


_SCALES: dict = {}
_DUMMIES: dict = {}


def _as_scale(name: str, value: Scale, device: torch.device, needed: bool) -> torch.Tensor | None:
    """A one-element float32 tensor for an fp8 cache (cached per float value: no launch per call)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype != torch.float32:
            _fail(f"{name} must be a float or a one-element float32 tensor (per-tensor scale), got "
                  f"{value.dtype} {tuple(value.shape)}.")
        if value.device != device:
            _fail(f"{name} is on {value.device}, the cache on {device}; move it to the cache's device.")
        return value.reshape(1) if needed else None
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not math.isfinite(value) or value <= 0):
        _fail(f"{name} must be a positive finite float or a float32 tensor, got {value!r}.")
    if not needed:
        return None
    key = (1.0 if value is None else float(value), str(device))
    t = _SCALES.get(key)
    if t is None:
        if len(_SCALES) > 64:
            _SCALES.clear()
        t = _SCALES[key] = torch.full((1,), key[0], dtype=torch.float32, device=device)
    return t


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
              scale, causal, sliding_window, softcap, alibi_slopes, sinks, out) -> None:
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
        names = ", ".join(str(d) for d in _fp8_kv_dtypes(dev)) or "none on this GPU"
        _fail(f"KV cache dtype {kv_dtype} must equal the query's ({query.dtype}) or be this GPU's fp8 "
              f"({names}).")
    if query.stride(2) != 1:
        _fail("query's head_size dimension must have stride 1; call .contiguous() on it.")
    bt_shape = block_table.shape
    if block_table.dtype != torch.int32 or len(bt_shape) != 2 or block_table.stride(1) != 1:
        _fail(f"block_table must be a 2-D int32 tensor with unit column stride, got {block_table.dtype} "
              f"{tuple(bt_shape)}.")
    num_seqs = bt_shape[0]
    if num_seqs > 65535:  # the prefill grid's third dimension
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
    if bt_shape[1] * block_size < max_seq_len:
        _fail(f"block_table has {bt_shape[1]} columns x block size {block_size} = "
              f"{bt_shape[1] * block_size} tokens, fewer than max_seq_len {max_seq_len}.")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale)):
        _fail(f"scale must be a finite float or None, got {scale!r}.")
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


def _launch(query, k_cache, v_cache, block_table, seq_lens, query_start_loc, out, max_query_len, max_seq_len,
            scale, causal, sliding_window, softcap, alibi_slopes, sinks, k_scale, v_scale) -> None:
    num_tokens, num_heads, head_size = query.shape
    num_seqs = block_table.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    head_pad = triton.next_power_of_2(head_size)
    fp8 = k_cache.dtype != query.dtype
    dev = query.device
    dummy = _dummy(dev)
    alibi = alibi_slopes if alibi_slopes is not None else dummy
    sink_t = sinks if sinks is not None else dummy
    ks = k_scale if fp8 else dummy
    vs = v_scale if fp8 else dummy
    interp = interpreting()
    flags = dict(SLIDING=sliding_window > 0, SOFTCAP=softcap > 0, ALIBI=alibi_slopes is not None,
                 SINKS=sinks is not None, FP8_KV=fp8, INTERP=interp)
    q_strides = query.stride()[:2]
    ks_, vs_ = k_cache.stride(), v_cache.stride()
    kv_strides = (ks_[0], ks_[1], ks_[2], vs_[0], vs_[1], vs_[2])
    o_strides = out.stride()[:2]
    dev_index = dev.index if dev.type == "cuda" and dev.index is not None else 0

    block_h = max(16, triton.next_power_of_2(group))
    dc = cfg.decode_config(num_seqs, num_kv_heads, head_pad, block_h, k_cache.element_size(), max_seq_len, dev_index)
    split = dc.num_splits > 1
    fused = split and cfg.fused_reduce(dev)
    splits_pad = max(2, triton.next_power_of_2(dc.num_splits))
    lock = dummy
    if split:
        # one workspace: [num_seqs, num_heads, num_splits, HEAD_PAD] outputs, then (max, sum) pairs
        part = torch.empty(num_seqs * num_heads * dc.num_splits * (head_pad + 2), dtype=torch.float32, device=dev)
        if fused:
            lock = _lock_buffer(dev, num_seqs * num_kv_heads)
    else:
        part = dummy
    decode_kernel[(num_seqs, num_kv_heads, dc.num_splits)](
        query, k_cache, v_cache, out, block_table, seq_lens, query_start_loc, alibi, sink_t, ks, vs,
        part, lock, scale, softcap, sliding_window, dc.num_splits,
        *q_strides, *kv_strides, *o_strides, block_table.stride(0),
        GROUP=group, BLOCK_H=block_h, HEAD_SIZE=head_size, HEAD_PAD=head_pad, BLOCK_SIZE=block_size,
        BLOCK_N=dc.block_n, SPLIT=split, FUSED=fused, SPLITS_PAD=splits_pad if fused else 2, **flags, **dc.options,
    )
    if split and not fused:
        reduce_kernel[(num_seqs, num_heads)](
            out, query_start_loc, sink_t, part, dc.num_splits, *o_strides,
            HEAD_SIZE=head_size, HEAD_PAD=head_pad, SPLITS_PAD=splits_pad,
            SINKS=sinks is not None, num_warps=4, num_stages=1,
        )
    if max_query_len > 1:
        pc = cfg.prefill_config(head_pad, k_cache.element_size(), max_query_len, dev_index)
        grid = (triton.cdiv(max_query_len, pc.block_m), num_heads, num_seqs)
        prefill_kernel[grid](
            query, k_cache, v_cache, out, block_table, seq_lens, query_start_loc, alibi, sink_t, ks, vs,
            scale, softcap, sliding_window,
            *q_strides, *kv_strides, *o_strides, block_table.stride(0),
            GROUP=group, HEAD_SIZE=head_size, HEAD_PAD=head_pad, BLOCK_SIZE=block_size,
            BLOCK_M=pc.block_m, BLOCK_N=pc.block_n, SKIP_DECODE=True, CAUSAL=causal, **flags, **pc.options,
        )


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
) -> None:
    """Validated inputs only (``paged_attention`` checks them). ``sliding_window``/``softcap`` 0 = off."""
    _launch(query, k_cache, v_cache, block_table, seq_lens, query_start_loc, out, max_query_len, max_seq_len,
            scale, causal, sliding_window, softcap, alibi_slopes, sinks, k_scale, v_scale)


@paged_attention_op.register_fake
def _paged_attention_fake(query, k_cache, v_cache, block_table, seq_lens, query_start_loc, out, max_query_len,
                          max_seq_len, scale, causal, sliding_window, softcap, alibi_slopes, sinks, k_scale,
                          v_scale) -> None:
    return None


_dispatch_depth = getattr(torch._C, "_len_torch_dispatch_stack", None)


def _direct(query: torch.Tensor) -> bool:
    """True when a plain eager call can skip the custom op's dispatcher (nothing would observe it)."""
    return (
        _dispatch_depth is not None
        and type(query) is torch.Tensor
        and not torch.compiler.is_compiling()
        and _dispatch_depth() == 0
        and query.device.type != "meta"
    )


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
) -> torch.Tensor:
    """Attention of packed query tokens over a paged KV cache; returns ``out`` ``[num_tokens, H, D]``.

    Query token j of sequence i is at position ``seq_lens[i] - q_len_i + j``; causal
    masking is relative to that. ``sliding_window`` W: a query at p sees keys in
    ``(p - W, p]``. ``softcap``: scores become ``softcap * tanh(s / softcap)``.
    ``alibi_slopes`` (fp32 ``[H]``): ``+ slope * (key_pos - query_pos)``. ``sinks``
    (fp32 ``[H]``): one extra logit per head in the softmax denominator. fp8 caches
    are dequantised with the per-tensor ``k_scale``/``v_scale``.
    """
    _validate(query, k_cache, v_cache, block_table, seq_lens, query_start_loc, max_query_len, max_seq_len,
              scale, causal, sliding_window, softcap, alibi_slopes, sinks, out)
    dev = query.device
    fp8 = k_cache.dtype != query.dtype
    ks = _as_scale("k_scale", k_scale, dev, fp8)
    vs = _as_scale("v_scale", v_scale, dev, fp8)
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    scale = 1.0 / math.sqrt(query.shape[2]) if scale is None else float(scale)
    # The custom op's dispatch (schema defaults, ADInplaceOrView, autograd) costs more host time
    # than a whole batch-1 decode on the GPU; plain eager calls launch directly. Under
    # torch.compile, a dispatch mode (FakeTensor, functionalization...) or on a tensor subclass,
    # the op runs so that those machineries see it.
    if _direct(query):
        _launch(query, k_cache, v_cache, block_table, seq_lens, query_start_loc, out, max_query_len, max_seq_len,
                scale, bool(causal), int(sliding_window or 0), float(softcap or 0.0), alibi_slopes, sinks, ks, vs)
        return out
    paged_attention_op(query, k_cache, v_cache, block_table, seq_lens, query_start_loc, out, max_query_len,
                       max_seq_len, scale, bool(causal), int(sliding_window or 0), float(softcap or 0.0),
                       alibi_slopes, sinks, ks, vs)
    return out


# -- ahead-of-time compile list ------------------------------------------------------------------
_TRITON_DTYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8e4nv",
                 torch.float8_e4m3fnuz: "fp8e4b8"}
_FEATURES = ("SLIDING", "SOFTCAP", "ALIBI", "SINKS")
_SHORT = {"SLIDING": "window", "SOFTCAP": "softcap", "ALIBI": "alibi", "SINKS": "sinks"}


def _target_fp8(target: str) -> torch.dtype | None:
    if target.startswith("gfx"):
        if target in ("gfx90a", "gfx908", "gfx1100"):  # no fp8 hardware: not offered
            return None
        return torch.float8_e4m3fn if target in ("gfx950",) or target.startswith("gfx12") else torch.float8_e4m3fnuz
    if target.startswith("sm") and target[2:].isdigit():
        return torch.float8_e4m3fn if int(target[2:]) >= 89 else None
    raise ValueError(f"unknown compile target {target!r}; use e.g. sm80, sm90, gfx942, gfx90a, gfx950.")


def _large_smem_target(target: str) -> bool:
    return target in ("sm90", "sm90a", "sm100", "sm100a")  # >= 200 KiB shared memory per block


def _common_sig(qt: str, kt: str) -> dict:
    sig = {"q_ptr": f"*{qt}", "k_ptr": f"*{kt}", "v_ptr": f"*{kt}", "out_ptr": f"*{qt}",
           "block_table_ptr": "*i32", "seq_lens_ptr": "*i32", "qsl_ptr": "*i32", "alibi_ptr": "*fp32",
           "sinks_ptr": "*fp32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
    return sig


_STRIDES = ("stride_qt", "stride_qh", "stride_kb", "stride_kt", "stride_kh", "stride_vb", "stride_vt",
            "stride_vh", "stride_ot", "stride_oh", "stride_bt")


def _variants_for(target: str, qdt: torch.dtype, kdt: torch.dtype, head: int, block: int, group: int,
                  features: dict, causal: bool) -> list:
    hip = target.startswith("gfx")
    qt, kt = _TRITON_DTYPE[qdt], _TRITON_DTYPE[kdt]
    head_pad = triton.next_power_of_2(head)
    fp8 = kdt != qdt
    flags = {**features, "FP8_KV": fp8, "INTERP": False}
    on = [_SHORT[k] for k, v in features.items() if v]
    tag = f"{qt}-{kt}-d{head}-b{block}-g{group}" + "".join("-" + n for n in on)
    out = []
    block_h = max(16, triton.next_power_of_2(group))
    dbase = cfg._decode_base.__wrapped__(head_pad, block_h, 1 if fp8 else 2, hip)
    # no split; split merged in-kernel (128 splits: the widest merge); split + reduce_kernel
    for split, fused, suffix in ((False, False, ""), (True, True, "-split"), (True, False, "-split-reduce")):
        sig = _common_sig(qt, kt)
        sig.update({"part_ptr": "*fp32", "lock_ptr": "*i32", "sm_scale": "fp32", "softcap": "fp32", "window": "i32",
                    "num_splits": "i32"})
        sig.update({s: "i32" for s in _STRIDES})
        const = {"GROUP": group, "BLOCK_H": block_h, "HEAD_SIZE": head, "HEAD_PAD": head_pad, "BLOCK_SIZE": block,
                 "BLOCK_N": dbase.block_n, "SPLIT": split, "FUSED": fused, "SPLITS_PAD": 128 if fused else 2, **flags}
        opts = {"num_warps": dbase.num_warps, "num_stages": dbase.num_stages}
        if hip and dbase.waves_per_eu:
            opts["waves_per_eu"] = dbase.waves_per_eu
        out.append(CompileVariant(f"attn_decode[{tag}{suffix}]", decode_kernel, sig, const, opts))
    pbase = cfg._prefill_base.__wrapped__(head_pad, 1 if fp8 else 2, hip, _large_smem_target(target))
    sig = _common_sig(qt, kt)
    sig.update({"sm_scale": "fp32", "softcap": "fp32", "window": "i32"})
    sig.update({s: "i32" for s in _STRIDES})
    const = {"GROUP": group, "HEAD_SIZE": head, "HEAD_PAD": head_pad, "BLOCK_SIZE": block, "BLOCK_M": pbase.block_m,
             "BLOCK_N": pbase.block_n, "SKIP_DECODE": True, "CAUSAL": causal, **flags}
    opts = {"num_warps": pbase.num_warps, "num_stages": pbase.num_stages}
    if hip and pbase.waves_per_eu:
        opts["waves_per_eu"] = pbase.waves_per_eu
    out.append(CompileVariant(f"attn_prefill[{tag}{'-causal' if causal else ''}]", prefill_kernel, sig, const, opts))
    return out


def _reduce_variants(qdt: torch.dtype, head: int, sinks: bool) -> CompileVariant:
    qt = _TRITON_DTYPE[qdt]
    sig = {"out_ptr": f"*{qt}", "qsl_ptr": "*i32", "sinks_ptr": "*fp32", "part_ptr": "*fp32", "num_splits": "i32",
           "stride_ot": "i32", "stride_oh": "i32"}
    const = {"HEAD_SIZE": head, "HEAD_PAD": triton.next_power_of_2(head), "SPLITS_PAD": 32, "SINKS": sinks}
    return CompileVariant(f"attn_reduce[{qt}-d{head}{'-sinks' if sinks else ''}]", reduce_kernel, sig, const,
                          {"num_warps": 4, "num_stages": 1})


def compile_variants(target: str, full: bool = False) -> list[CompileVariant]:
    """Kernel specialisations the dispatcher can pick, for ``target`` (``sm80``, ``sm90``, ``gfx942``...).

    Default: every head size x query dtype (x fp8 KV where the target has it) at block
    size 16 with no features and with all features (GQA group 4); every block size,
    each feature alone and groups 1/8/16 at head size 128. ``full=True``: the whole cross product
    of those axes with every feature subset (thousands of compiles).
    """
    fp8 = _target_fp8(target)
    kv_choices = [None] + ([fp8] if fp8 is not None else [])
    none = dict.fromkeys(_FEATURES, False)
    every = dict.fromkeys(_FEATURES, True)
    variants: list[CompileVariant] = []
    subsets = [{f: bool(mask >> i & 1) for i, f in enumerate(_FEATURES)} for mask in range(1 << len(_FEATURES))]
    for qdt in QUERY_DTYPES:
        for head in HEAD_SIZES:
            for block in BLOCK_SIZES if full else (16,):
                for kv in kv_choices:
                    kdt = qdt if kv is None else kv
                    for feats in subsets if full else (none, every):
                        for causal in (True, False) if full else (feats is none,):
                            variants += _variants_for(target, qdt, kdt, head, block, 4, feats, causal)
            for sinks in (False, True):
                variants.append(_reduce_variants(qdt, head, sinks))
    if not full:
        for block in BLOCK_SIZES[1:]:
            for kv in kv_choices:
                kdt = torch.bfloat16 if kv is None else kv
                variants += _variants_for(target, torch.bfloat16, kdt, 128, block, 4, none, True)
        for f in _FEATURES:
            variants += _variants_for(target, torch.bfloat16, torch.bfloat16, 128, 16, 4, {**none, f: True}, True)
        for group in (1, 8, 16):
            variants += _variants_for(target, torch.bfloat16, torch.bfloat16, 128, 16, group, none, True)
    return variants

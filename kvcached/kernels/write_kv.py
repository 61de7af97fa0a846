"""Write new K/V tokens into a paged KV cache of any layout (``kvcached::write_kv_cache``).

The caches may be any strided view (the contiguous layout's per-layer views have a
block stride ``num_layers * 2`` blocks wide), so every stride is a kernel argument.
One program writes ``BLOCK_T`` tokens x all heads x the whole head, so each load
and store is a wide contiguous vector along the head dimension.

No host synchronisation: a slot outside ``[0, num_blocks * block_size)`` (negative
= padding, by convention) is skipped inside the kernel, never written. Use
:func:`check_slots`, or ``KVCACHED_KERNEL_CHECKS=1`` (:mod:`kvcached.kernels.checks`),
when you want out-of-range slots reported (it synchronises).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvcached.kernels import checks
from kvcached.kernels.platform import FP8_DTYPES, CompileVariant, cdiv, direct_launch_ok, next_pow2
from kvcached.kernels.platform import is_hip as vendor_is_hip

_CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, *FP8_DTYPES)
_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TL_FP8 = {
    torch.float8_e4m3fn: "fp8e4nv",
    torch.float8_e4m3fnuz: "fp8e4b8",
    torch.float8_e5m2: "fp8e5",
}
_TL_NAME = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", **_TL_FP8}
# A tile holds at most this many elements per tensor (K and V are written in turn). H200, 65,536 tokens x 8
# heads x 128, bf16, random slots (benchmarks/results/kv_write_tiles_h200.md and decode_knobs_h200.md run F):
# one token a program (1024 elements) 138.8-140 us, four (4096) 142.5-143; a same-size copy 130. The rest of
# the gap is where the slots point, not the tile: slots in token order run at 97.66 % of the copy, scattered
# ones at 93-94 % (kv_write_slots_h200.md).
_TILE_ELEMS = 1024


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    num_tokens, num_slots, block_size, num_heads, head_size,
    s_kt, s_kh, s_kd,
    s_vt, s_vh, s_vd,
    s_kcb, s_kco, s_kch, s_kcd,
    s_vcb, s_vco, s_vch, s_vcd,
    FP8: tl.constexpr, FP8_MAX: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    t = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    t_ok = t < num_tokens
    slot = tl.load(slot_ptr + t, mask=t_ok, other=-1).to(tl.int64)
    # skip padding (negative) and anything that would land outside the cache
    ok = t_ok & (slot >= 0) & (slot < num_slots)
    slot = tl.where(ok, slot, 0)
    blk = slot // block_size
    off = slot % block_size

    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    t3 = t[:, None, None]
    h3 = h[None, :, None]
    d3 = d[None, None, :]
    mask = ok[:, None, None] & (h3 < num_heads) & (d3 < head_size)

    k = tl.load(key_ptr + t3 * s_kt + h3 * s_kh + d3 * s_kd, mask=mask)
    v = tl.load(value_ptr + t3 * s_vt + h3 * s_vh + d3 * s_vd, mask=mask)
    if FP8:
        # stored = x / scale, saturated to the largest finite fp8 value (like vLLM)
        k = tl.minimum(tl.maximum(k.to(tl.float32) / tl.load(k_scale_ptr), -FP8_MAX), FP8_MAX)
        v = tl.minimum(tl.maximum(v.to(tl.float32) / tl.load(v_scale_ptr), -FP8_MAX), FP8_MAX)
    b3 = blk[:, None, None]
    o3 = off[:, None, None]
    kc = k_cache_ptr + b3 * s_kcb + o3 * s_kco + h3 * s_kch + d3 * s_kcd
    vc = v_cache_ptr + b3 * s_vcb + o3 * s_vco + h3 * s_vch + d3 * s_vcd
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _pow2(n: int) -> int:
    return next_pow2(max(int(n), 1))


def launch_config(num_heads: int, head_size: int, is_hip: bool | None = None) -> dict[str, int]:
    """Tile and warps for one head geometry (the same rule on both vendors, per-vendor warps)."""
    return dict(_config(num_heads, head_size, vendor_is_hip() if is_hip is None else is_hip))


@functools.lru_cache(maxsize=256)
def _config(num_heads: int, head_size: int, hip: bool) -> dict[str, int]:
    # cached: every layer of every step asks (read only; launch_config hands out copies)
    bh, bd = _pow2(num_heads), _pow2(head_size)
    block_t = max(1, min(16, _TILE_ELEMS // (bh * bd)))
    elems = block_t * bh * bd
    # about 16-32 elements per thread keeps every access a 16-byte vector without spilling
    threads = 64 if hip else 32
    num_warps = max(1, min(8, elems // (16 * threads)))
    return {"BLOCK_T": block_t, "BLOCK_H": bh, "BLOCK_D": bd, "num_warps": num_warps}


_UNIT_SCALES: dict[torch.device, torch.Tensor] = {}


def unit_scale(device: torch.device) -> torch.Tensor:
    """A cached fp32 ``[1.0]`` on ``device``: the (unused) scale of non-fp8 caches, no launch per call."""
    t = _UNIT_SCALES.get(device)
    if t is None:
        t = _UNIT_SCALES[device] = torch.ones(1, dtype=torch.float32, device=device)
    return t


def _fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max) if dtype in FP8_DTYPES else 0.0


def _validate(key, value, k_cache, v_cache, slot_mapping) -> None:
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("slot_mapping", slot_mapping)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
    if key.dim() != 3 or value.dim() != 3:
        raise ValueError(
            f"key and value must be [num_tokens, num_kv_heads, head_size], got {tuple(key.shape)} and "
            f"{tuple(value.shape)}."
        )
    if key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must have the same shape.")
    if k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError(
            "k_cache and v_cache must be [num_blocks, block_size, num_kv_heads, head_size], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}; unbind a (2, N, ...) view with .unbind(0) "
            "or an (N, 2, ...) view with .unbind(1)."
        )
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape.")
    if key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"key has {key.shape[1]} heads x head size {key.shape[2]} but the cache holds "
            f"{k_cache.shape[2]} heads x head size {k_cache.shape[3]}; they must match."
        )
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"slot_mapping must be 1-D with one slot per token ({key.shape[0]}), got {tuple(slot_mapping.shape)}."
        )
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}.")
    if key.dtype != value.dtype or key.dtype not in _INPUT_DTYPES:
        raise ValueError(f"key and value must share one of fp16/bf16/fp32, got {key.dtype} and {value.dtype}.")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) must have the same dtype.")
    if k_cache.dtype not in _CACHE_DTYPES:
        hint = " (an fp8 cache stored as uint8: pass cache.view(torch.float8_e4m3fn) or e4m3fnuz)" \
            if k_cache.dtype in (torch.uint8, torch.int8) else ""
        raise ValueError(f"cache dtype {k_cache.dtype} is not supported{hint}; use fp16, bf16, fp32 or fp8.")
    if k_cache.dtype not in FP8_DTYPES and k_cache.dtype != key.dtype:
        raise ValueError(
            f"key is {key.dtype} but the cache is {k_cache.dtype}; cast the key/value to the cache dtype "
            "(only fp8 caches convert on write)."
        )
    devices = {t.device for t in (key, value, k_cache, v_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"key, value, caches and slot_mapping must be on one device, got {sorted(map(str, devices))}.")


def check_slots(slot_mapping: torch.Tensor, k_cache: torch.Tensor) -> None:
    """Raise ValueError if a non-negative slot lies outside the cache. Synchronises with the device."""
    [(bad, message)] = checks.slot_problems(slot_mapping, k_cache, padding="negative")
    count = int(bad.sum())
    if count:
        raise ValueError(f"{count} slot(s) out of range, e.g. {message(tuple(bad.nonzero()[0].tolist()))}")


def _launch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    num_tokens, num_heads, head_size = key.shape
    if num_tokens == 0:
        return
    fp8 = k_cache.dtype in FP8_DTYPES
    cfg = _config(num_heads, head_size, vendor_is_hip())
    grid = (cdiv(num_tokens, cfg["BLOCK_T"]),)
    _write_kv_kernel[grid](
        key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        num_tokens, k_cache.shape[0] * k_cache.shape[1], k_cache.shape[1], num_heads, head_size,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        FP8=fp8, FP8_MAX=_fp8_max(k_cache.dtype),
        BLOCK_T=cfg["BLOCK_T"], BLOCK_H=cfg["BLOCK_H"], BLOCK_D=cfg["BLOCK_D"], num_warps=cfg["num_warps"],
    )


@torch.library.custom_op("kvcached::write_kv_cache", mutates_args=("k_cache", "v_cache"))
def _write_kv_cache_op(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    _launch(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


@_write_kv_cache_op.register_fake
def _(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
    return None


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
) -> None:
    """Write ``key``/``value`` ``[T, H, D]`` into ``k_cache``/``v_cache`` ``[N, block_size, H, D]`` at ``slot_mapping``.

    Caches may have any strides. ``slot = block_id * block_size + offset``; a negative slot
    (padding) or one past the cache is skipped. fp8 caches store ``x / scale`` (per-tensor
    ``k_scale``/``v_scale``, a float or a one-element tensor on the cache's device).
    """
    _validate(key, value, k_cache, v_cache, slot_mapping)
    device = k_cache.device
    fp8 = k_cache.dtype in FP8_DTYPES
    if fp8:
        ks = checks.scale_tensor("", "k_scale", k_scale, device)
        vs = checks.scale_tensor("", "v_scale", v_scale, device)
    else:
        checks.refuse_scales(k_cache.dtype, k_scale=k_scale, v_scale=v_scale)
        ks = vs = unit_scale(device)
    if checks.enabled(key):
        checks.check_write_kv(slot_mapping, k_cache, {"k_scale": ks, "v_scale": vs} if fp8 else {})
    if direct_launch_ok(key):
        _launch(key, value, k_cache, v_cache, slot_mapping, ks, vs)
    else:
        torch.ops.kvcached.write_kv_cache(key, value, k_cache, v_cache, slot_mapping, ks, vs)


def _target_fp8(target: str) -> list[torch.dtype]:
    """The fp8 KV dtype the dispatcher uses on ``target`` (none where the target has no fp8)."""
    if target.startswith("gfx"):
        if target == "gfx942":
            return [torch.float8_e4m3fnuz]
        return [torch.float8_e4m3fn] if target == "gfx950" or target.startswith("gfx12") else []
    if target.startswith("sm"):
        return [torch.float8_e4m3fn] if int(target[2:]) >= 89 else []
    raise ValueError(f"unknown compile target {target!r}; use e.g. sm80, sm90, gfx942, gfx90a, gfx950.")


def compile_variants(target: str) -> list[CompileVariant]:
    """Every specialisation the dispatcher can pick on ``target`` (``sm90``, ``gfx942``...)."""
    fp8_types = _target_fp8(target)
    hip = target.startswith("gfx")
    variants = []
    pairs = [(dt, dt) for dt in (torch.float16, torch.bfloat16)] + [(torch.bfloat16, f) for f in fp8_types]
    for heads, head_size in ((8, 128), (1, 576), (4, 64), (8, 80)):
        cfg = launch_config(heads, head_size, is_hip=hip)
        for in_dt, cache_dt in pairs:
            sig = {
                "key_ptr": f"*{_TL_NAME[in_dt]}", "value_ptr": f"*{_TL_NAME[in_dt]}",
                "k_cache_ptr": f"*{_TL_NAME[cache_dt]}", "v_cache_ptr": f"*{_TL_NAME[cache_dt]}",
                "slot_ptr": "*i64", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
            }
            for name in ("num_tokens", "num_slots", "block_size", "num_heads", "head_size"):
                sig[name] = "i32"
            for name in ("s_kt", "s_kh", "s_vt", "s_vh", "s_kcb", "s_kco", "s_kch", "s_vcb", "s_vco", "s_vch"):
                sig[name] = "i64"
            for name in ("s_kd", "s_vd", "s_kcd", "s_vcd"):
                sig[name] = "constexpr"
            const = {name: 1 for name in ("s_kd", "s_vd", "s_kcd", "s_vcd")}
            const.update(FP8=cache_dt in FP8_DTYPES, FP8_MAX=_fp8_max(cache_dt), BLOCK_T=cfg["BLOCK_T"],
                         BLOCK_H=cfg["BLOCK_H"], BLOCK_D=cfg["BLOCK_D"])
            for name in ("FP8", "FP8_MAX", "BLOCK_T", "BLOCK_H", "BLOCK_D"):
                sig[name] = "constexpr"
            name = f"write_kv[{_TL_NAME[in_dt]}->{_TL_NAME[cache_dt]},h{heads}x{head_size}]"
            variants.append(CompileVariant(name, _write_kv_kernel, sig, const, {"num_warps": cfg["num_warps"]}))
    return variants

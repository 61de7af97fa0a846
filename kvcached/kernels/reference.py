"""Float64 PyTorch references for paged attention and MLA decode (slow, for tests only).

They read the caches through ordinary torch indexing, so they honour any strides,
and loop over sequences on the host (they do synchronize).
"""

from __future__ import annotations

import math

import torch

from kvcached.kernels.platform import FP8_DTYPES


def _scale_value(scale: torch.Tensor | float | None) -> float:
    if scale is None:
        return 1.0
    if isinstance(scale, torch.Tensor):
        return float(scale.reshape(-1)[0].item())
    return float(scale)


def gather_kv(cache: torch.Tensor, block_ids: torch.Tensor, length: int, scale: float = 1.0) -> torch.Tensor:
    """The first ``length`` tokens of one sequence, ``[length, *cache.shape[2:]]`` in float64."""
    block_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    blocks = block_ids.to(torch.long)[pos // block_size]
    tokens = cache[blocks, pos % block_size]
    return tokens.to(torch.float64) * scale


def paged_attention_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Paged attention in float64; returns ``[num_tokens, num_heads, head_size]`` float64.

    Query token j of sequence i sits at position ``seq_len_i - q_len_i + j``. Scores are
    ``scale * q.k``, then ``softcap * tanh(s / softcap)``, then ``+ slope * (key_pos -
    query_pos)``; keys after the query (causal) or at or before ``pos - sliding_window``
    are masked; a sink adds ``exp(sink)`` to the softmax denominator.
    """
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_size) if scale is None else scale
    ks = _scale_value(k_scale) if k_cache.dtype in FP8_DTYPES else 1.0
    vs = _scale_value(v_scale) if v_cache.dtype in FP8_DTYPES else 1.0
    out = torch.zeros(num_tokens, num_heads, head_size, dtype=torch.float64, device=query.device)
    qsl = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_lo, q_hi = qsl[i], qsl[i + 1]
        q_len = q_hi - q_lo
        if q_len == 0:
            continue
        k = gather_kv(k_cache, block_table[i], seq_len, ks).repeat_interleave(group, dim=1)  # [S, H, D]
        v = gather_kv(v_cache, block_table[i], seq_len, vs).repeat_interleave(group, dim=1)
        q = query[q_lo:q_hi].to(torch.float64)  # [Q, H, D]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        rel = (k_pos[None, :] - q_pos[:, None]).to(torch.float64)  # [Q, S]
        visible = torch.ones_like(rel, dtype=torch.bool)
        if causal:
            visible &= rel <= 0
        if sliding_window is not None:
            visible &= rel > -sliding_window
        # heads in chunks so an 8k x 8k prompt stays within a few GiB of float64
        step = max(1, (1 << 27) // max(1, q_len * seq_len))
        for h0 in range(0, num_heads, step):
            hs = slice(h0, min(num_heads, h0 + step))
            s = torch.einsum("qhd,khd->hqk", q[:, hs], k[:, hs]) * scale
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            if alibi_slopes is not None:
                s = s + alibi_slopes[hs].to(torch.float64)[:, None, None] * rel[None]
            s = s.masked_fill(~visible[None], float("-inf"))
            if sinks is not None:
                sink = sinks[hs].to(torch.float64)[:, None, None].expand(s.shape[0], q_len, 1)
                p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
            else:
                p = torch.softmax(s, dim=-1)
            out[q_lo:q_hi, hs] = torch.einsum("hqk,khd->qhd", p, v[:, hs])
    return out


def mla_decode_ref(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    v_head_size: int = 512,
    kv_scale: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """MLA decode in float64: one query token per sequence, one shared latent KV head.

    ``query`` ``[num_seqs, num_heads, D]`` (D = 576: 512 latent + 64 rope channels);
    ``kv_cache`` ``[num_blocks, block_size, D]`` (any strides). Keys are the whole
    latent, values its first ``v_head_size`` channels. Returns ``[num_seqs, num_heads,
    v_head_size]`` float64.
    """
    num_seqs, num_heads, _ = query.shape
    s_kv = _scale_value(kv_scale) if kv_cache.dtype in FP8_DTYPES else 1.0
    out = torch.zeros(num_seqs, num_heads, v_head_size, dtype=torch.float64, device=query.device)
    for i, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        kv = gather_kv(kv_cache, block_table[i], seq_len, s_kv)  # [S, D]
        q = query[i].to(torch.float64)  # [H, D]
        p = torch.softmax((q @ kv.T) * scale, dim=-1)
        out[i] = p @ kv[:, :v_head_size]
    return out


# -- test/benchmark cases built on the real layouts -----------------------------------------------
def fill_random_(bases: list[torch.Tensor], dtype: torch.dtype, generator: torch.Generator | None = None) -> None:
    """Fill layout base tensors with finite random values of ``dtype`` (never zeros, never NaN).

    fp8 values are made by a torch cast from float32 (Triton's fp32->fp8 casts round wrongly
    in the interpreter).
    """
    for base in bases:
        itemsize = torch.empty((), dtype=dtype).element_size()
        n = base.numel() // itemsize
        src = base.device if generator is None else generator.device
        typed = base[: n * itemsize].view(dtype)
        chunk = 1 << 26  # bounded float32 temporaries for multi-GiB GPU caches
        for lo in range(0, n, chunk):
            m = min(chunk, n - lo)
            vals = torch.randn(m, generator=generator, device=src, dtype=torch.float32).to(base.device)
            if dtype in FP8_DTYPES:
                vals = vals * 4.0
            typed[lo : lo + m].copy_(vals.to(dtype))


def paged_kv_case(
    *,
    layout: str,
    style: str,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    num_blocks: int,
    num_layers: int = 2,
    layer: int = 1,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], object]:
    """K and V caches ``[N, block_size, H, D]`` of one layer, as strided views of a real layout.

    ``style`` ``flash_attn`` takes ``unbind(0)`` of the ``(2, N, ...)`` view, ``flashinfer``
    ``unbind(1)`` of the ``(N, 2, ...)`` view, ``sglang`` SGLang's per-token buffers as pages
    of ``block_size`` tokens (token-major on the contiguous layout). Returns ``(k, v, bases, geometry)``.
    """
    from kvcached import layout as L

    spec = L.KVSpec(num_layers, num_blocks, block_size, num_kv_heads, head_size, dtype)
    if style == L.SGLANG_PAGED:
        geom = L.token_major_geometry(spec, layout, math.lcm(2 << 20, spec.block_bytes))
        bases = L.allocate_plain(geom, device)
        fill_random_(bases, dtype, generator)
        k, v = L.sglang_paged_kv(bases, geom, layer, block_size)
        return k, v, bases, geom
    # the smallest page (a multiple of 2 MiB) that whole blocks fill: head sizes 80/96 need 10/6 MiB
    geom = L.KVGeometry(spec, L.Layout.parse(layout), math.lcm(2 << 20, spec.block_bytes))
    bases = L.allocate_plain(geom, device)
    fill_random_(bases, dtype, generator)
    view = L.kv_cache_view(bases, geom, layer, style)
    k, v = view.unbind(0 if style == L.FLASH_ATTN else 1)
    return k, v, bases, geom


def random_batch(
    q_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    head_size: int,
    block_size: int,
    num_blocks: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    extra_cols: int = 1,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(query, block_table, seq_lens, query_start_loc)`` with a random block table of distinct blocks."""
    if len(q_lens) != len(seq_lens) or any(q > s for q, s in zip(q_lens, seq_lens, strict=True)):
        raise ValueError("each q_len must be at most its seq_len, one of each per sequence.")
    cols = max(-(-s // block_size) for s in seq_lens) + extra_cols
    if cols * len(seq_lens) > num_blocks:
        raise ValueError(f"{cols * len(seq_lens)} blocks needed, only {num_blocks} in the cache.")
    perm = torch.randperm(num_blocks, generator=generator)[: cols * len(seq_lens)]
    block_table = perm.to(torch.int32).reshape(len(seq_lens), cols).to(device)
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    query = torch.randn(starts[-1], num_heads, head_size, generator=generator, dtype=torch.float32).to(device, dtype)
    return (
        query,
        block_table,
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        torch.tensor(starts, dtype=torch.int32, device=device),
    )


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` over the whole output (NaN anywhere gives NaN)."""
    return float((out.to(torch.float64) - ref).norm() / ref.norm())

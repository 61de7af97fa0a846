"""What the kernels read through device tensors: fp8 scales, block ids, lengths, offsets, slots.

The host checks of each wrapper see shapes and dtypes only, because reading a device
tensor costs a host sync, more than a decode step. But a block id past the cache or a
sequence longer than its block-table row makes a kernel read outside the cache (an
illegal address on a GPU, a segfault in Triton's interpreter), and a negative id or
disordered query offsets give NaN. With ``KVCACHED_KERNEL_CHECKS=1`` the kernels check
those values with torch ops on the device and one host sync per call, and raise
ValueError naming the first bad entry. They run on plain eager calls only: under
torch.compile tracing or FakeTensor the values do not exist yet, and during CUDA graph
capture no sync is allowed (the graph replays what was checked eagerly).

:func:`scale_tensor` is the one fp8-scale rule of every kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kvcached import config
from kvcached.kernels.platform import direct_launch_ok

Problem = tuple[torch.Tensor, Callable[[tuple[int, ...]], str]]  # (bad mask, message for its first bad index)

_SCALES: dict = {}


def refuse_scales(cache_dtype: torch.dtype, **scales: object) -> None:
    """ValueError if any scale is given for a cache that is not fp8: one message for every kernel,
    so a caller that passes a scale it thinks is used learns it is not."""
    if all(value is None for value in scales.values()):
        return
    names = "/".join(scales)
    verb = "applies" if len(scales) == 1 else "apply"
    raise ValueError(f"{names} {verb} to fp8 caches only; this cache is {cache_dtype}.")


def scale_tensor(where: str, name: str, value: torch.Tensor | float | None, device: torch.device,
                 default: float | None = None) -> torch.Tensor:
    """A one-element float32 tensor for an fp8 per-tensor scale.

    A number must be positive and finite (a zero, negative or NaN scale turns every value into
    inf or NaN). A tensor must hold one floating value on ``device``; its value can only be
    read with a sync, so :func:`enabled` mode checks it on the device. ``None`` means ``default``
    (an error when there is none). Float scales are cached: no launch per call.
    """
    if value is None:
        if default is None:
            raise ValueError(f"{where}{name} is required for an fp8 KV cache; pass a float or a one-element tensor.")
        value = default
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or not value.dtype.is_floating_point:
            raise ValueError(f"{where}{name} must be a float or one per-tensor scale (a one-element float tensor), "
                             f"got {value.dtype} {tuple(value.shape)}.")
        if value.device != device:
            raise ValueError(f"{where}{name} is on {value.device}, the cache on {device}; move it to {device}.")
        return value.reshape(1).to(torch.float32)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{where}{name} must be a positive finite float or a float tensor, got {value!r}.")
    key = (float(value), str(device))
    t = _SCALES.get(key)
    if t is None:
        if len(_SCALES) > 64:
            _SCALES.clear()
        t = _SCALES[key] = torch.full((1,), key[0], dtype=torch.float32, device=device)
    return t


def enabled(t: torch.Tensor) -> bool:
    """``KVCACHED_KERNEL_CHECKS`` is on and ``t``'s values can be read now: a plain eager call
    (not traced by torch.compile, not fake), outside CUDA graph capture."""
    if not config.kernel_checks() or not direct_launch_ok(t):
        return False
    return not (t.device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _raise_first(where: str, problems: list[Problem]) -> None:
    if not problems:
        return
    flags = torch.stack([bad.any() for bad, _ in problems]).tolist()  # the one sync of a good call
    for flag, (bad, message) in zip(flags, problems, strict=True):
        if flag:
            first = tuple(int(i) for i in bad.nonzero()[0].tolist())
            raise ValueError(f"{where}{message(first)}")


def _scale_problems(scales: dict[str, torch.Tensor | None]) -> list[Problem]:
    out: list[Problem] = []
    for name, s in scales.items():
        if s is not None:
            out.append((~(torch.isfinite(s) & (s > 0)),
                        lambda i, name=name, s=s: f"{name} = {s.item()} on the device; an fp8 scale must be "
                                                  "positive and finite."))
    return out


def _block_problems(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                    num_blocks: int) -> list[Problem]:
    # only the entries a sequence reads: the rest of a row is padding the kernels never touch
    used = (seq_lens.long().clamp(min=0) + block_size - 1) // block_size
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    ids = block_table.long()
    bad = (cols[None, :] < used[:, None]) & ((ids < 0) | (ids >= num_blocks))
    return [(bad, lambda i: f"block_table[{i[0]}, {i[1]}] = {int(ids[i])} is outside the cache's {num_blocks} "
                            f"blocks (sequence {i[0]} reads its first {int(used[i[0]])} entries).")]


def _seq_len_problems(seq_lens: torch.Tensor, max_seq_len: int) -> list[Problem]:
    sl = seq_lens.long()
    return [((sl < 0) | (sl > max_seq_len),
             lambda i: f"seq_lens[{i[0]}] = {int(sl[i])} is outside [0, max_seq_len = {max_seq_len}].")]


def check_paged_attention(query: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                          seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int,
                          max_seq_len: int, scales: dict[str, torch.Tensor | None], min_query_len: int = 1) -> None:
    num_tokens, num_seqs = query.shape[0], block_table.shape[0]
    qsl = query_start_loc.long()
    sl = seq_lens.long()
    q_len = qsl[1:] - qsl[:-1]
    problems: list[Problem] = [
        (qsl[:1] != 0, lambda i: f"query_start_loc[0] = {int(qsl[0])}; the offsets must start at 0."),
        (q_len < 0, lambda i: f"query_start_loc[{i[0] + 1}] = {int(qsl[i[0] + 1])} is below query_start_loc"
                              f"[{i[0]}] = {int(qsl[i[0]])}; the offsets must not decrease."),
        (qsl[-1:] != num_tokens, lambda i: f"query_start_loc[{num_seqs}] = {int(qsl[-1])} but the query has "
                                           f"{num_tokens} tokens; the last offset must equal that."),
        (q_len > max_query_len, lambda i: f"sequence {i[0]} has {int(q_len[i])} query tokens, more than "
                                          f"max_query_len = {max_query_len}."),
        (q_len < min_query_len, lambda i: f"sequence {i[0]} has {int(q_len[i])} query tokens, fewer than "
                                          f"min_query_len = {min_query_len}."),
        *_seq_len_problems(seq_lens, max_seq_len),
        (sl < q_len, lambda i: f"seq_lens[{i[0]}] = {int(sl[i])} is shorter than its {int(q_len[i])} query tokens; "
                               "seq_lens include the new tokens."),
        *_block_problems(block_table, seq_lens, k_cache.shape[1], k_cache.shape[0]),
        *_scale_problems(scales),
    ]
    _raise_first("paged_attention: ", problems)


def check_mla_decode(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     max_seq_len: int, kv_scale: torch.Tensor | None) -> None:
    problems = [*_seq_len_problems(seq_lens, max_seq_len),
                *_block_problems(block_table, seq_lens, kv_cache.shape[1], kv_cache.shape[0]),
                *_scale_problems({"kv_scale": kv_scale})]
    _raise_first("paged_mla_decode: ", problems)


def slot_problems(slot_mapping: torch.Tensor, k_cache: torch.Tensor, padding: str = "-1") -> list[Problem]:
    """Slots outside the cache; ``padding`` "-1" allows only -1, "negative" any negative slot."""
    num_blocks, block_size = k_cache.shape[:2]
    num_slots = num_blocks * block_size
    bad = slot_mapping >= num_slots
    if padding == "-1":
        bad = bad | (slot_mapping < -1)
    rule = "-1 marks padding" if padding == "-1" else "a negative slot marks padding"
    return [(bad, lambda i: f"slot_mapping[{i[0]}] = {int(slot_mapping[i])} is outside the cache's {num_blocks} "
                            f"blocks x {block_size} tokens = {num_slots} slots (slot = block_id * block_size + "
                            f"offset; {rule}).")]


def check_write_kv(slot_mapping: torch.Tensor, k_cache: torch.Tensor,
                   scales: dict[str, torch.Tensor | None]) -> None:
    _raise_first("write_kv_cache: ", [*slot_problems(slot_mapping, k_cache), *_scale_problems(scales)])

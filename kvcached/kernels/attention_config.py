"""Launch configurations of the attention kernels, chosen per vendor by heuristic.

NVIDIA and AMD get separate tables. Results are cached per shape key. Benchmarks
sweep the knobs through :func:`override` (a context manager), e.g.
``with override(decode_block_n=128, decode_num_warps=8): ...``.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, replace

import torch

from kvcached.kernels.platform import cdiv, interpreting, is_hip, override_knobs


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int  # keys per iteration
    num_warps: int
    num_stages: int
    num_splits: int
    waves_per_eu: int = 0  # HIP only; 0 = leave to the compiler
    balance: int = 0  # programs in one wave, which the kernel spreads the batch's keys over (0: equal splits)
    waves: int = 1  # waves of programs the kernel plans with ``balance``
    run_floor: int = 0  # keys: runs shorter than this (and than one wave's runs) are not cut
    maxnreg: int = 0  # NVIDIA only: registers a thread may use (0 = the compiler's choice)
    stream: int = 0  # programs a head slot has in a stream-K launch (0: a column of splits per sequence)
    min_tiles: int = 1  # the least key tiles a stream-K program takes

    @property
    def options(self) -> dict[str, int]:
        return launch_options(self.num_warps, self.num_stages, self.waves_per_eu, maxnreg=self.maxnreg)


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    waves_per_eu: int = 0
    bt_ahead: bool = False  # load the next key tile's block ids a tile ahead (attention_common._tile_run)
    maxnreg: int = 0  # NVIDIA only: registers a thread may use (0 = the compiler's choice)
    one_run: bool = False  # the diagonal tiles in the interior tiles' loop (attention_common.attn_tiles ONE_RUN)
    # batches below this many sequences find a program's sequence by one load and a count, larger ones by binary
    # search (0: always). H200, bf16 32/8 heads d128, graph replay (benchmarks/results/prefill_setup_h200.md run B):
    # 64 prompts of 128 116.4 -> 109.0 us, 16 of 512 161.3 -> 159.4, 8 of 1k unchanged. Off on AMD, where it is
    # not measured and the compile check shows more spills (gfx942 bf16 d128 with features: 0 -> 10).
    lookup: int = 256

    @property
    def options(self) -> dict[str, int]:
        return launch_options(self.num_warps, self.num_stages, self.waves_per_eu, maxnreg=self.maxnreg)


_OVERRIDES: dict[str, int] = {}
# waves of programs the decode kernel plans its splits for (0: equal splits per sequence), and the shortest
# run (keys) it cuts a second wave's runs to
SPLIT_WAVES = 2
RUN_FLOOR = 1024
ONE_RUN_KEYS = 2048  # the longest sequence (keys) for which the prefill runs its diagonal tiles in one loop
STREAM_SEQS = 2  # sequences per stream-K program (on average) up to which a batch goes to the stream-K launch
KNOBS = (
    "decode_block_n",
    "decode_num_warps",
    "decode_num_stages",
    "decode_num_splits",
    "decode_waves_per_eu",
    "decode_fused_reduce",
    "short_num_warps",
    "short_rows",
    "tb_inner",
    "decode_maxnreg",
    "prefill_block_m",
    "prefill_block_n",
    "prefill_num_warps",
    "prefill_num_stages",
    "prefill_waves_per_eu",
    "min_keys_per_split",
    "programs_per_sm",
    "split_waves",
    "split_run_floor",
    "split_room",
    "stream",
    "decode_bt_ahead",
    "prefill_bt_ahead",
    "prefill_maxnreg",
    "prefill_one_run",
    "prefill_lookup",
    "merge_rows",
    "concurrent_prefill",
)


def override(**knobs: int) -> contextlib.AbstractContextManager[None]:
    """Force launch knobs (for benchmarks and tests); unknown names raise ValueError."""
    return override_knobs(_OVERRIDES, KNOBS, "attention", knobs)


def overrides_key() -> tuple:
    """The knobs in force, hashable (part of the dispatcher's cache key)."""
    return tuple(sorted(_OVERRIDES.items())) if _OVERRIDES else ()


def decode_tile(head_pad: int, kv_itemsize: int, hip: bool, interp: bool) -> DecodeConfig:
    """The decode kernel's tile and options for a target, with any :func:`override` knobs applied."""
    base = decode_base(head_pad, kv_itemsize, hip, interp)
    if not _OVERRIDES:
        return base
    o = _OVERRIDES
    return replace(base, block_n=o.get("decode_block_n", base.block_n),
                   num_warps=o.get("decode_num_warps", base.num_warps),
                   num_stages=o.get("decode_num_stages", base.num_stages),
                   waves_per_eu=o.get("decode_waves_per_eu", base.waves_per_eu),
                   maxnreg=o.get("decode_maxnreg", base.maxnreg))


def short_rows(default: int) -> int:
    """Query rows of a short-query program (``override(short_rows=)`` for sweeps)."""
    return _OVERRIDES.get("short_rows", default)


def token_blocks_inner(default: bool) -> bool:
    """Launch a sequence's token blocks side by side (``override(tb_inner=)`` for sweeps)."""
    return bool(_OVERRIDES.get("tb_inner", default))


def decode_bt_ahead(rows: int, hip: bool, big_smem: bool, interp: bool) -> bool:
    """Does the decode program with ``rows`` query rows load each key tile's block ids a tile ahead?

    ``attention_common._tile_run`` says why that deepens Triton's K/V pipeline. H200, bf16 32/8 heads d128, graph
    replay (benchmarks/results/decode_ahead_h200.md): the 64-row short tile (3 K/V buffers, 112 KiB of shared
    memory) 64 x 8k x q16 631 -> 510 us, 8 x 8k x q16 119 -> 107; the 16-row tile lost 1-37 % (72 KiB: 3 programs
    an SM instead of 4; with 2 stages 1-2 %), the 32-row tile 2-34 %. Only where a block may use >= 200 KiB of
    shared memory (``big_smem``: the third buffer does not fit sm86/sm89's 99 KiB, and other GPUs are not
    measured); AMD: not measured, so not taken. The interpreter takes it (the CPU tests cover that loop;
    tests/test_paged_attention.py also the other).
    ``override(decode_bt_ahead=)`` sets it for every tile.
    """
    knob = _OVERRIDES.get("decode_bt_ahead")
    if knob is not None:
        return bool(knob)
    return interp or (big_smem and not hip and rows >= 64)


def merge_rows(partials: float, rows: int) -> bool:
    """Merge split partials (the graph path's second launch) a decode program's rows at a time
    (``reduce_rows_kernel``) rather than a row at a time (``reduce_kernel``)? ``partials``: about how many each row
    has; ``rows``: the (token, head) rows a decode program holds.

    H200, bf16 32/8 heads d128, graph replay (benchmarks/results/decode_ahead_h200.md, run D), us, rows against a
    row at a time: 64 x 8k (2 partials a row, 4 rows) 523 -> 516, x q4 (16 rows) 562 -> 524, 8 x 8k x q4 (9
    partials, 16 rows) 90.4 -> 88.2, 8 x 8k x q16 (4 partials, 64 rows) 109 -> 91.6; but 8 x 8k (9 partials, 4
    rows) 86.2 -> 87.4, 4 x 32k (18) 146 -> 150, 1 x 8k (67) 26.4 -> 40.9, 1 x 32k x q16 (128 splits) 59.6 ->
    82.1: its partials go ``CH`` (8 at 16 x 128) an iteration, a row at a time 64 a load.
    ``override(merge_rows=)`` forces one.
    """
    knob = _OVERRIDES.get("merge_rows")
    if knob is not None:
        return bool(knob)
    return partials <= 8 or (rows >= 16 and partials <= 32)


def decode_warps(rows: int, head_pad: int, kv_itemsize: int, hip: bool, interp: bool, hopper: bool = False) -> int:
    """Warps of a decode program with ``rows`` query rows (16: single tokens; 32 or 64: short queries).

    H200, bf16 32/8 heads d128, 64 x 8k, graph replay (decode_knobs_h200.md, run A): the 64-row tile
    took 1191 us at 8 warps and 660 at 4 (one warpgroup holds all 64 rows, so Hopper's wgmma takes the
    dots). Elsewhere 64 rows of a 128- or 256-wide head spill at 4 warps (compile check: gfx942 8
    registers at d128, 26 at d256; sm80 72 bytes of stack at d128; sm90 208 at d256), so 8 there. The
    16-row tile's warps are :func:`decode_tile`'s. ``override(short_num_warps=)`` sets them.
    """
    if rows <= 16:
        return decode_tile(head_pad, kv_itemsize, hip, interp).num_warps
    knob = _OVERRIDES.get("short_num_warps")
    if knob is not None:
        return knob
    if rows <= 32:
        # H200, 64 x 8k x q8 (decode_knobs_h200.md, runs E-F): 2 warps 547 us, 4 warps 671. Planned as 2 programs
        # an SM like the 64-row tile: as 4 (one wave, so the kernel's split plan and its empty programs run) 600.
        # Elsewhere unmeasured: 4 warps, the 16-row tile's register load per warp.
        return 2 if hopper and not hip and head_pad <= 128 and kv_itemsize == 2 and not interp else 4
    if interp or head_pad < 128 or (hopper and not hip and head_pad == 128):
        return 4
    return 8


def prefill_tile(head_pad: int, kv_itemsize: int, hip: bool, big_smem: bool, interp: bool,
                 features: bool = False, short_keys: bool = False) -> PrefillConfig:
    """The prefill kernel's tile and options for a target (``features``: the ``FEATURES`` compile; ``short_keys``:
    no sequence of the call has more than :data:`ONE_RUN_KEYS` keys), with any :func:`override` knobs applied."""
    # One tile per head size and compile (no smaller tiles for short chunks): every extra tile is one more
    # compile per dtype pair x head size x target for the ahead-of-time check.
    base = prefill_base(head_pad, kv_itemsize, hip, big_smem, interp, features, short_keys)
    if not _OVERRIDES:
        return base
    o = _OVERRIDES
    lookup = o.get("prefill_lookup", base.lookup)
    if lookup < 0 or lookup & (lookup - 1):
        raise ValueError(f"prefill_lookup={lookup}: 0 (binary search only) or a power of two (the prefill kernel "
                         "counts over tl.arange(0, lookup))")
    tile = replace(base, block_m=o.get("prefill_block_m", base.block_m),
                   block_n=o.get("prefill_block_n", base.block_n),
                   num_warps=o.get("prefill_num_warps", base.num_warps),
                   num_stages=o.get("prefill_num_stages", base.num_stages),
                   waves_per_eu=o.get("prefill_waves_per_eu", base.waves_per_eu),
                   bt_ahead=bool(o.get("prefill_bt_ahead", base.bt_ahead)),
                   maxnreg=o.get("prefill_maxnreg", base.maxnreg),
                   lookup=lookup)
    # the knob forces the one loop where the compile has it (plain causal, block ids ahead)
    return replace(tile, one_run=bool(o.get("prefill_one_run", base.one_run)) and tile.bt_ahead and not features)


@functools.lru_cache(maxsize=16)
def num_compute_units(device_index: int) -> int:
    """SMs (NVIDIA) or CUs (AMD); a small stand-in in the CPU interpreter."""
    if not torch.cuda.is_available():
        return 8
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _slots(units: int, hip: bool, rows: int) -> int:
    """Decode programs the GPU runs at once (``override(programs_per_sm=)`` for sweeps)."""
    return units * _OVERRIDES.get("programs_per_sm", (2 if hip else 4) // (2 if rows > 16 else 1))


def _pick_splits(programs: int, max_seq_len: int, block_n: int, units: int, hip: bool,
                 rows: int = 16) -> tuple[int, int, int]:
    """(split count, ``balance``, waves): how many splits the grid has, the programs of one wave the kernel
    spreads the batch's keys over (0: every sequence in ``num_splits`` equal parts), and its waves."""
    # sm90 decode (d128, 64 keys x 3 stages, 2 warps) fits 4 programs per SM (242 regs, 39 KB smem), the
    # 64-row short tile 2 (4 warps, 208 regs, 82 KB); gfx942 2 per CU (174 vgprs), 1 of the short tile's
    # 8 warps. Fewer than ~128 keys per split is all reduce overhead.
    min_keys = _OVERRIDES.get("min_keys_per_split", 128)
    slots = _slots(units, hip, rows)
    by_len = cdiv(max_seq_len, max(min_keys, block_n))
    waves = _OVERRIDES.get("split_waves")
    if waves is None:
        # One wave's runs overflow it by at most a run per program (the ceil of each sequence's share), so
        # only a batch of more than ~1/4 of a wave of programs needs the kernel's second-wave check; below,
        # its extra pass over the lengths is a cost on the critical path (H200, decode_waves_h200.md:
        # 8 x 8k 84.5 -> 89.2 us, 1 x 8k 29.5 -> 30.0 with the check on every batch).
        waves = SPLIT_WAVES if programs * 4 > slots else 1
    if waves > 0 and programs < slots:
        # The kernel cuts each sequence into runs of about (the batch's keys / slots) keys, up to 1/8 over
        # that left whole; the grid has room for a sequence 4x the mean length, shorter ones leave their
        # splits empty. H200, bf16 d128 (decode_knobs_h200.md, run D): equal splits (waves 0) took 756 us at
        # 64 sequences of 256-16k keys, one wave of runs 719. ``waves`` 2: the kernel halves its runs when one
        # wave's leave a second wave (uneven lengths), not below split_run_floor keys. H200, graph replay
        # (benchmarks/results/decode_waves_h200.md): 64 of 256-16k keys 715 -> 614 us; two waves for every
        # batch cost 8 x 8k +3 %, 4 x 32k +5 %, and 64 x 8k x q16 +16 % (it was split at all), hence the
        # kernel's test and no split for a batch that fills a wave.
        room = _OVERRIDES.get("split_room", 4)
        splits = max(1, min(cdiv(room * slots, max(programs, 1)), by_len, 128))
        return (splits, slots, waves) if splits > 1 else (1, 0, 1)
    # floor, not ceil: one program past a full wave costs a whole extra wave (H200, batch 8 x 8k:
    # 9 splits = 576 programs on 528 slots took 100 us, 8 splits 82 us)
    want = max(1, slots // max(programs, 1))
    return max(1, min(want, by_len, 128)), 0, 1


@functools.lru_cache(maxsize=1024)
def decode_base(head_pad: int, kv_itemsize: int, hip: bool, interp: bool) -> DecodeConfig:
    """The decode tile and launch options for a target (``num_splits`` is chosen per call)."""
    if interp:
        return DecodeConfig(block_n=32, num_warps=4, num_stages=1, num_splits=1)
    if hip:
        # MI300: 64-wide waves, no cp.async pipelining; fewer stages, 1 wave per EU target off.
        block_n = 64 if head_pad <= 128 else 32
        return DecodeConfig(block_n=block_n, num_warps=4, num_stages=1, num_splits=1, waves_per_eu=2)
    block_n = 64 if head_pad <= 128 else 32
    if kv_itemsize == 1 and head_pad <= 128:
        block_n = 128
    # H200, bf16 d128, 64 x 8k (decode_knobs_h200.md, run A): 4 warps took 674 us (164 registers with
    # causal rows: 3 programs an SM), 2 warps 496 (242 registers, 4 an SM)
    warps = 2 if head_pad <= 128 and kv_itemsize == 2 else 4
    return DecodeConfig(block_n=block_n, num_warps=warps, num_stages=3 if head_pad <= 128 else 2, num_splits=1)


def decode_config(
    num_seqs: int, num_kv_heads: int, head_pad: int, block_h: int, kv_itemsize: int, max_seq_len: int,
    device_index: int, one_block: bool = False,
) -> DecodeConfig:
    if _OVERRIDES:
        return _decode_config(num_seqs, num_kv_heads, head_pad, block_h, kv_itemsize, max_seq_len, device_index,
                              one_block)
    return _decode_cached(num_seqs, num_kv_heads, head_pad, block_h, kv_itemsize, max_seq_len, device_index, one_block)


def _decode_config(
    num_seqs: int, num_kv_heads: int, head_pad: int, block_h: int, kv_itemsize: int, max_seq_len: int,
    device_index: int, one_block: bool = False,
) -> DecodeConfig:
    # num_kv_heads: programs per sequence (KV heads x head chunks x token blocks); block_h: rows a program;
    # one_block: every query fits one program's rows (the stream-K launch takes only such batches, on the 16-row
    # tile: one more compile per decode variant, not per short tile)
    hip = is_hip()
    tile = decode_tile(head_pad, kv_itemsize, hip, interpreting())
    splits, balance, waves = _OVERRIDES.get("decode_num_splits"), 0, 1
    if splits is None:
        units = num_compute_units(device_index)
        splits, balance, waves = _pick_splits(num_seqs * num_kv_heads, max_seq_len, tile.block_n, units, hip, block_h)
        slots = _slots(units, hip, block_h)
        min_keys = _OVERRIDES.get("min_keys_per_split", 128)
        # Stream-K (each head slot's share of the slots walks the batch's key tiles in equal parts) where the
        # kernel would balance runs, and past a wave of one-column programs (which the GPU's scheduler packs
        # unevenly) while a program walks at most STREAM_SEQS sequences on average. H200, bf16 32/8 heads d128,
        # graph replay (benchmarks/results/decode_stream_h200.md), sequences of 256-16k keys, us: 16 226 -> 153,
        # 64 614 -> 507, 96 1108 -> 771, 128 1396 -> 1006 (2 a program), 256 2401 -> 2058; equal lengths 64 x 8k
        # -0.5 %, 128 x 8k +1.7 %, 256 x 8k +1.2 %, 64 x 8k x q4 +1 %, but 512 x 2k +7.9 % and 256 x 1k +16 %
        # (kernels_h200_streamk_past_one_wave.md against kernels_h200.md; 4-8 sequences a program, each a restart of
        # the key pipeline and a partial to merge), hence the cap. Under a CUDA graph max_seq_len is vLLM's
        # max_model_len, so batches of up to 132 sequences take it whatever their lengths: with a program's whole
        # sequences written directly (decode_ahead_h200.md, run C), equal short contexts cost 5-12 % over the
        # one-column launch (128 x 1k 150 against 143 us, 132 x 256 60 / 53); uneven ones (16, 64, 128 sequences of
        # 256-16k keys) gain 17-33 %.
        stream = _OVERRIDES.get("stream", 1) and one_block and block_h <= 16 and num_seqs > 1
        per_slot = max(1, slots // max(num_kv_heads, 1))
        wide = num_seqs <= STREAM_SEQS * per_slot and max_seq_len > min_keys
        if stream and (balance or wide):
            return replace(tile, num_splits=num_seqs + per_slot, stream=per_slot,
                           min_tiles=cdiv(min_keys, tile.block_n))
    return replace(tile, num_splits=max(1, int(splits)), balance=balance, waves=waves,
                   run_floor=_OVERRIDES.get("split_run_floor", RUN_FLOOR))


@functools.lru_cache(maxsize=16)
def large_shared_memory(device_index: int) -> bool:
    """True on GPUs with >= 200 KiB of shared memory per block (H100/H200/B200, not A100 or consumer parts)."""
    if not torch.cuda.is_available() or is_hip():
        return False
    props = torch.cuda.get_device_properties(device_index)
    optin = getattr(props, "shared_memory_per_block_optin", 0)
    if optin:
        return optin >= 200 * 1024
    return (props.major, props.minor) in ((9, 0), (10, 0))


@functools.lru_cache(maxsize=1024)
def prefill_base(head_pad: int, kv_itemsize: int, hip: bool, big_smem: bool, interp: bool,
                 features: bool = False, short_keys: bool = False) -> PrefillConfig:
    """The prefill tile and launch options for a target: one per head size and compile (``features``: the
    ``FEATURES`` one), whatever the query length; ``short_keys``: see :func:`prefill_tile`."""
    if interp:
        return PrefillConfig(block_m=32, block_n=32, num_warps=4, num_stages=1, bt_ahead=True)
    if hip:
        if head_pad <= 64:
            return PrefillConfig(block_m=128, block_n=64, num_warps=4, num_stages=1, waves_per_eu=2, lookup=0)
        if head_pad <= 128:  # block_n 64 spills on gfx942 (compile check: 256 vgprs + scratch)
            return PrefillConfig(block_m=128, block_n=32, num_warps=8, num_stages=1, waves_per_eu=2, lookup=0)
        return PrefillConfig(block_m=64, block_n=32, num_warps=8, num_stages=1, waves_per_eu=2, lookup=0)
    if head_pad <= 64:
        return PrefillConfig(block_m=128, block_n=64, num_warps=4, num_stages=3)
    if head_pad <= 128:
        # H200, bf16 32/8 heads, graph replay (benchmarks/results/prefill_tiles_h200.md), rows = tokens x the
        # group's heads, one 8k prompt / 8 x 1k, us: 256x64 at 16 warps, 3 stages 1387 / 289 (396 TFLOP/s);
        # at 8 warps 1406 / 306 (and 1.3x slower with softcap: 8 warps spill); 128x128/8 1656 / 357; 256x32
        # 1864+; 256x128 (2 stages) 2066. The 256-row tile needs 160 KiB of shared memory: Hopper-class only.
        # With each key tile's block ids loaded a tile ahead (``bt_ahead``, attention_common._tile_run: the K/V
        # copies run two tiles ahead; benchmarks/results/prefill_tiles_h200_ahead.md): 1392 -> 1214 us (453 TFLOP/s),
        # 8 x 1k 289 -> 269, the mixed batch's prefill kernel 677 -> 590; 2 stages with it 1406 (no deeper
        # pipeline), 4 stages 1217. Other head sizes and tiles are not measured with it, so they keep it off.
        # The FEATURES compile (softcap, window, ALiBi, sinks, non-causal) at 64 keys spills 288 bytes a thread
        # (the 512 threads get 128 registers each), and ptxas serialises its wgmma (so does the plain one's, at 96
        # bytes); at 32 keys, 4 stages: 32 bytes, not serialised. H200 (prefill_features_tiles_h200.md), one 8k prompt:
        # softcap 30 2450 -> 2224 us, a 4096-key window 1241 -> 1186; repeated against 64 keys with ALiBi and sinks
        # (prefill_features_alibi_sinks_h200.md): 1635 -> 1468, 1638 -> 1465, 8 x 1k softcap 456 -> 415. Not for
        # the plain compile (1217 -> 1330: the per-tile costs double) nor fp8 caches (1764 -> 1984; softcap 2820 ->
        # 2941).
        if big_smem and features and kv_itemsize == 2:
            return PrefillConfig(block_m=256, block_n=32, num_warps=16, num_stages=4, bt_ahead=True)
        # The diagonal tiles in the interior loop (``one_run``), H200, bf16 32/8 heads d128, 8192 tokens in all,
        # graph replay (prefill_one_loop_h200.md, PSCALE lines, two runs), us: 64 x 128 133 -> 123, 32 x 256 148
        # -> 137, 16 x 512 184 -> 174, 8 x 1k 259 -> 253, 4 x 2k 414 -> 411; but 2 x 4k 711 -> 718, 1 x 8k 1214 ->
        # 1233, the mixed batch 1042 -> 1052; fp8 caches lose (8 x 1k 342 -> 356). So for bf16/fp16 caches whose
        # sequences have at most ONE_RUN_KEYS keys only.
        if big_smem:
            return PrefillConfig(block_m=256, block_n=64, num_warps=16, num_stages=3, bt_ahead=True,
                                 one_run=short_keys and kv_itemsize == 2 and not features)
        return PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)
    return PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)  # block_n 64 spills (sm80/sm90)


def concurrent_prefill(hip: bool) -> bool:
    """Run a mixed batch's prefill launch on a stream of its own beside the decode launch?

    The decodes move bytes, the prefill runs matrix products: side by side they share the GPU instead of taking
    turns. H200, bf16 32/8 heads d128, graph replay (benchmarks/results/prefill_side_stream_h200.md): 4 chunks of
    1024 on 3072 cached tokens + 60 decodes of 8k 1076 -> 1035 us; 8 prompts of 1k (the decode launch's programs
    all return) 267 -> 260. AMD: not measured, so off. ``override(concurrent_prefill=)`` forces it.
    """
    forced = _OVERRIDES.get("concurrent_prefill")
    if forced is not None:
        return bool(forced)
    return not hip


def fused_reduce(device: torch.device) -> bool:
    """Merge split-KV partials in the decode kernel itself, or in a second launch (``reduce_kernel``)?

    H200, bf16 32/8 heads d128, GPU time: the separate reduce is faster (batch 1 x 8k: 23.0 us
    against 31.3; batch 8 x 8k: 82 against 86), but each Triton launch costs ~30-50 us of host
    time, which a plain eager call cannot hide (do_bench of the eager call: 32 us in-kernel
    against 60-160 us). So: two launches while a CUDA/HIP graph is being captured (only GPU
    time counts at replay), one otherwise.
    """
    forced = _OVERRIDES.get("decode_fused_reduce")
    if forced is not None:
        return bool(forced)
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def launch_options(num_warps: int, num_stages: int, waves_per_eu: int, hip: bool | None = None,
                   interp: bool | None = None, maxnreg: int = 0) -> dict[str, int]:
    """Keyword options for a kernel launch; ``waves_per_eu`` only where Triton-ROCm takes it, ``maxnreg``
    only where Triton's NVIDIA backend does."""
    opts = {"num_warps": num_warps, "num_stages": num_stages}
    hip = is_hip() if hip is None else hip
    interp = interpreting() if interp is None else interp
    if hip and waves_per_eu and not interp:
        opts["waves_per_eu"] = waves_per_eu
    if maxnreg and not hip and not interp:
        opts["maxnreg"] = maxnreg
    return opts


# Host time matters at batch 1 (the whole decode is ~10 us on the GPU): one dict lookup per call.
_decode_cached = functools.lru_cache(maxsize=4096)(_decode_config)

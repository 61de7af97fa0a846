#!/usr/bin/env python
"""KV write against the pattern of its destination slots: where the gap to a copy comes from.

    python benchmarks/sweep_kv_write_slots.py

The write kernel moves the same bytes as a copy (read K and V, write them) plus one slot
index a token. On the H200 it reaches 93-94 % of a same-size copy with random slots
(kv_write_tiles_h200.md) and no tile or warp count changes that. This sweep holds the kernel
fixed and varies only where the tokens land: in token order (slot = token, a copy with an
index load), random slots, the same slots sorted, whole blocks in random or sorted order, over
caches 1x, 2x and 8x the written tokens, and whole 2 MiB pages of blocks (64 blocks of K) in random
order with the blocks shuffled within each page, the grouping kvcached's block pool gives (it fills a
page's blocks before it takes another page). Then the write into a real kvcached cache (virtual
memory, both layouts, 4 layers) at the slots its ``KVCacheManager`` hands out to a batch of new
prompts, from a fresh pool and after the pool has churned (prompts allocated and freed at random),
and the same slots in a plain cache. Beside ours, vLLM's CUDA ``reshape_and_cache_flash``
on the same data where vLLM is importable (the row says so where it is not).

65,536 tokens x 8 KV heads x head 128, bf16, block 16; graph replay, best of 3 captures; the
copy row is ``y.copy_(x)`` of the same K+V bytes. Each row checks every token bit for bit.
"""

from __future__ import annotations

import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _bench_common import Table, environment, gpu_slug, graph_time_us, write_report  # noqa: E402

from kvcached.kernels import write_kv_cache  # noqa: E402

DEV = torch.device("cuda")
T, H, D, BS = 65536, 8, 128, 16
PAGE_BLOCKS = (2 << 20) // (BS * H * D * 2)  # blocks of one layer's K in a 2 MiB page (per-layer layout)
LAYERS = 4  # the kvcached rows' cache: enough layers that the contiguous layout spreads a layer's blocks
BYTES_NOTE = "- TB/s counts K and V read and written (the copy's bytes); the slot indices, 8 B a token, are left out"


def _patterns(num_blocks: int) -> dict[str, torch.Tensor]:
    perm = torch.randperm(num_blocks * BS, device=DEV)[:T]
    blocks = torch.randperm(num_blocks, device=DEV)[: T // BS]
    within = torch.arange(BS, device=DEV)
    pages = torch.randperm(num_blocks // PAGE_BLOCKS, device=DEV)[: T // BS // PAGE_BLOCKS]
    in_page = torch.argsort(torch.rand(len(pages), PAGE_BLOCKS, device=DEV), dim=1)
    paged = (pages[:, None] * PAGE_BLOCKS + in_page).flatten()
    pats = {
        "token order (slot = token)": torch.arange(T, device=DEV),
        "random slots": perm,
        "random slots, sorted": perm.sort().values,
        "whole blocks, random order": (blocks[:, None] * BS + within).flatten(),
        "whole blocks, sorted": (blocks.sort().values[:, None] * BS + within).flatten(),
        "whole pages (64 blocks) in random order, blocks shuffled within": (paged[:, None] * BS + within).flatten(),
    }
    return {k: v.to(torch.int64).contiguous() for k, v in pats.items()}


def _prompt_slots(mgr, rng: random.Random) -> torch.Tensor:
    """Slots of new prompts (256-8k tokens, T in all) as ``mgr`` hands out their blocks, in prompt order."""
    out, left = [], T
    while left:
        n = min(rng.randint(256, 8192), left)
        blocks = torch.tensor(mgr.alloc_or_raise(-(-n // BS)), device=DEV)
        out.append((blocks[:, None] * BS + torch.arange(BS, device=DEV)).flatten()[:n])
        left -= n
    return torch.cat(out)


def _churn(mgr, rng: random.Random, rounds: int = 40) -> None:
    """Prompts allocated up to 1.5x a batch's blocks, then a random half freed, ``rounds`` times."""
    live: list[list[int]] = []
    for _ in range(rounds):
        while mgr.num_allocated_blocks() < 3 * T // BS // 2:
            live.append(mgr.alloc_or_raise(rng.randint(1, 256)))
        rng.shuffle(live)
        for blocks in live[: len(live) // 2]:
            mgr.free(blocks)
        live = live[len(live) // 2:]


def _kvcached_rows(tab: Table, lines: list[str], key: torch.Tensor, val: torch.Tensor, t_copy: float,
                   moved: int) -> None:
    """The write into a kvcached cache at the slots its allocator gives, fresh and after churn."""
    from kvcached.integration.vllm import interfaces as vi
    from kvcached.kv_cache_manager import KVCacheManager

    for contiguous in (False, True):
        name = f"kvcached {'contiguous' if contiguous else 'per-layer'}, {LAYERS} layers"
        vi.init_kvcached(device=DEV.type, contiguous_layout=contiguous)
        try:
            views, meta = vi.alloc_kv_cache((2, 1, BS, H, D), BS, torch.bfloat16, DEV.type, LAYERS,
                                              return_meta=True)
            mgr = KVCacheManager(meta["num_blocks_per_layer"], BS, H * D * 2, LAYERS, reserve_null_block=False)
            rng = random.Random(0)
            for pattern in ("kvcached's allocator, fresh pool", "kvcached's allocator after churn"):
                if pattern.endswith("churn"):
                    _churn(mgr, rng)
                slots = _prompt_slots(mgr, rng)
                blocks = slots // BS
                pages = (blocks // mgr.blocks_per_page).unique().numel()
                lines.append(f"- {name}, {pattern}: {T // BS} blocks over {pages} pages of {mgr.blocks_per_page} "
                             f"blocks, highest block {int(blocks.max())}")
                caches = [(name, views[0][0], views[0][1])]
                if not contiguous:
                    plain = torch.empty(int(blocks.max()) + 1, BS, H, D, dtype=torch.bfloat16, device=DEV)
                    caches.append(("plain, as large as the highest slot", plain, torch.empty_like(plain)))
                for cache, kc, vc in caches:
                    go = lambda s=slots, k=kc, v=vc: write_kv_cache(key, val, k, v, s)  # noqa: E731
                    _time_write(tab, (cache, pattern, "ours"), go, slots, kc, vc, key, val, t_copy, moved)
                del caches
                mgr.free(sorted(set(blocks.tolist())))
        finally:
            vi.shutdown_kvcached()


def _time_write(tab: Table, cells: tuple[str, str, str], go, slots: torch.Tensor, kc: torch.Tensor,
                vc: torch.Tensor, key: torch.Tensor, val: torch.Tensor, t_copy: float, moved: int) -> None:
    """One row: ``go`` writes key/val at ``slots``; checked bit for bit, then timed. ``cells``: cache, slots, impl."""
    blk, off = slots // BS, slots % BS
    kc[blk, off] = 0  # only the written slots: a kvcached cache maps nothing else
    vc[blk, off] = 0
    go()
    ok = torch.equal(kc[blk, off], key) and torch.equal(vc[blk, off], val)
    t = min(graph_time_us(go, DEV) for _ in range(3))
    tab.add(*cells, t, moved / t / 1e6, 100 * t_copy / t, "ok" if ok else "WRONG")
    print(tab.rows[-1], flush=True)


def _vllm_write():
    try:
        from vllm import _custom_ops as ops

        return ops.reshape_and_cache_flash
    except Exception as exc:  # absent or not built for this GPU: the table says so
        return repr(exc)[:120]


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("sweep_kv_write_slots.py times GPU kernels: it needs a CUDA or ROCm GPU.")
    key = torch.randn(T, H, D, dtype=torch.bfloat16, device=DEV)
    val = torch.randn(T, H, D, dtype=torch.bfloat16, device=DEV)
    moved = 2 * T * H * D * 2 * 2
    x = torch.cat([key.flatten(), val.flatten()])
    y = torch.empty_like(x)
    t_copy = min(graph_time_us(lambda: y.copy_(x), DEV) for _ in range(3))
    one = torch.ones(1, device=DEV)
    theirs = _vllm_write()
    tab = Table(f"KV write by destination pattern ({T:,} tokens)",
                ["cache / tokens", "slots", "impl", "us (best of 3)", "TB/s", "% of same-size copy", "check"])
    tab.add("-", "-", "copy (y.copy_(x))", t_copy, moved / t_copy / 1e6, 100.0, "-")
    lines = [BYTES_NOTE]
    if isinstance(theirs, str):
        lines.append(f"- vLLM's reshape_and_cache_flash: not measured ({theirs})")
    for span in (1, 2, 8):
        kc = torch.zeros(T // BS * span, BS, H, D, dtype=torch.bfloat16, device=DEV)
        vc = torch.zeros_like(kc)
        for name, slots in _patterns(kc.shape[0]).items():
            impls = [("ours", lambda s=slots, k=kc, v=vc: write_kv_cache(key, val, k, v, s))]
            if not isinstance(theirs, str):
                impls.append(("vLLM reshape_and_cache_flash",
                              lambda s=slots, k=kc, v=vc: theirs(key, val, k, v, s, "auto", one, one)))
            for impl, go in impls:
                _time_write(tab, (f"{span}x", name, impl), go, slots, kc, vc, key, val, t_copy, moved)
        del kc, vc
        torch.cuda.empty_cache()
    _kvcached_rows(tab, lines, key, val, t_copy, moved)
    write_report(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                 f"kv_write_slots_{gpu_slug(DEV)}", "KV write by destination pattern", environment(DEV), lines, [tab])


if __name__ == "__main__":
    main()

"""kvcached.kernels.platform.speed_up_interpreter: Triton's interpreter patches the language once a launch.

Only meaningful where the kernels run in the interpreter (no GPU); skipped on a GPU machine.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from kvcached.kernels import attention_config as cfg
from kvcached.kernels.paged_attention import paged_attention
from kvcached.kernels.platform import interpreting, speed_up_interpreter
from kvcached.kernels.reference import paged_kv_case, random_batch

pytestmark = pytest.mark.skipif(not interpreting(), reason="the kernels run compiled here, not in the interpreter")


@contextlib.contextmanager
def _counting_patches(fast: bool):
    """Runs with the speed-up (``fast``) or Triton's own patching; yields a list of the functions patched."""
    import triton.language as tl
    from triton.runtime import interpreter as interp

    assert speed_up_interpreter()
    installed = interp._patch_lang
    original = installed.__wrapped__
    patched: list = []

    def counting(fn):
        patched.append(fn)
        return original(fn)

    installed.__wrapped__ = counting
    interp._patch_lang = installed if fast else counting
    try:
        yield patched
    finally:
        installed.__wrapped__ = original
        interp._patch_lang = installed
    # (triton.language.core may stay patched: Triton never undoes a helper call's patch of it, with or without us)
    assert tl.core.is_builtin(tl.load), "the launch left triton.language patched"


def _attention_case():
    gen = torch.Generator().manual_seed(3)
    k, v, _, _ = paged_kv_case(layout="contiguous", style="flash_attn", num_kv_heads=2, head_size=32, block_size=16,
                               dtype=torch.float16, num_blocks=16, generator=gen, device="cpu")
    q_lens, seq_lens = [1, 24, 2], [40, 50, 33]
    query, bt, sl, qsl = random_batch(q_lens, seq_lens, 4, 32, 16, k.shape[0], torch.float16, generator=gen,
                                      device="cpu")

    def run(softcap: float | None) -> torch.Tensor:
        with cfg.override(decode_num_splits=2):
            return paged_attention(query, k, v, bt, sl, qsl, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
                                   softcap=softcap)

    return run


@pytest.mark.parametrize("softcap", [None, 20.0])
def test_same_bits_with_fewer_patches(softcap):
    run = _attention_case()
    with _counting_patches(fast=False) as slow_patches:
        slow = run(softcap)
    with _counting_patches(fast=True) as fast_patches:
        fast = run(softcap)
    assert torch.equal(fast, slow), "the interpreter gave other results with the speed-up"
    # Triton's own: a patch at each launch and at every helper call (once a key tile); ours: the launches only,
    # and helpers whose module sees another language module than the kernel's (none of ours)
    launches = {getattr(fn, "__name__", "") for fn in fast_patches}
    assert len(slow_patches) > 4 * len(fast_patches), (len(slow_patches), len(fast_patches))
    assert launches <= {"decode_kernel", "prefill_kernel", "reduce_kernel", "reduce_rows_kernel"}, launches


class _Helper:
    """Stands for a jit helper: only its ``__globals__`` matter to the patch."""

    def __init__(self, **globals_):
        self.__globals__ = globals_


def test_patches_exactly_the_modules_not_yet_patched():
    import triton.language as tl
    from triton.runtime import interpreter as interp

    assert speed_up_interpreter()
    installed = interp._patch_lang
    original = installed.__wrapped__
    calls: list = []
    installed.__wrapped__ = lambda fn: calls.append(fn) or original(fn)
    with_tl, with_core = _Helper(tl=tl), _Helper(core=tl.core)
    try:
        assert tl.core.is_builtin(tl.load)
        core_patched = not tl.core.is_builtin(tl.core.load)  # Triton leaves it so after a launch's helpers
        launch = installed(with_tl)  # nothing patched yet: Triton's patch
        assert calls == [with_tl] and not tl.core.is_builtin(tl.load)
        installed(with_tl).restore()  # triton.language patched: an empty scope
        assert calls == [with_tl] and not tl.core.is_builtin(tl.load)
        inner = installed(with_core)  # triton.language.core: Triton's patch unless it is patched already
        assert calls == ([with_tl] if core_patched else [with_tl, with_core])
        assert not tl.core.is_builtin(tl.core.load)
        inner.restore()
        launch.restore()
    finally:
        installed.__wrapped__ = original
    assert tl.core.is_builtin(tl.load) and tl.core.is_builtin(tl.core.load) != core_patched

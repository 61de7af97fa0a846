"""Stride-aware Triton kernels for paged KV caches in any layout (NVIDIA and AMD).

Every kernel takes every stride of every tensor as an argument, so the strided
per-layer views of the contiguous layout are read and written correctly.
"""

from kvcached.kernels.platform import interpreting, speed_up_interpreter

if interpreting():
    speed_up_interpreter()

from kvcached.kernels.mla_decode import paged_mla_decode
from kvcached.kernels.paged_attention import paged_attention
from kvcached.kernels.write_kv import write_kv_cache

__all__ = ["paged_attention", "paged_mla_decode", "write_kv_cache"]

"""vLLM attention backend on kvcached's stride-aware Triton kernels.

Registered with vLLM as ``KVCACHED`` (``--attention-backend KVCACHED``), chosen
automatically on ROCm with the contiguous layout (see ``settings``). Each layer's
cache is, on vLLM >= 0.29, its ``[num_blocks, H, block_size, 2 * head_size]`` view
whose last dimension holds K then V of one (token, head), and on vLLM 0.24 - 0.28 the
``(num_blocks, 2, block_size, H, head_size)`` shape this backend declares; whatever the
layer and block strides of kvcached's layout, :func:`split_kv_cache` hands the kernels
K and V as ``[num_blocks, block_size, H, head_size]`` strided views, which they read and
write at the right addresses.

CUDA graphs: the kernels take every length from device tensors and size their grids
from host bounds only, so a graph captured with bounds at least as large as any
replay's is correct for every replay; :meth:`build_for_cudagraph_capture` captures
with the largest bounds the captured batch allows (``AttentionCGSupport.ALWAYS``).

On a machine without a GPU (vLLM's CPU build) the kernels run in Triton's
interpreter: slow, but the same code path, which is what the CPU tests check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import AttentionSpec

from kvcached.integration.common import triton_kernels

try:  # vLLM >= 0.29 names its KV layouts; older versions ask get_kv_cache_shape instead
    from vllm.v1.kv_cache_interface import KVCacheLayout
except ImportError:
    KVCacheLayout = None
try:
    from vllm.v1.attention.backend import AttentionCGSupport
except ImportError:  # pragma: no cover - every supported vLLM has it
    AttentionCGSupport = None

HEAD_SIZES = [32, 64, 80, 96, 128, 256]
BLOCK_SIZES = [16, 32, 64, 128]


def split_kv_cache(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's layer cache -> K and V ``[B, N, H, D]`` (views, any strides).

    ``[B, H, N, 2 * D]`` (vLLM >= 0.29) or ``(B, 2, N, H, D)`` (:meth:`KVCachedAttentionBackend.get_kv_cache_shape`).
    """
    if kv_cache.dim() == 5 and kv_cache.shape[1] == 2 and kv_cache.shape[-1] == head_size:
        k, v = kv_cache.unbind(1)
        return k, v
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
        raise ValueError(
            f"kvcached backend expects a [num_blocks, heads, block_size, 2 * {head_size}] or [num_blocks, 2, "
            f"block_size, heads, {head_size}] KV cache, got {tuple(kv_cache.shape)}."
        )
    per_token = kv_cache.transpose(1, 2)
    return per_token[..., :head_size], per_token[..., head_size:]


@dataclass
class KVCachedAttentionMetadata:
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool = True
    # no request has fewer new tokens (host side): a step of prefills only spares the decode kernel's launch
    min_query_len: int = 1


def _mixed_batches_in_full_graphs(vllm_config: Any) -> bool:
    mode = getattr(vllm_config.compilation_config, "cudagraph_mode", None)
    mixed = getattr(mode, "mixed_mode", None)
    return mixed is not None and getattr(mixed(), "name", "") == "FULL"


class KVCachedAttentionMetadataBuilder(AttentionMetadataBuilder[KVCachedAttentionMetadata]):
    if AttentionCGSupport is not None:
        _cudagraph_support: ClassVar[Any] = AttentionCGSupport.ALWAYS

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: Any,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.max_model_len = int(vllm_config.model_config.max_model_len)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> KVCachedAttentionMetadata:
        """Metadata for a graph that later batches of the same shape replay.

        A replay runs the kernels captured here with this call's grid and plan, so they
        are chosen for the worst case of the captured shape: any context up to
        ``max_model_len``, and any query length up to the batch's token count, except
        where every full graph is a uniform (decode or speculative-decode) batch, whose
        replays have the captured query length. Only ``cudagraph_mode=FULL`` captures
        mixed batches in full graphs, and its dummy mixed batch can look uniform.
        """
        m = self.build(0, common_attn_metadata)
        m.min_query_len = 1  # replays may hold decodes whatever the captured batch held
        if _mixed_batches_in_full_graphs(self.vllm_config):
            m.max_query_len = max(m.max_query_len, int(m.num_actual_tokens))
        m.max_seq_len = max(m.max_seq_len, self.max_model_len)
        return m

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KVCachedAttentionMetadata:
        m = common_attn_metadata
        if isinstance(m.causal, torch.Tensor):
            raise NotImplementedError("the kvcached backend does not support per-request causal masks.")
        min_query_len = 1
        qsl_cpu = getattr(m, "query_start_loc_cpu", None)
        if m.max_query_len > 1 and qsl_cpu is not None and qsl_cpu.numel() > 1:
            # eager steps only (a full graph is built by build_for_cudagraph_capture): one host min per step
            min_query_len = max(1, int((qsl_cpu[1:] - qsl_cpu[:-1]).min()))
        return KVCachedAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            min_query_len=min(min_query_len, int(m.max_query_len)),
            max_query_len=int(m.max_query_len),
            max_seq_len=int(m.max_seq_len),
            query_start_loc=m.query_start_loc.to(torch.int32),
            seq_lens=m.seq_lens.to(torch.int32),
            block_table=m.block_table_tensor.to(torch.int32),
            slot_mapping=m.slot_mapping,
            causal=bool(m.causal),
        )


class KVCachedAttentionImpl(AttentionImpl[KVCachedAttentionMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None) -> None:
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"the kvcached backend supports decoder attention only, not {attn_type}.")
        if kv_cache_dtype not in ("auto", "float16", "bfloat16"):
            raise NotImplementedError(
                f"the kvcached backend in vLLM does not support kv_cache_dtype={kv_cache_dtype!r} yet; use auto."
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.alibi_slopes = None if alibi_slopes is None else torch.tensor(alibi_slopes, dtype=torch.float32)
        self.sliding_window = sliding_window if sliding_window and sliding_window > 0 else None
        self.kv_cache_dtype = kv_cache_dtype
        self.logits_soft_cap = logits_soft_cap if logits_soft_cap else None
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sinks = sinks
        self.kernels = triton_kernels()

    def do_kv_cache_update(self, layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        if self.kv_sharing_target_layer_name is not None:
            return
        n = min(key.shape[0], slot_mapping.shape[0])
        k_cache, v_cache = split_kv_cache(kv_cache, self.head_size)
        self.kernels.write_kv_cache(key[:n], value[:n], k_cache, v_cache, slot_mapping[:n])

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: KVCachedAttentionMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("the kvcached backend does not fuse output quantization.")
        if attn_metadata is None:  # profiling run
            return output
        n = attn_metadata.num_actual_tokens
        k_cache, v_cache = split_kv_cache(kv_cache, self.head_size)
        out = output[:n].view(n, self.num_heads, self.head_size)
        alibi = None if self.alibi_slopes is None else self.alibi_slopes.to(query.device)
        sinks = None if self.sinks is None else self.sinks.to(device=query.device, dtype=torch.float32)
        self.kernels.paged_attention(
            query[:n], k_cache, v_cache, attn_metadata.block_table, attn_metadata.seq_lens,
            attn_metadata.query_start_loc, max_query_len=attn_metadata.max_query_len,
            max_seq_len=attn_metadata.max_seq_len, scale=self.scale, causal=attn_metadata.causal,
            sliding_window=self.sliding_window, softcap=self.logits_soft_cap, alibi_slopes=alibi, sinks=sinks,
            out=out, min_query_len=attn_metadata.min_query_len,
        )
        return output


class KVCachedAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto", "float16", "bfloat16"]

    @staticmethod
    def get_name() -> str:
        return "KVCACHED"

    @staticmethod
    def get_impl_cls() -> type[KVCachedAttentionImpl]:
        return KVCachedAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[KVCachedAttentionMetadataBuilder]:
        return KVCachedAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[Any]:
        return list(BLOCK_SIZES)

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        """vLLM 0.24 - 0.28 shape each layer's cache from this: blocks first, so a page stays whole."""
        return (num_blocks, 2, block_size, num_kv_heads, head_size)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(HEAD_SIZES)

    if KVCacheLayout is not None:
        @classmethod
        def supported_kv_cache_layouts(cls) -> tuple[Any, ...]:
            # token-major block interiors read best; the kernels take any strides anyway
            return (KVCacheLayout.LBNHC, KVCacheLayout.LBHNC)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_sink(cls) -> bool:
        return True

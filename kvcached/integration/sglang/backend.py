"""SGLang attention backend on kvcached's stride-aware Triton kernels (``--attention-backend kvcached``).

Registered with SGLang by kvcached's plugin when ``ENABLE_KVCACHED=true`` (as the vLLM backend is under vLLM).
Each layer's ``[size + page_size, H, D]`` K and V buffers, SGLang's own or kvcached's views in either layout,
are read as ``[pages, page_size, H, D]`` with whatever strides they have; a request's pages come from SGLang's
``req_to_token`` table (the slot of its token ``j * page_size`` is ``page * page_size``), so the kernels see
the block table and sequence lengths vLLM's would. New K/V go in with kvcached's write kernel.

Supported: decoder self-attention of MHA/GQA models with K and V of one head size, pages of 1 - 128 tokens,
prefill, chunked prefill over a cached prefix, mixed and decode batches, tanh logit caps and attention sinks,
decode CUDA graphs (buffers filled before each replay, kernels planned for the longest context) and SGLang's
breakable prefill graphs (attention runs eagerly there). With pages of one token the block table is the slots
themselves (a table entry per key; larger pages share one among a page's keys). Refused with an error naming
the way out: pages of more than 128 tokens, MLA, sliding windows, speculative decoding, cross-attention, fp8 KV
caches and full (not breakable) prefill graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from kvcached.errors import KVCachedConfigError
from kvcached.integration.common import triton_kernels

NAME = "kvcached"
# the kernels' block sizes (kvcached.kernels.paged_attention.BLOCK_SIZES, not imported here: the kernels must
# be imported after triton_kernels() has chosen the interpreter on a machine without a GPU)
PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass
class Metadata:
    block_table: torch.Tensor  # int32 [batch, pages]
    seq_lens: torch.Tensor  # int32 [batch]: tokens in the cache after this step's are written
    query_start_loc: torch.Tensor  # int32 [batch + 1]
    max_query_len: int
    max_seq_len: int
    min_query_len: int | None = None  # eager steps only: a step of prefills spares the decode kernel's launch


def _refuse(what: str, way_out: str) -> None:
    raise KVCachedConfigError(f"kvcached's SGLang attention backend does not support {what}; {way_out}.")


def create(model_runner: Any) -> KVCachedAttnBackend:
    """SGLang's factory signature (``attention_registry.register_attention_backend``)."""
    return KVCachedAttnBackend(model_runner)


class KVCachedAttnBackend(AttentionBackend):
    def __init__(self, model_runner: Any) -> None:
        super().__init__()
        other = "use --attention-backend triton for it"
        self.page_size = int(getattr(model_runner, "page_size", 1) or 1)
        if self.page_size not in PAGE_SIZES:
            _refuse(f"pages of {self.page_size} tokens", f"start SGLang with --page-size 16 (any of {PAGE_SIZES})")
        if getattr(model_runner, "use_mla_backend", False):
            _refuse("MLA models", other)
        window = getattr(model_runner, "sliding_window_size", None)
        if window is not None and window > 0:
            _refuse(f"sliding-window attention (window {window})", other)
        spec = getattr(model_runner.server_args, "speculative_algorithm", None)
        if spec:
            _refuse(f"speculative decoding ({spec})", other)
        kv_dtype, dtype = getattr(model_runner, "kv_cache_dtype", None), getattr(model_runner, "dtype", None)
        if kv_dtype is not None and dtype is not None and kv_dtype != dtype:
            _refuse(f"a {kv_dtype} KV cache under a {dtype} model", "start SGLang with --kv-cache-dtype auto")
        self.device = torch.device(model_runner.device)
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.pool = model_runner.token_to_kv_pool
        # every context a request can have fits the table's row; graphs are planned for that longest one
        self.max_pages = -(-self.req_to_token.shape[1] // self.page_size)
        self.kernels = triton_kernels()
        self.forward_metadata: Metadata | None = None
        self._graph: dict[str, torch.Tensor] | None = None
        self._layers: dict[int, tuple[torch.Tensor, torch.Tensor, float | None]] = {}  # see _layer

    # ---- metadata ----------------------------------------------------------------------------------------

    def _block_table(self, req_pool_indices: torch.Tensor, pages: int) -> torch.Tensor:
        rows = self.req_to_token[req_pool_indices, : pages * self.page_size : self.page_size]
        return torch.div(rows, self.page_size, rounding_mode="floor").to(torch.int32)

    @staticmethod
    def _check_mode(forward_batch: Any) -> None:
        mode = forward_batch.forward_mode
        if not (mode.is_decode_or_idle() or mode.is_extend()) or mode.is_target_verify() or \
                mode.is_split_prefill() or mode.is_dllm_extend():
            _refuse(f"the {mode.name} forward mode", "use --attention-backend triton for it")
        if getattr(forward_batch, "encoder_lens", None) is not None:
            _refuse("encoder-decoder models (cross-attention)", "use --attention-backend triton for them")

    def init_forward_metadata(self, forward_batch: Any) -> None:
        """Eager steps (and the attention of SGLang's breakable prefill graphs, which runs outside them)."""
        self._check_mode(forward_batch)
        if forward_batch.forward_mode.is_idle():
            self.forward_metadata = None
            return
        bs = forward_batch.batch_size
        seq_cpu = getattr(forward_batch, "seq_lens_cpu", None)
        max_seq = int(seq_cpu[:bs].max()) if seq_cpu is not None else int(forward_batch.seq_lens[:bs].max())
        if forward_batch.forward_mode.is_decode():
            qsl = torch.arange(bs + 1, dtype=torch.int32, device=self.device)
            max_q = min_q = 1
        else:
            lens = list(forward_batch.extend_seq_lens_cpu)
            qsl = torch.zeros(bs + 1, dtype=torch.int32, device=self.device)
            torch.cumsum(forward_batch.extend_seq_lens[:bs], 0, dtype=torch.int32, out=qsl[1:])
            max_q, min_q = max(lens), min(lens)
        self.forward_metadata = Metadata(
            block_table=self._block_table(forward_batch.req_pool_indices[:bs], -(-max_seq // self.page_size)),
            seq_lens=forward_batch.seq_lens[:bs].to(torch.int32), query_start_loc=qsl, max_query_len=max_q,
            max_seq_len=max_seq, min_query_len=min_q)

    # ---- decode CUDA graphs ------------------------------------------------------------------------------

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        dev, i32 = self.device, torch.int32
        self._graph = {"block_table": torch.zeros(max_bs, self.max_pages, dtype=i32, device=dev),
                       "seq_lens": torch.ones(max_bs, dtype=i32, device=dev),
                       "query_start_loc": torch.arange(max_bs + 1, dtype=i32, device=dev)}

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False) -> None:
        """Before a graph's capture and before each replay: fill the graph's buffers from this batch.

        The captured kernels read these buffers' addresses and plan for the longest context a request can have,
        so a replay of any batch of the captured size is correct; only decode batches are captured."""
        self._check_mode(forward_batch)
        if not forward_batch.forward_mode.is_decode_or_idle() or forward_batch.spec_info is not None:
            _refuse(f"full CUDA graphs of {forward_batch.forward_mode.name} batches",
                    "keep SGLang's default breakable prefill graphs, or --disable-prefill-cuda-graph")
        if self._graph is None:
            raise RuntimeError("init_cuda_graph_state() must come before a graph's metadata")
        g, bs = self._graph, forward_batch.batch_size
        g["seq_lens"][:bs].copy_(forward_batch.seq_lens[:bs])
        g["block_table"][:bs].copy_(self._block_table(forward_batch.req_pool_indices[:bs], self.max_pages))
        if in_capture:
            self.forward_metadata = Metadata(
                block_table=g["block_table"][:bs], seq_lens=g["seq_lens"][:bs],
                query_start_loc=g["query_start_loc"][: bs + 1], max_query_len=1,
                max_seq_len=self.max_pages * self.page_size)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    # ---- attention ---------------------------------------------------------------------------------------

    def _layer(self, layer: Any) -> tuple[torch.Tensor, torch.Tensor, float | None]:
        """The layer's K and V as ``[pages, page_size, H, D]`` views (any strides: kvcached's layouts) and its
        softcap, checked and made at its first call (a pool's buffers stay where they are)."""
        got = self._layers.get(layer.layer_id)
        if got is not None:
            return got
        if layer.is_cross_attention or getattr(getattr(layer, "attn_type", None), "value", "decoder") != "decoder":
            _refuse("attention other than decoder self-attention", "use --attention-backend triton for it")
        if layer.qk_head_dim != layer.v_head_dim:
            _refuse(f"K head size {layer.qk_head_dim} with V head size {layer.v_head_dim}", "use the triton backend")
        if getattr(layer, "sliding_window_size", -1) > -1:
            _refuse(f"sliding-window layers (window {layer.sliding_window_size})", "use --attention-backend triton")
        cap = float(layer.logit_cap or 0.0)
        if cap > 0 and getattr(layer, "logit_capping_method", "tanh") != "tanh":
            _refuse(f"logit capping {layer.logit_capping_method!r}", "use --attention-backend triton for it")
        views = []
        for buf in (self.pool.get_key_buffer(layer.layer_id), self.pool.get_value_buffer(layer.layer_id)):
            rows = buf.shape[0] // self.page_size * self.page_size
            views.append(buf[:rows].unflatten(0, (-1, self.page_size)))
        got = self._layers[layer.layer_id] = (views[0], views[1], cap if cap > 0 else None)
        return got

    def _attend(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: Any,
                forward_batch: Any, save_kv_cache: bool, sinks: torch.Tensor | None, **kwargs: Any) -> torch.Tensor:
        for name in ("score_mod", "aux_tensors"):
            if kwargs.get(name) is not None:
                _refuse(f"{name}", "use --attention-backend triton for it")
        k_cache, v_cache, softcap = self._layer(layer)
        heads, dim = layer.tp_q_head_num, layer.qk_head_dim
        if save_kv_cache and k is not None:
            loc = forward_batch.out_cache_loc
            n = min(k.shape[0], loc.shape[0])
            kv_heads = layer.tp_k_head_num
            self.kernels.write_kv_cache(k[:n].reshape(n, kv_heads, dim), v[:n].reshape(n, kv_heads, dim), k_cache,
                                        v_cache, loc[:n])
        q = q.reshape(-1, heads, dim)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        m = self.forward_metadata
        if m is None:
            raise RuntimeError("init_forward_metadata() must run before the attention of a step")
        self.kernels.paged_attention(
            q, k_cache, v_cache, m.block_table, m.seq_lens, m.query_start_loc, max_query_len=m.max_query_len,
            max_seq_len=m.max_seq_len, scale=layer.scaling, causal=True, softcap=softcap,
            sinks=None if sinks is None else sinks.to(torch.float32).contiguous(), out=out,
            min_query_len=m.min_query_len)
        return out.view(-1, heads * dim)

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: Any,
                       forward_batch: Any, save_kv_cache: bool = True, sinks: torch.Tensor | None = None,
                       **kwargs: Any) -> torch.Tensor:
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache, sinks, **kwargs)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: Any,
                       forward_batch: Any, save_kv_cache: bool = True, sinks: torch.Tensor | None = None,
                       **kwargs: Any) -> torch.Tensor:
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache, sinks, **kwargs)

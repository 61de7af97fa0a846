"""kvcached's SGLang attention backend (``--attention-backend kvcached``) against SGLang's own classes, on the CPU.

SGLang's pools and allocators (its own, and kvcached's in both layouts), its ``ReqToTokenPool`` and
``RadixAttention`` layers; the backend's kernels in Triton's interpreter. Every output is checked against a
float64 attention over the K/V each request was given, through prefill, chunked prefill over a cached prefix,
a mixed batch and decode, eagerly and through the decode-graph path (buffers filled at capture, refilled for a
later batch that the captured metadata must then serve). Skipped, with the reason, where SGLang does not import.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.sglang_support import exact_mapping_env, sglang_missing

MISSING = sglang_missing()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")

LAYERS, HEADS, KV_HEADS, DIM, PAGE = 2, 4, 2, 64, 16
DT = torch.bfloat16
SIZE, CONTEXT = 1024, 256


def _runner(pool, page: int = PAGE, **over) -> SimpleNamespace:
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    runner = SimpleNamespace(page_size=page, device="cpu", token_to_kv_pool=pool, use_mla_backend=False,
                             sliding_window_size=None, server_args=SimpleNamespace(speculative_algorithm=None),
                             kv_cache_dtype=DT, dtype=DT,
                             req_to_token_pool=ReqToTokenPool(size=8, max_context_len=CONTEXT, device="cpu",
                                                              enable_memory_saver=False))
    runner.__dict__.update(over)
    return runner


@pytest.fixture(params=[("sglang", 16), ("contiguous", 16), ("per_layer", 16), ("sglang", 1), ("contiguous", 1)],
                ids=lambda p: f"{p[0]}-page{p[1]}")
def setup(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """(runner, allocator): SGLang's own pool, or kvcached's in one of its layouts; pages of 16 or 1 token."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    kind, page = request.param
    pool_cls, token_cls, paged_cls = MHATokenToKVPool, TokenToKVPoolAllocator, PagedTokenToKVPoolAllocator
    if kind != "sglang":
        exact_mapping_env(monkeypatch, kind == "contiguous", host_mb=96)
        import sglang.srt.mem_cache.kv_cache_configurator as cfg

        from kvcached.integration.sglang import patches

        patches.apply()
        pool_cls, token_cls, paged_cls = (cfg.MHATokenToKVPool, cfg.TokenToKVPoolAllocator,
                                          cfg.PagedTokenToKVPoolAllocator)
    pool = pool_cls(SIZE, page_size=page, dtype=DT, head_num=KV_HEADS, head_dim=DIM, layer_num=LAYERS,
                    device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    if page == 1:
        alloc = token_cls(SIZE, dtype=DT, device="cpu", kvcache=pool, need_sort=False)
    else:
        alloc = paged_cls(SIZE, page_size=page, dtype=DT, device="cpu", kvcache=pool, need_sort=False)
    yield _runner(pool, page), alloc
    if kind != "sglang":
        from kvcached.integration.sglang import interfaces

        interfaces.shutdown_kvcached()


class Requests:
    """Requests as SGLang's scheduler keeps them: a row of ``req_to_token`` each, slots from the allocator,
    and here also every token's K/V per layer (the reference's input)."""

    def __init__(self, runner: SimpleNamespace, alloc, n: int) -> None:
        self.r2t = runner.req_to_token_pool.req_to_token
        self.alloc = alloc
        self.rows = list(range(1, n + 1))
        self.lens = [0] * n
        self.k = [[torch.empty(0, KV_HEADS, DIM, dtype=DT) for _ in range(n)] for _ in range(LAYERS)]
        self.v = [[torch.empty(0, KV_HEADS, DIM, dtype=DT) for _ in range(n)] for _ in range(LAYERS)]
        self.gen = torch.Generator().manual_seed(0)

    def step(self, which: list[int], new: list[int], decode: bool = False):
        """Slots for ``new`` tokens of requests ``which`` (SGLang's paged allocation) and the forward batch."""
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        prefix = torch.tensor([self.lens[i] for i in which])
        seq = prefix + torch.tensor(new)
        last = torch.tensor([int(self.r2t[self.rows[i], self.lens[i] - 1]) if self.lens[i] else -1 for i in which])
        if self.alloc.page_size == 1:
            locs = self.alloc.alloc(sum(new))
        elif decode:
            locs = self.alloc.alloc_decode(seq, seq, last)
        else:
            locs = self.alloc.alloc_extend(prefix, prefix, seq, seq, last, sum(new))
        assert locs is not None
        start = 0
        for i, n in zip(which, new, strict=True):
            self.r2t[self.rows[i], self.lens[i]: self.lens[i] + n] = locs[start: start + n].to(torch.int32)
            self.lens[i] += n
            start += n
        mode = ForwardMode.DECODE if decode else (ForwardMode.MIXED if min(new) == 1 else ForwardMode.EXTEND)
        return SimpleNamespace(
            forward_mode=mode, batch_size=len(which), req_pool_indices=torch.tensor([self.rows[i] for i in which]),
            seq_lens=seq, seq_lens_cpu=seq.clone(), extend_seq_lens=torch.tensor(new, dtype=torch.int32),
            extend_seq_lens_cpu=list(new), extend_prefix_lens=prefix, out_cache_loc=locs.to(torch.int64),
            encoder_lens=None, spec_info=None)

    def new_kv(self, layer: int, which: list[int], new: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        ks, vs = [], []
        for i, n in zip(which, new, strict=True):
            k = torch.randn(n, KV_HEADS, DIM, generator=self.gen).to(DT)
            v = torch.randn(n, KV_HEADS, DIM, generator=self.gen).to(DT)
            self.k[layer][i] = torch.cat([self.k[layer][i], k])
            self.v[layer][i] = torch.cat([self.v[layer][i], v])
            ks.append(k)
            vs.append(v)
        return torch.cat(ks), torch.cat(vs)

    def reference(self, layer: int, which: list[int], new: list[int], q: torch.Tensor) -> torch.Tensor:
        """float64 causal attention of each new token over its request's keys so far."""
        outs, start = [], 0
        for i, n in zip(which, new, strict=True):
            qi = q[start: start + n].view(n, HEADS, DIM).double()
            k = self.k[layer][i].double().repeat_interleave(HEADS // KV_HEADS, dim=1)
            v = self.v[layer][i].double().repeat_interleave(HEADS // KV_HEADS, dim=1)
            s = torch.einsum("qhd,khd->hqk", qi, k) * DIM**-0.5
            total = self.lens[i]
            pos = torch.arange(total - n, total)[:, None]
            s = s.masked_fill(torch.arange(total)[None, :] > pos, float("-inf"))
            outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(n, HEADS * DIM))
            start += n
        return torch.cat(outs)


def _layers():
    from sglang.srt.layers.radix_attention import RadixAttention

    return [RadixAttention(HEADS, DIM, DIM**-0.5, KV_HEADS, layer_id=i) for i in range(LAYERS)]


def _run(backend, reqs: Requests, which: list[int], new: list[int], fb, graph_rows: int = 0) -> None:
    """One step through every layer; each layer's output against the reference. ``graph_rows``: the batch as
    a graph replays it, padded to that many requests (padding writes to SGLang's padding slot 0)."""
    for layer in _layers():
        q = torch.randn(sum(new), HEADS * DIM, generator=reqs.gen).to(DT)
        k, v = reqs.new_kv(layer.layer_id, which, new)
        pad = graph_rows - len(which) if graph_rows else 0
        if pad:
            fb.out_cache_loc = torch.cat([fb.out_cache_loc[: len(which)], torch.zeros(pad, dtype=torch.int64)])
            q, k, v = (torch.cat([t, torch.randn(pad, *t.shape[1:], generator=reqs.gen).to(DT)]) for t in (q, k, v))
        step = backend.forward_decode if fb.forward_mode.is_decode() else backend.forward_extend
        out = step(q, k, v, layer, fb)
        assert out.shape == (q.shape[0], HEADS * DIM)
        want = reqs.reference(layer.layer_id, which, new, q)
        torch.testing.assert_close(out[: sum(new)].double(), want, atol=2e-2, rtol=2e-2)


def test_prefill_chunked_prefill_mixed_and_decode_match_attention(setup):
    from kvcached.integration.sglang.backend import KVCachedAttnBackend

    runner, alloc = setup
    backend = KVCachedAttnBackend(runner)
    reqs = Requests(runner, alloc, 3)
    for which, new, decode in (([0, 1, 2], [21, 40, 7], False),  # prefill, lengths across page boundaries
                               ([0, 1, 2], [1, 1, 1], True),  # decode
                               ([0, 1], [9, 30], False),  # chunked prefill over the cached prefix
                               ([2, 0], [1, 17], False),  # mixed: a decode (one new token) beside a prefill
                               ([0, 1, 2], [1, 1, 1], True)):
        fb = reqs.step(which, new, decode)
        backend.init_forward_metadata(fb)
        assert backend.forward_metadata.min_query_len == min(new)
        _run(backend, reqs, which, new, fb)


def test_decode_graph_buffers_serve_a_later_batch(setup):
    """What a decode graph replays: the metadata made at capture, its buffers refilled for each batch."""
    from kvcached.integration.sglang.backend import KVCachedAttnBackend

    runner, alloc = setup
    backend = KVCachedAttnBackend(runner)
    backend.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    reqs = Requests(runner, alloc, 3)
    fb = reqs.step([0, 1, 2], [30, 14, 50])
    backend.init_forward_metadata(fb)
    _run(backend, reqs, [0, 1, 2], [30, 14, 50], fb)

    def padded(fb):  # SGLang pads a replayed batch to the graph's size: request row 0, length 1 (our fill value)
        fb.batch_size = 4
        fb.req_pool_indices = torch.cat([fb.req_pool_indices, torch.zeros(1, dtype=torch.int64)])
        fb.seq_lens = torch.cat([fb.seq_lens, torch.tensor([backend.get_cuda_graph_seq_len_fill_value()])])
        return fb

    fb = padded(reqs.step([0, 1, 2], [1, 1, 1], decode=True))
    backend.init_forward_metadata_out_graph(fb, in_capture=True)
    captured = backend.forward_metadata
    page = runner.page_size
    assert captured.max_seq_len >= CONTEXT and captured.block_table.shape == (4, CONTEXT // page)
    _run(backend, reqs, [0, 1, 2], [1, 1, 1], fb, graph_rows=4)
    for _ in range(3):  # replays: later lengths, new pages (requests 0 and 1 at 32 -> 33 and 16 -> 17 tokens)
        fb = padded(reqs.step([0, 1, 2], [1, 1, 1], decode=True))
        backend.init_forward_metadata_out_graph(fb)
        assert backend.forward_metadata is captured  # a replay runs the captured kernels on the refilled buffers
        _run(backend, reqs, [0, 1, 2], [1, 1, 1], fb, graph_rows=4)
    assert reqs.lens == [34, 18, 54]


def test_refusals_name_the_way_out(setup):
    from kvcached.errors import KVCachedConfigError
    from kvcached.integration.sglang.backend import KVCachedAttnBackend

    runner, _ = setup
    pool = runner.token_to_kv_pool
    for over, match in (({"page_size": 256}, "--page-size 16"), ({"page_size": 24}, "--page-size 16"),
                        ({"use_mla_backend": True}, "MLA"), ({"sliding_window_size": 4096}, "sliding-window"),
                        ({"server_args": SimpleNamespace(speculative_algorithm="EAGLE")}, "speculative"),
                        ({"kv_cache_dtype": torch.float8_e4m3fn}, "--kv-cache-dtype auto")):
        with pytest.raises(KVCachedConfigError, match=match):
            KVCachedAttnBackend(_runner(pool, **over))
    backend = KVCachedAttnBackend(runner)
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    verify = SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, encoder_lens=None, spec_info=None)
    with pytest.raises(KVCachedConfigError, match="TARGET_VERIFY"):
        backend.init_forward_metadata(verify)
    extend = SimpleNamespace(forward_mode=ForwardMode.EXTEND, encoder_lens=None, spec_info=None, batch_size=1)
    backend.init_cuda_graph_state(max_bs=1, max_num_tokens=1)
    with pytest.raises(KVCachedConfigError, match="graphs of EXTEND batches.*--disable-prefill-cuda-graph"):
        backend.init_forward_metadata_out_graph(extend, in_capture=True)


def test_registered_as_an_sglang_backend(monkeypatch: pytest.MonkeyPatch):
    """The plugin's hooks add ``kvcached`` to SGLang's --attention-backend choices and registry."""
    exact_mapping_env(monkeypatch, False, host_mb=96)
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES

    from kvcached.integration.sglang import patches
    from kvcached.integration.sglang.backend import KVCachedAttnBackend

    patches.apply()
    assert "kvcached" in ATTENTION_BACKEND_CHOICES and ATTENTION_BACKEND_CHOICES.count("kvcached") == 1
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool = MHATokenToKVPool(SIZE, page_size=PAGE, dtype=DT, head_num=KV_HEADS, head_dim=DIM, layer_num=LAYERS,
                            device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    assert isinstance(ATTENTION_BACKENDS["kvcached"](_runner(pool)), KVCachedAttnBackend)


def test_sglang_parses_the_backend_choice(monkeypatch: pytest.MonkeyPatch, tmp_path):
    """SGLang's own argument parsing accepts ``--attention-backend kvcached`` once the hooks are in (choices are
    checked when arguments are parsed, after plugins load), and the backend's page sizes are the kernels'."""
    import sys
    from pathlib import Path

    exact_mapping_env(monkeypatch, False, host_mb=96)
    sys.path.insert(0, str(Path(__file__).parent / "e2e"))
    from sglang.srt.server_args import prepare_server_args
    from tiny_model import make_tiny_model

    from kvcached.integration.sglang import backend, patches

    model = str(make_tiny_model(tmp_path / "m", hidden_size=128, num_heads=4, num_kv_heads=2, num_layers=2))
    patches.apply()
    args = prepare_server_args(["--model-path", model, "--attention-backend", "kvcached", "--device", "cpu"])
    assert args.attention_backend == "kvcached"
    from kvcached.integration.common import triton_kernels

    triton_kernels()  # the interpreter first where there is no GPU
    from kvcached.kernels.paged_attention import BLOCK_SIZES

    assert backend.PAGE_SIZES == BLOCK_SIZES

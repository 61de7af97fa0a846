"""kvcached's SGLang hook against SGLang's own classes (0.5.17 - 0.5.23: the venv's), on the CPU host backend.

SGLang's engine cannot run on this machine (docs/sglang.md), so these tests build what
its ``KVCacheConfigurator`` builds, SGLang's pools, allocators, radix cache and Triton
decode kernel, with and without kvcached, in both layouts and at page sizes 1 and 16.
Skipped, with the reason, where SGLang does not import.
"""

from __future__ import annotations

import os
import re
import time
from array import array
from types import SimpleNamespace

import pytest
import torch

from kvcached.integration.sglang.version import installed_sglang_version
from tests.sglang_support import exact_mapping_env, finish_request, sglang_missing

MISSING = sglang_missing()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")

LAYERS, HEADS, DIM = 2, 4, 64
TOKEN_BYTES = HEADS * DIM * 4  # float32: the Triton interpreter's dot is exact only on fp32


@pytest.fixture(params=[True, False], ids=["contiguous", "per_layer"])
def sgl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """The hooks applied, an engine's environment, and kvcached shut down afterwards."""
    exact_mapping_env(monkeypatch, request.param, host_mb=96)
    from kvcached.integration.sglang import interfaces, patches

    assert patches.apply() == installed_sglang_version()
    yield request.param
    interfaces.shutdown_kvcached()


def _pools(page: int, size: int = 4096, heads: int = HEADS, dim: int = DIM):
    """(SGLang's pool and allocator, kvcached's pool and allocator), built as the configurator builds them."""
    import sglang.srt.mem_cache.kv_cache_configurator as cfg
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    def build(pool_cls, token_cls, paged_cls):
        pool = pool_cls(size, page_size=page, dtype=torch.float32, head_num=heads, head_dim=dim, layer_num=LAYERS,
                        device="cpu", enable_memory_saver=False, enable_alt_stream=False)
        if page == 1:
            return pool, token_cls(size, dtype=torch.float32, device="cpu", kvcache=pool, need_sort=False)
        return pool, paged_cls(size, page_size=page, dtype=torch.float32, device="cpu", kvcache=pool,
                               need_sort=False)

    plain = build(MHATokenToKVPool, TokenToKVPoolAllocator, PagedTokenToKVPoolAllocator)
    ours = build(cfg.MHATokenToKVPool, cfg.TokenToKVPoolAllocator, cfg.PagedTokenToKVPoolAllocator)
    return plain, ours


def _extend(alloc, lens: list[int], prefix: list[int] | None = None, last: list[int] | None = None):
    """SGLang's prefill allocation for requests of ``lens`` tokens (after ``prefix`` cached tokens)."""
    prefix = prefix or [0] * len(lens)
    last = last or [-1] * len(lens)
    seq = torch.tensor([p + n for p, n in zip(prefix, lens, strict=True)])
    pre = torch.tensor(prefix)
    if alloc.page_size == 1:
        return alloc.alloc(sum(lens))
    return alloc.alloc_extend(pre, pre, seq, seq, torch.tensor(last), sum(lens))


def test_configurator_builds_kvcached_classes(sgl):
    import sglang.srt.mem_cache.kv_cache_configurator as cfg
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from kvcached.integration.sglang import allocator, patches, pools

    assert cfg.MHATokenToKVPool is pools.KvcachedMHATokenToKVPool
    assert cfg.MLATokenToKVPool is pools.KvcachedMLATokenToKVPool
    assert cfg.TokenToKVPoolAllocator is allocator.KvcachedTokenToKVPoolAllocator
    assert cfg.PagedTokenToKVPoolAllocator is allocator.KvcachedPagedTokenToKVPoolAllocator
    (plain_pool, plain_alloc), (pool, alloc) = _pools(1)
    patches.check_pools(pool, alloc)
    # SGLang's isinstance checks (mamba radix cache, hierarchical cache) still see their classes
    assert isinstance(pool, MHATokenToKVPool) and isinstance(alloc, TokenToKVPoolAllocator)
    from kvcached.errors import KVCachedConfigError

    with pytest.raises(KVCachedConfigError, match="TokenToKVPoolAllocator over MHATokenToKVPool"):
        patches.check_pools(plain_pool, plain_alloc)
    with pytest.raises(KVCachedConfigError, match="does not come from kvcached"):
        patches.check_pools(plain_pool, alloc)


@pytest.mark.parametrize("page", [1, 16])
def test_decode_attention_reads_the_same_kv(sgl, page: int):
    """SGLang's Triton decode kernel on kvcached's buffers equals it on SGLang's own (same K/V per request)."""
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd

    (plain_pool, plain_alloc), (pool, alloc) = _pools(page)
    lens = [21, 40, 7]
    gen = torch.Generator().manual_seed(0)
    kv = [[torch.randn(sum(lens) + len(lens), HEADS, DIM, generator=gen) for _ in range(2)] for _ in range(LAYERS)]
    q = torch.randn(len(lens), HEADS, DIM, generator=gen)
    outs = []
    for p, a in ((plain_pool, plain_alloc), (pool, alloc)):
        locs = _extend(a, lens)
        starts = torch.tensor([0, *lens]).cumsum(0)
        last = [int(locs[int(starts[i + 1]) - 1]) for i in range(len(lens))]
        seq = torch.tensor(lens) + 1
        step = a.alloc(len(lens)) if page == 1 else a.alloc_decode(seq, seq, torch.tensor(last))
        rows = [torch.cat([locs[int(starts[i]):int(starts[i + 1])], step[i:i + 1]]) for i in range(len(lens))]
        indices = torch.cat(rows)
        assert len(set(indices.tolist())) == len(indices)  # every token its own slot
        for layer in range(LAYERS):
            p.set_kv_buffer(SimpleNamespace(layer_id=layer), indices, kv[layer][0], kv[layer][1])
        splits = 2
        for layer in range(LAYERS):  # every layer after all were written: layers must not share memory
            o = torch.zeros(len(lens), HEADS, DIM)
            decode_attention_fwd(q, p.get_key_buffer(layer), p.get_value_buffer(layer), o,
                                 torch.tensor([0, *[n + 1 for n in lens]]).cumsum(0).to(torch.int32), indices,
                                 torch.empty(len(lens), HEADS, splits, DIM), torch.empty(len(lens), HEADS, splits),
                                 torch.full((len(lens),), splits, dtype=torch.int32), splits, DIM ** -0.5, 1.0, 1.0)
            outs.append(o)
    assert torch.isfinite(outs[0]).all() and outs[0].abs().sum() > 0
    assert not torch.equal(outs[0], outs[1])  # the layers' K/V differ, so must their outputs
    for plain, ours in zip(outs[:LAYERS], outs[LAYERS:], strict=True):
        torch.testing.assert_close(ours, plain, rtol=0, atol=0)
    # and the bytes really live in kvcached's mapped pages: reading through the raw views gives them back
    assert pool.kvcached_manager.num_allocated_blocks() == 1 + len(set((indices // page).tolist()))


@pytest.mark.parametrize("page", [1, 16])
def test_mapped_memory_follows_a_burst(sgl, page: int, eventually):
    (_, _), (pool, alloc) = _pools(page, heads=8, dim=128)  # 4 KiB per token and layer: 512 tokens a kvcached page
    kv = pool.kvcached_manager
    idle = kv.mapped_bytes
    assert idle == kv.page_group_bytes  # the padding page only
    burst = [_extend(alloc, [1000, 700]), _extend(alloc, [1200])]
    used = (kv.num_allocated_blocks() - 1) * page
    assert used >= 2900 and alloc.available_size() == 4096 - used
    assert kv.mapped_bytes >= idle + 5 * kv.page_group_bytes  # 2900 tokens: 511 share the padding page
    # every slot holds its own bytes in every layer: no two slots (or layers) on one page, none on the zero page
    slots = torch.cat(burst)
    for layer in range(LAYERS):
        k = (slots[:, None, None] * 10 + layer).float().expand(-1, 8, 128)
        pool.set_kv_buffer(SimpleNamespace(layer_id=layer), slots, k, -k)
    for layer in range(LAYERS):
        want = (slots[:, None, None] * 10 + layer).float().expand(-1, 8, 128)
        assert torch.equal(pool.get_key_buffer(layer)[slots], want)
        assert torch.equal(pool.get_value_buffer(layer)[slots], -want)
    for b in burst:
        alloc.free(b)
    assert kv.mapped_bytes == idle
    # advisory: pages just unmapped count as held until the backend's thread has released them
    assert eventually(lambda: alloc.available_size() == 4096)


def _adder(monkeypatch: pytest.MonkeyPatch, cache, alloc, page: int):
    """SGLang's prefill admission (``PrefillAdder``) as the scheduler makes it for a pass, no running batch."""
    import sglang.srt.managers.schedule_policy as policy

    # two reads of SGLang's published server configuration (not published outside an engine): both features off;
    # 0.5.20's PrefillAdder reads neither (its module no longer imports them)
    for read in ("is_dsa_prefill_cp_in_seq_split", "is_prefill_context_parallel_enabled"):
        if hasattr(policy, read):
            monkeypatch.setattr(policy, read, lambda: False)
    if hasattr(policy, "get_exec"):  # 0.5.21's admission also asks for the encoder's SWA replay: off, its default
        features = SimpleNamespace(enable_encoder_swa_bounded_replay=False)
        monkeypatch.setattr(policy, "get_exec", lambda: SimpleNamespace(features=features))
    return policy.PrefillAdder(page, cache, alloc, None, 0.5, 16384, 8192)


def _waiting(cache, rid: str, tokens: list[int]):
    """A request as it waits in SGLang's queue, its cached prefix matched (``init_next_round_input``)."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(rid, "", array("q", tokens), SamplingParams(max_new_tokens=16))
    req.init_next_round_input(cache)
    return req


def _finish(cache, alloc, tokens) -> None:
    """A request of ``tokens`` through SGLang's own steps: matched against ``cache``, its request slot and KV
    allocated, then finished into the cache (which takes its KV) and its slot freed."""
    req = _waiting(cache, f"f{tokens[0]}", list(tokens))
    rtp, n = cache.req_to_token_pool, len(tokens)
    assert rtp.alloc([req]) is not None
    kv = req.kv if hasattr(req.kv, "req_pool_idx") else req  # under ``req.kv`` from 0.5.19
    rtp.req_to_token[kv.req_pool_idx, :n] = _extend(alloc, [n]).to(torch.int32)
    finish_request(cache, req, n)


def _prefix_locs(cache, req):
    """The KV slots of ``req``'s matched prefix: on the request up to 0.5.21 (``prefix_indices``); 0.5.22 keeps
    only its length (``prefix_len``) and reads the slots off the tree (``prefix_device_indices``) when it allocates."""
    return req.prefix_indices if hasattr(req, "prefix_indices") else cache.prefix_device_indices(req)


def _allocate_prefill(cache, alloc, reqs):
    """What ``prepare_for_extend`` allocates for admitted requests (SGLang's own functions: they evict from the
    radix cache first, then raise "Prefill out of memory" if the allocator returns None)."""
    from sglang.srt.mem_cache.allocation import alloc_paged_token_slots_extend, alloc_token_slots

    pre = [len(_prefix_locs(cache, r)) for r in reqs]
    seq = [len(r.full_untruncated_fill_ids) for r in reqs]
    n = sum(seq) - sum(pre)
    if alloc.page_size == 1:
        return alloc_token_slots(cache, n)
    last = [int(_prefix_locs(cache, r)[-1]) if p else -1 for r, p in zip(reqs, pre, strict=True)]
    return alloc_paged_token_slots_extend(cache, torch.tensor(pre), torch.tensor(pre), torch.tensor(seq),
                                          torch.tensor(seq), torch.tensor(last), n)


def _radix(alloc, page: int):
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixCache

    rtp = ReqToTokenPool(size=4, max_context_len=2048, device="cpu", enable_memory_saver=False)
    return rtp, RadixCache(CacheInitParams(disable=False, req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc,
                                           page_size=page))


def _fill_device(other_pool, page: int) -> None:
    """Another engine on the device maps every page the device has left."""
    other = other_pool.kvcached_manager
    for chunk in (512 // page, 1):
        while other.alloc(chunk) is not None:
            pass


def _other_engine(page: int):
    import sglang.srt.mem_cache.kv_cache_configurator as cfg

    return cfg.MHATokenToKVPool(6000, page_size=page, dtype=torch.float32, head_num=8, head_dim=128,
                                layer_num=LAYERS, device="cpu", enable_memory_saver=False, enable_alt_stream=False)


@pytest.mark.parametrize("page", [1, 16])
def test_decode_pages_are_held_from_sglangs_check_to_its_allocation(sgl, page: int):
    """Another engine on the device takes every page it can between SGLang's decode check and the decode's
    allocation: the step's pages were held at the check, so the allocation still gets them (unheld, it returned
    None and SGLang raised "Decode out of memory"); what the hold over-estimated goes back."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    (_, _), (pool, alloc) = _pools(page, heads=8, dim=128)  # 512 tokens a kvcached page (2 MiB x 4 buffers)
    other_pool = _other_engine(page)
    kv = pool.kvcached_manager
    n = 512 - page  # with the padding page: the first kvcached page is full, the next token needs a new one
    locs = _extend(alloc, [n])
    assert kv.mapped_bytes == kv.page_group_bytes
    need = page  # one new SGLang page for the one decoding request
    # ``ScheduleBatch``'s fields that ``check_decode_mem`` reads (0.5.20 also hands the allocator the batch's
    # requests and speculative algorithm)
    decoding = SimpleNamespace(kv=SimpleNamespace(kv_committed_len=n, kv_allocated_len=n))
    batch = SimpleNamespace(token_to_kv_pool_allocator=alloc, tree_cache=None, reqs=[decoding],
                            spec_algorithm=SpeculativeAlgorithm.NONE,
                            new_tokens_required_next_decode=lambda selected=None: need)
    assert ScheduleBatch.check_decode_mem(batch)
    assert len(kv.reserved_blocks) == 1
    _fill_device(other_pool, page)
    seq = torch.tensor([n + 1])
    step = alloc.alloc(1) if page == 1 else alloc.alloc_decode(seq, seq, locs[-1:])
    assert step is not None and int(step[0]) // page == len(locs) // page + 1  # the held page
    assert kv.reserved_blocks == []
    assert kv.alloc(512 // page) is None  # unheld, a new kvcached page cannot be had: the race SGLang lost
    # the same race at the check: SGLang's count still says a kvcached page's worth fits (the count does not see
    # the other engine's pages on this host backend), the hold cannot map it: the check fails, SGLang retracts
    need = 512
    assert not ScheduleBatch.check_decode_mem(batch)
    assert kv.reserved_blocks == []


@pytest.mark.parametrize("page", [1, 16])
def test_prefill_pages_are_held_from_admission_to_allocation(sgl, page: int, monkeypatch: pytest.MonkeyPatch):
    """Another engine takes every page it can between SGLang's prefill admission and the prefill's allocation:
    the request's pages were held when it was admitted, so the allocation gets them (unheld, SGLang raised
    "Prefill out of memory", which stops its engine); a request whose pages cannot be had is not admitted."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    (_, _), (pool, alloc) = _pools(page, heads=8, dim=128)  # 512 tokens a kvcached page (2 MiB x 4 buffers)
    other_pool = _other_engine(page)
    kv = pool.kvcached_manager
    _, cache = _radix(alloc, page)
    adder = _adder(monkeypatch, cache, alloc, page)
    req = _waiting(cache, "r1", list(range(1000, 1700)))  # 700 tokens: past the padding page's kvcached page
    assert adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None) == AddReqResult.CONTINUE
    assert adder.can_run_list == [req]
    assert alloc.held_pages == -(-700 // page) + 1  # SGLang's bound: the paged extend and a page
    _fill_device(other_pool, page)
    locs = _allocate_prefill(cache, alloc, [req])
    assert len(locs) == 700 and len(set(locs.tolist())) == 700
    assert alloc.held_pages == 0 and kv.reserved_blocks == []  # the bound's spare page went back
    spare = kv.mapped_bytes // kv.page_group_bytes * (512 // page) - kv.num_allocated_blocks()
    assert kv.alloc(spare + 1) is None  # a new kvcached page cannot be had: unheld, the allocation lost that race
    # the next pass, the device still full: a new request is not admitted (it waits), and nothing stays held
    adder = _adder(monkeypatch, cache, alloc, page)
    late = _waiting(cache, "r2", list(range(5000, 5700)))
    assert adder.add_one_req(late, has_chunked_req=False, truncation_align_size=None) == AddReqResult.NO_TOKEN
    assert adder.can_run_list == [] and alloc.held_pages == 0 and kv.reserved_blocks == []
    alloc.free(locs)


@pytest.mark.parametrize("page", [1, 16])
def test_prefill_admission_takes_its_pages_from_the_radix_cache(sgl, page: int, monkeypatch: pytest.MonkeyPatch):
    """With the device full, a request whose pages this engine's cached prefixes hold is admitted: the cache gives
    them up at the admission (as SGLang's allocation would a moment later), while the request's own cached prefix
    stays; nothing can take the pages between the admission and the allocation."""
    from sglang.srt.managers.schedule_policy import AddReqResult
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    monkeypatch.setenv("KVCACHED_MAX_CACHED_TOKENS", "-1")
    (_, _), (pool, alloc) = _pools(page, heads=8, dim=128)
    other_pool = _other_engine(page)
    kv = pool.kvcached_manager
    _, cache = _radix(alloc, page)
    prompts = {"old": list(range(20000, 21024)), "shared": list(range(30000, 30256))}
    for tokens in prompts.values():  # two finished requests, cached
        _finish(cache, alloc, tokens)
    assert cache.evictable_size() == 1024 + 256
    _fill_device(other_pool, page)
    req = _waiting(cache, "r1", prompts["shared"] + list(range(40000, 40600)))  # a cached prefix + 600 new tokens
    assert len(_prefix_locs(cache, req)) == 256
    adder = _adder(monkeypatch, cache, alloc, page)
    assert adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None) == AddReqResult.CONTINUE
    assert alloc.held_pages >= -(-600 // page)
    # the old prefix gave up the pages; the shared one, the request's own and now locked by it, stayed
    assert cache.evictable_size() <= 1024 - 600 and len(_prefix_locs(cache, req)) == 256
    shared = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompts["shared"]))))
    assert (shared.device_indices.numel() if hasattr(shared, "device_indices") else shared.device_prefix_len) == 256
    locs = _allocate_prefill(cache, alloc, [req])
    assert len(locs) == 600 and alloc.held_pages == 0 and kv.reserved_blocks == []
    assert not set(locs.tolist()) & set(_prefix_locs(cache, req).tolist())


@pytest.mark.parametrize("page", [1, 16])
def test_a_mixed_chunk_pass_keeps_the_decode_tokens_held(sgl, page: int):
    """With ``--enable-mixed-chunk`` a prefill pass allocates the prefill, then the running requests' decode tokens,
    which its admissions held: another engine filling the device in between cannot take them."""
    from kvcached.integration.sglang import patches

    (_, _), (pool, alloc) = _pools(page, heads=8, dim=128)  # 512 tokens a kvcached page
    kv = pool.kvcached_manager
    other_pool = _other_engine(page)
    n = 512 - page  # a running request filling the padding page's kvcached page: its next token needs a new one
    running = _extend(alloc, [n])
    got = {}

    def raw(scheduler):
        # the admitted prefill (a whole kvcached page of tokens, and SGLang's extra page) + 1 decode page: the
        # prefill takes a kvcached page of its own, the two pages left over are on the next
        assert alloc.hold(512 // page + 1 + 1)
        got["prefill"] = _extend(alloc, [512])
        _fill_device(other_pool, page)
        seq = torch.tensor([n + 1])
        got["decode"] = alloc.alloc(1) if page == 1 else alloc.alloc_decode(seq, seq, running[-1:])
        return "batch", "running"

    assert patches.releasing_prefill_holds(raw)(SimpleNamespace(token_to_kv_pool_allocator=alloc)) == \
        ("batch", "running")
    assert len(got["prefill"]) == 512 and got["decode"] is not None and len(got["decode"]) == 1
    assert alloc.held_pages == 0 and kv.reserved_blocks == [] and not alloc.in_prefill_pass
    # outside a pass an allocation gives back what a hold over-estimated at once, as before
    assert alloc.hold(2)
    assert _extend(alloc, [page]) is not None and alloc.held_pages == 0 and kv.reserved_blocks == []


def test_an_idle_engine_asks_again_for_memory_it_was_refused(sgl):
    """SGLang marks its running batch full when a waiting request does not fit, and only a running request's end
    clears that; with kvcached memory also comes back from outside (another engine, a raised kvctl limit), so an
    engine with nothing running must try its waiting requests again at the next pass (it stayed idle for good)."""
    from kvcached.integration.sglang import patches

    (_, _), (_, alloc) = _pools(16)
    seen = []

    def raw(scheduler, prefill_delayer_single_pass, running_batch):
        seen.append(running_batch.batch_is_full)
        running_batch.batch_is_full = True  # the pass found no room (NO_TOKEN)
        return None, running_batch

    def running(reqs):
        return SimpleNamespace(reqs=reqs, batch_is_full=False, is_empty=lambda: not reqs)

    passes = patches.releasing_prefill_holds(raw)
    idle = SimpleNamespace(token_to_kv_pool_allocator=alloc, waiting_queue=["a waiting request"])
    batch = running([])
    for _ in range(3):
        passes(idle, prefill_delayer_single_pass=None, running_batch=batch)
    assert seen == [False, False, False]  # every pass of an idle engine looked at its queue
    busy = running(["a running request"])
    seen.clear()
    for _ in range(2):
        passes(SimpleNamespace(token_to_kv_pool_allocator=alloc, waiting_queue=["w"]), None, busy)
    assert seen == [False, True]  # a running request's end clears it, as in SGLang: left as SGLang set it
    seen.clear()
    batch.batch_is_full = True
    passes(SimpleNamespace(token_to_kv_pool_allocator=alloc, waiting_queue=[]), None, batch)
    assert seen == [True]  # nothing waiting: nothing to ask for


def test_a_prefill_pass_gives_back_what_it_held(sgl):
    """Pages held by a pass's admissions and not allocated by its batch (nothing formed, or an error) go back
    when the pass ends."""
    from kvcached.integration.sglang import patches

    (_, _), (pool, alloc) = _pools(16)
    kv = pool.kvcached_manager

    def admits_then(outcome):
        def raw(scheduler, *args):
            assert alloc.hold(3)
            if outcome == "error":
                raise RuntimeError("an error inside the pass")
            return None, "running batch"

        return patches.releasing_prefill_holds(raw)

    scheduler = SimpleNamespace(token_to_kv_pool_allocator=alloc)
    assert admits_then("nothing")(scheduler) == (None, "running batch")
    assert alloc.held_pages == 0 and kv.reserved_blocks == []
    with pytest.raises(RuntimeError, match="inside the pass"):
        admits_then("error")(scheduler)
    assert alloc.held_pages == 0 and kv.reserved_blocks == []


@pytest.mark.parametrize("page", [1, 16])
def test_kvctl_limit_below_demand_makes_requests_wait(sgl, page: int, eventually):
    """A limit lowers ``available_size`` (SGLang's admission check) and an allocation past it returns None
    (SGLang's "not now": the request waits or is retracted), never raises; lifting it lets it through."""
    from kvcached.cli import kvctl

    (_, _), (pool, alloc) = _pools(page, heads=8, dim=128)
    kv = pool.kvcached_manager
    held = _extend(alloc, [512])
    assert alloc.available_size() >= 2048
    name = os.environ["KVCACHED_IPC_NAME"]
    limit_pages = 3
    assert kvctl.main(["limit", name, str(limit_pages * kv.page_group_bytes)]) == 0
    assert eventually(lambda: alloc.available_size() < 2048)
    assert _extend(alloc, [2048]) is None  # over the limit: not now
    assert kv.mapped_bytes <= limit_pages * kv.page_group_bytes
    assert kvctl.main(["limit", name, "none"]) == 0
    assert eventually(lambda: alloc.available_size() >= 2048)
    later = _extend(alloc, [2048])
    assert later is not None and len(later) == 2048
    alloc.free(later)
    alloc.free(held)


def _tree(kind: str, rtp, alloc, page: int):
    """SGLang's radix cache of plain models: ``RadixCache`` up to 0.5.18, ``UnifiedRadixCache`` (FULL only)
    from 0.5.19 on (and before, with SGLANG_ENABLE_UNIFIED_RADIX_TREE=1), a ``RadixCache`` in SGLang's
    streaming-session wrapper."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    params = CacheInitParams(disable=False, req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc, page_size=page)
    if kind == "radix":
        return RadixCache(params)
    if kind == "streaming":  # --enable-streaming-session around a cache without sessions of its own
        from sglang.srt.session.streaming_session import StreamingSession

        if not hasattr(StreamingSession, "match_prefix"):
            pytest.skip("0.5.22's streaming sessions are a part of UnifiedRadixCache (its ``session``), around no "
                        "other cache: the unified cases cover them")

        return StreamingSession(RadixCache(params))
    params.tree_components = (ComponentType.FULL,)
    return UnifiedRadixCache(params)


TREES = ["radix", "unified", "streaming"]


@pytest.mark.parametrize("kind", TREES)
@pytest.mark.parametrize("page", [1, 16])
def test_radix_cache_is_bounded(sgl, page: int, kind: str, monkeypatch: pytest.MonkeyPatch):
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    bound = 400  # one finished request's prefix fits, two do not
    monkeypatch.setenv("KVCACHED_MAX_CACHED_TOKENS", str(bound))
    (_, _), (pool, alloc) = _pools(page)
    rtp = ReqToTokenPool(size=4, max_context_len=1024, device="cpu", enable_memory_saver=False)
    cache = _tree(kind, rtp, alloc, page)
    for i in range(3):
        n = 300 + 16 * i
        _finish(cache, alloc, [1000 * (i + 1) + t for t in range(n)])
        assert 0 < cache.evictable_size() <= bound
    # what the tree keeps is all that stays allocated: evicted prefixes went back to kvcached
    assert pool.kvcached_manager.num_allocated_blocks() == 1 + cache.evictable_size() // page
    monkeypatch.setenv("KVCACHED_MAX_CACHED_TOKENS", "-1")  # unlimited: SGLang's own behaviour
    _finish(cache, alloc, range(1, 321))
    assert cache.evictable_size() > bound


@pytest.mark.parametrize("page", [1, 16])
def test_mla_pool(sgl, page: int):
    import sglang.srt.mem_cache.kv_cache_configurator as cfg
    from sglang.srt.runtime_context import get_parallel

    # an engine publishes its parallel widths before the pools are built, and kvcached runs one rank (no decode
    # context parallelism); from 0.5.20 the MLA pool's write asks, and a width nothing published raises
    with get_parallel().override(dcp_enabled=False, attn_dcp_size=1):
        _check_mla_pool(cfg, page)


def _check_mla_pool(cfg, page: int) -> None:
    pool = cfg.MLATokenToKVPool(2048, page_size=page, dtype=torch.float32, kv_lora_rank=64, qk_rope_head_dim=32,
                                layer_num=LAYERS, device="cpu", enable_memory_saver=False)
    alloc = (cfg.TokenToKVPoolAllocator(2048, dtype=torch.float32, device="cpu", kvcache=pool, need_sort=False)
             if page == 1 else cfg.PagedTokenToKVPoolAllocator(2048, page_size=page, dtype=torch.float32,
                                                               device="cpu", kvcache=pool, need_sort=False))
    assert pool.kv_buffer[0].shape == (2048 + page, 1, 96)
    locs = _extend(alloc, [50, 33])
    vals = torch.randn(len(locs), 1, 96)
    pool.set_kv_buffer(SimpleNamespace(layer_id=1), locs, vals, None)
    torch.testing.assert_close(pool.get_key_buffer(1)[locs], vals)
    torch.testing.assert_close(pool.get_value_buffer(1)[locs], vals[..., :64])
    assert pool.kvcached_manager.num_allocated_blocks() == 1 + len(set((locs // page).tolist()))
    alloc.free(locs)
    assert pool.kvcached_manager.num_allocated_blocks() == 1


def test_double_free_raises(sgl):
    (_, _), (pool, alloc) = _pools(16)
    locs = _extend(alloc, [40])
    alloc.free(locs)
    with pytest.raises(ValueError):
        alloc.free(locs)


def test_pages_freed_by_id_go_back_to_kvcached(sgl):
    """SGLang 0.5.20's paged allocator frees whole pages by id too (``free_page_ids``): they are unmapped, and
    inside a free group they wait for its end, as ``free``'s ids do."""
    (_, _), (pool, alloc) = _pools(16)
    kv = pool.kvcached_manager
    before = kv.num_allocated_blocks()
    locs = _extend(alloc, [40])
    pages = torch.unique(locs // 16)
    assert kv.num_allocated_blocks() == before + len(pages)
    alloc.free_group_begin()
    alloc.free_page_ids(pages)
    assert kv.num_allocated_blocks() == before + len(pages)
    alloc.free_group_end()
    assert kv.num_allocated_blocks() == before


def test_a_grouped_free_keeps_the_ids_it_was_given(sgl):
    """Within ``free_group_begin``/``end`` the freed ids wait for the group's end (in every supported SGLang: its
    base class marks a group differently from 0.5.19 on); a caller reusing its tensor in between must not change
    what is freed then (SGLang 0.5.18 copies them too)."""
    (_, _), (pool, alloc) = _pools(16)
    kv = pool.kvcached_manager
    available_before = kv.available_size()
    kept, freed = _extend(alloc, [40]), _extend(alloc, [40])
    in_use = kv.available_size()
    alloc.free_group_begin()
    alloc.free(freed)
    assert kv.available_size() == in_use  # deferred: nothing freed inside the group
    freed.copy_(kept)  # the caller's tensor now names pages still in use
    alloc.free_group_end()
    assert kv.available_size() == in_use + 3  # 40 tokens: three pages of 16
    alloc.free(kept)  # would be a double free had the group freed `kept`'s pages
    assert kv.available_size() == available_before


def test_refused_options(sgl):
    import sglang.srt.mem_cache.kv_cache_configurator as cfg

    from kvcached.errors import KVCachedConfigError

    common = dict(page_size=1, dtype=torch.float32, head_num=HEADS, head_dim=DIM, layer_num=LAYERS, device="cpu",
                  enable_alt_stream=False)
    for extra, what in (({"enable_memory_saver": True}, "enable_memory_saver"),
                        ({"enable_memory_saver": False, "v_head_dim": 32}, "V head dim 32"),
                        ({"enable_memory_saver": False, "kv_cache_layout": "page_major"}, "kv_cache_layout")):
        with pytest.raises(KVCachedConfigError, match=what):
            cfg.MHATokenToKVPool(1024, **common, **extra)
    with pytest.raises(KVCachedConfigError, match="DSA"):
        cfg.MLATokenToKVPool(1024, page_size=1, dtype=torch.float32, kv_lora_rank=64, qk_rope_head_dim=32,
                             layer_num=LAYERS, device="cpu", enable_memory_saver=False, use_dsa=True)


def test_more_than_one_rank_is_refused(sgl, monkeypatch: pytest.MonkeyPatch):
    from kvcached.errors import KVCachedConfigError

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: 2)
    with pytest.raises(KVCachedConfigError, match="2 ranks"):
        _pools(1)


def test_leak_check_skipped_only_for_kvcached_allocators(sgl, monkeypatch: pytest.MonkeyPatch):
    from sglang.srt.managers.scheduler_components import invariant_checker

    reported = []
    monkeypatch.setattr(invariant_checker, "raise_error_or_warn", lambda *args: reported.append(args[-1]))
    (plain_pool, plain_alloc), (pool, alloc) = _pools(1)
    report = invariant_checker.SchedulerInvariantChecker._report_leak
    report(SimpleNamespace(token_to_kv_pool_allocator=alloc), "token_to_kv_pool", "free 10 != 12")
    assert reported == []
    report(SimpleNamespace(token_to_kv_pool_allocator=plain_alloc), "token_to_kv_pool", "free 10 != 12")
    assert reported == ["token_to_kv_pool memory leak detected! free 10 != 12"]


@pytest.fixture
def entry_point_installed(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """kvcached's ``sglang.srt.plugins`` entry point as an installed distribution declares it, and SGLang's
    loader ready to load plugins again."""
    import sys

    import sglang.srt.plugins as plugins

    info = tmp_path / "kvcached_sglang_test-0.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvcached-sglang-test\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text(
        "[sglang.srt.plugins]\nkvcached = kvcached.integration.sglang.plugin:register\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    monkeypatch.setenv("SGLANG_PLUGINS", "kvcached")
    return plugins


def test_sglang_loads_the_plugin(entry_point_installed, monkeypatch: pytest.MonkeyPatch):
    import sglang.srt.mem_cache.kv_cache_configurator as cfg
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.radix_cache import RadixCache

    from kvcached.integration.sglang import patches, pools

    monkeypatch.setenv("ENABLE_KVCACHED", "true")
    monkeypatch.setattr(patches, "_applied", False)
    monkeypatch.setattr(cfg, "MHATokenToKVPool", MHATokenToKVPool)  # SGLang's own, as before any hook
    entry_point_installed.load_plugins()
    assert cfg.MHATokenToKVPool is pools.KvcachedMHATokenToKVPool
    hook = patches.finished_hook(RadixCache)  # cache_finished_req up to 0.5.20, on_release from 0.5.21
    bounded = getattr(RadixCache, hook)
    assert bounded._kvcached
    monkeypatch.setattr(patches, "_applied", False)
    patches.apply()  # again: no second wrapper
    assert getattr(RadixCache, hook) is bounded


def test_sglang_stops_on_an_unsupported_version(entry_point_installed, monkeypatch: pytest.MonkeyPatch):
    """SGLang's loader logs and skips a failing plugin; kvcached's refusal gets through it and stops the process."""
    from kvcached.integration.sglang import patches, version

    monkeypatch.setenv("ENABLE_KVCACHED", "true")
    monkeypatch.setattr(patches, "_applied", False)
    past = ".".join(map(str, version.MAX_VERSION_EXCLUSIVE))  # the first release past the supported range
    monkeypatch.setattr(version, "installed_sglang_version", lambda: past)
    with pytest.raises(SystemExit, match=rf"does not support SGLang {re.escape(past)}"):
        entry_point_installed.load_plugins()


def test_kv_budget_on_a_gpu_is_the_engines_share(sgl, monkeypatch: pytest.MonkeyPatch):
    """On a GPU, SGLang's profiled free memory is replaced by --mem-fraction-static of the device less this
    process's torch memory (another engine's KV pages do not shrink this one's plan)."""
    import sglang.srt.mem_cache.kv_cache_configurator as cfg

    GiB = 1 << 30
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i: 6 * GiB)
    monkeypatch.setattr(cfg, "get_schedule", lambda: SimpleNamespace(mem_fraction_static=0.5))
    profile = cfg.KVCacheConfigurator._profile_available_bytes
    gpu = SimpleNamespace(device="cuda", gpu_id=0, mambaish_config=None)
    assert profile(gpu, 0) == 34 * GiB
    hybrid = SimpleNamespace(device="cuda", gpu_id=0, mambaish_config=object(),
                             _handle_max_mamba_cache=lambda gb: gb / 2)  # SGLang's split: half to Mamba states
    assert profile(hybrid, 0) == 17 * GiB


def test_dense_row_features_need_the_per_layer_layout(sgl, monkeypatch: pytest.MonkeyPatch):
    """HiCache, PD disaggregation and speculative KV copies address rows as pointer + slot x row bytes."""
    import sglang.srt.mem_cache.kv_cache_configurator as cfg

    from kvcached.errors import KVCachedConfigError
    from kvcached.integration.sglang import patches

    off = (SimpleNamespace(enable_hierarchical_cache=False), SimpleNamespace(disaggregation_mode="null"),
           SimpleNamespace(speculative_algorithm=None))
    patches.check_layout_features(True, *off)
    on = SimpleNamespace(enable_hierarchical_cache=True), SimpleNamespace(disaggregation_mode="prefill"), \
        SimpleNamespace(speculative_algorithm="EAGLE")
    for i, what in enumerate(("hierarchical cache", "disaggregation", "speculative")):
        features = list(off)
        features[i] = on[i]
        patches.check_layout_features(False, *features)  # per-layer: dense rows, as SGLang's own
        with pytest.raises(KVCachedConfigError, match=what):
            patches.check_layout_features(True, *features)
    monkeypatch.setattr(cfg, "get_memory", lambda: on[0])
    monkeypatch.setattr(cfg, "get_disagg", lambda: off[1])
    monkeypatch.setattr(cfg, "get_spec", lambda: off[2])
    if sgl:  # contiguous: refused before SGLang builds anything
        with pytest.raises(KVCachedConfigError, match="hierarchical cache"):
            cfg.KVCacheConfigurator._init_pools(SimpleNamespace(), sizes=None, req_to_token_pool=None,
                                                token_to_kv_pool_allocator=None)


@pytest.mark.parametrize("kind", TREES)
@pytest.mark.parametrize("page", [1, 16])
def test_radix_cache_yields_on_a_full_device(sgl, page: int, kind: str, monkeypatch: pytest.MonkeyPatch):
    """Another engine on the device may be waiting for memory: an SGLang engine's cached prefixes go back, at the
    next finished request and, for an idle engine, in the scheduler's idle pass (as vLLM's cache does)."""
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    from kvcached.integration.sglang import patches

    monkeypatch.setenv("KVCACHED_MAX_CACHED_TOKENS", "-1")
    (_, _), (pool, alloc) = _pools(page)
    rtp = ReqToTokenPool(size=4, max_context_len=1024, device="cpu", enable_memory_saver=False)
    cache = _tree(kind, rtp, alloc, page)

    def finish(seed: int, n: int = 320) -> None:
        _finish(cache, alloc, range(seed, seed + n))

    pa = pool.kvcached_manager.page_allocator
    finish(1000)
    assert cache.evictable_size() == 320 and not pa.device_tight()
    patches.radix_of(cache)._kvcached_pressure_checked = 0.0
    assert patches.yield_if_tight(cache) == 0  # room on the device: the cache stays
    free, total = pa.backend.mem_info()
    pa.backend.set_host_limit(total - free)  # another process took the rest of the device
    patches.radix_of(cache)._kvcached_pressure_checked = 0.0
    finish(5000)  # the next finished request gives every cached prefix back
    assert cache.evictable_size() == 0 and pa.device_tight()
    assert pool.kvcached_manager.num_allocated_blocks() == 1  # the padding page only
    pa.backend.set_host_limit(total)
    finish(9000)  # an idle engine: nothing finishes, the scheduler's idle pass does it
    assert cache.evictable_size() == 320
    pa.backend.set_host_limit(total - pa.backend.mem_info()[0])
    idle = patches.yield_on_idle(lambda self: "idle pass")
    patches.radix_of(cache)._kvcached_pressure_checked = 0.0
    assert idle(SimpleNamespace(tree_cache=cache)) == "idle pass"
    assert cache.evictable_size() == 0
    # read just now: not again within PRESSURE_CHECK_S
    patches.radix_of(cache)._kvcached_pressure_checked = time.monotonic() + 60
    finish(12000)
    assert cache.evictable_size() == 320
    pa.backend.set_host_limit(total)

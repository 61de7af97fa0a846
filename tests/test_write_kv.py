"""write_kv_cache on both layouts and both view styles: exact writes, nothing else touched."""

from __future__ import annotations

import pytest
import torch

from kvcached.kernels import write_kv_cache
from kvcached.kernels.write_kv import check_slots
from kvcached.layout import FLASH_ATTN, FLASHINFER, KVGeometry, KVSpec, Layout, allocate_plain, kv_cache_view

MiB = 1 << 20


def make_cache(layout, dtype, *, layers=3, blocks=24, block_size=16, heads=2, head_size=32, seed=0, device="cpu",
               page_mb=2):
    """Random bytes everywhere (never zeros), so an untouched byte is recognisable."""
    spec = KVSpec(layers, blocks, block_size, heads, head_size, dtype)
    geom = KVGeometry(spec, layout, page_mb * MiB)
    bases = allocate_plain(geom, device)
    g = torch.Generator().manual_seed(seed)
    for b in bases:
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g))
    return geom, bases


def views(bases, geom, layer, style):
    kv = kv_cache_view(bases, geom, layer, style)
    return kv.unbind(0) if style == FLASH_ATTN else kv.unbind(1)


def random_slots(n, geom, *, seed, dtype=torch.int64, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    total = geom.num_blocks * geom.spec.block_size
    return torch.randperm(total, generator=g)[:n].to(dtype).to(device)


def expected_after(bases, geom, layer, style, key, value, slots, conv):
    """What the bases must hold after the write, built with torch indexing on copies."""
    want = [b.clone() for b in bases]
    kc, vc = views(want, geom, layer, style)
    bs = geom.spec.block_size
    keep = (slots >= 0) & (slots < geom.num_blocks * bs)
    s = slots[keep].long()
    kc[s // bs, s % bs] = conv(key[keep])
    vc[s // bs, s % bs] = conv(value[keep])
    return want


def assert_bytes_equal(got, want):
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        diff = (a != b).nonzero()
        assert diff.numel() == 0, f"tensor {i}: {diff.numel()} bytes differ, first at byte {int(diff[0])}"


@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("style", [FLASH_ATTN, FLASHINFER])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_write_exact_and_nothing_else(layout, style, dtype, device):
    geom, bases = make_cache(layout, dtype, device=device)
    layer = 1
    n = 37
    g = torch.Generator().manual_seed(1)
    # token stride of a fused qkv projection: key/value are non-contiguous slices
    qkv = torch.randn(n, 3, 2, 32, generator=g).to(dtype).to(device)
    key, value = qkv[:, 1], qkv[:, 2]
    slots = random_slots(n, geom, seed=2, dtype=torch.int32, device=device)
    slots[3] = -1  # padding tokens are skipped
    slots[10] = -7
    want = expected_after(bases, geom, layer, style, key, value, slots, lambda x: x)
    kc, vc = views(bases, geom, layer, style)
    write_kv_cache(key, value, kc, vc, slots)
    assert_bytes_equal(bases, want)


@pytest.mark.parametrize("layout", list(Layout))
def test_head_size_not_power_of_two_and_int64_slots(layout, device):
    # a block of 32 x 2 x 80 x 2 B = 10 KiB divides a 10 MiB page
    geom, bases = make_cache(layout, torch.bfloat16, layers=2, heads=2, head_size=80, blocks=8, block_size=32,
                             device=device, page_mb=10)
    n = 20
    key = torch.randn(n, 2, 80).to(torch.bfloat16).to(device)
    value = torch.randn(n, 2, 80).to(torch.bfloat16).to(device)
    slots = random_slots(n, geom, seed=5, device=device)
    want = expected_after(bases, geom, 1, FLASHINFER, key, value, slots, lambda x: x)
    kc, vc = views(bases, geom, 1, FLASHINFER)
    write_kv_cache(key, value, kc, vc, slots)
    assert_bytes_equal(bases, want)


def test_out_of_range_slots_are_skipped_and_reported(device):
    geom, bases = make_cache(Layout.CONTIGUOUS, torch.float16, device=device)
    kc, vc = views(bases, geom, 2, FLASH_ATTN)  # the last layer: a stray write would hit real data
    n = 6
    key = torch.randn(n, 2, 32).half().to(device)
    value = torch.randn(n, 2, 32).half().to(device)
    total = geom.num_blocks * geom.spec.block_size
    slots = torch.tensor([0, total, total + 5, 2**40, 5, total - 1], device=device)
    with pytest.raises(ValueError, match="3 slot\\(s\\) out of range"):
        check_slots(slots, kc)
    check_slots(slots.clamp(max=total - 1), kc)
    want = expected_after(bases, geom, 2, FLASH_ATTN, key, value, slots, lambda x: x)
    write_kv_cache(key, value, kc, vc, slots)
    assert_bytes_equal(bases, want)


def _fp8_check(got: torch.Tensor, want: torch.Tensor) -> None:
    """Exact on a GPU. On the CPU, Triton's interpreter rounds fp32->fp8 wrongly (FACTS.md) in two
    known ways: ties go to the odd neighbour (one code off), and a round-up that carries into the
    exponent loses the carry (half the right power of two). Only those, on a few percent of values."""
    g = got.view(torch.uint8).to(torch.int16)
    w = want.view(torch.uint8).to(torch.int16)
    differ = g != w
    if torch.cuda.is_available():
        assert not differ.any(), f"{int(differ.sum())} fp8 values differ from torch's cast"
        return
    tie = (g - w).abs() == 1
    lost_carry = got.float() * 2 == want.float()
    assert (tie | lost_carry)[differ].all(), "an fp8 value differs from torch's cast beyond the interpreter's bugs"
    assert differ.float().mean() < 0.06, f"{differ.float().mean():.3f} of fp8 values differ"


@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
@pytest.mark.parametrize("scale_kind", ["float", "tensor"])
def test_fp8_write_scaled(layout, fp8, scale_kind, device):
    geom, bases = make_cache(layout, fp8, device=device, heads=2, head_size=64)
    n = 40
    g = torch.Generator().manual_seed(7)
    key = (torch.randn(n, 2, 64, generator=g) * 3).to(torch.bfloat16).to(device)
    value = (torch.randn(n, 2, 64, generator=g) * 3).to(torch.bfloat16).to(device)
    key[0, 0, 0] = 1e4  # saturates to the largest finite value, never inf/nan
    ks, vs = 0.05, 0.02
    slots = random_slots(n, geom, seed=8, device=device)
    fmax = torch.finfo(fp8).max
    kc, vc = views(bases, geom, 0, FLASH_ATTN)
    before = [b.clone() for b in bases]
    if scale_kind == "tensor":
        write_kv_cache(key, value, kc, vc, slots, k_scale=torch.tensor([ks], device=device),
                       v_scale=torch.tensor(vs, device=device))
    else:
        write_kv_cache(key, value, kc, vc, slots, k_scale=ks, v_scale=vs)
    bs = geom.spec.block_size
    s = slots.long()
    got_k, got_v = kc[s // bs, s % bs], vc[s // bs, s % bs]
    want_k = (key.float() / ks).clamp(-fmax, fmax).to(fp8)
    want_v = (value.float() / vs).clamp(-fmax, fmax).to(fp8)
    _fp8_check(got_k, want_k)
    _fp8_check(got_v, want_v)
    assert float(got_k[0, 0, 0].float()) == fmax
    # every other byte untouched: write the got values into the snapshot and compare
    kb, vb = views(before, geom, 0, FLASH_ATTN)
    kb[s // bs, s % bs] = got_k
    vb[s // bs, s % bs] = got_v
    assert_bytes_equal(bases, before)


def test_empty_and_all_padding(device):
    geom, bases = make_cache(Layout.PER_LAYER, torch.float16, device=device)
    kc, vc = views(bases, geom, 0, FLASH_ATTN)
    before = [b.clone() for b in bases]
    e = torch.empty(0, 2, 32, dtype=torch.float16, device=device)
    write_kv_cache(e, e, kc, vc, torch.empty(0, dtype=torch.int64, device=device))
    x = torch.randn(5, 2, 32).half().to(device)
    write_kv_cache(x, x, kc, vc, torch.full((5,), -1, device=device))
    assert_bytes_equal(bases, before)


def test_bad_inputs_raise_clear_errors():
    geom, bases = make_cache(Layout.CONTIGUOUS, torch.float16)
    kc, vc = views(bases, geom, 0, FLASH_ATTN)
    x = torch.randn(4, 2, 32).half()
    s = torch.arange(4)
    with pytest.raises(ValueError, match="num_tokens, num_kv_heads, head_size"):
        write_kv_cache(x[0], x[0], kc, vc, s)
    with pytest.raises(ValueError, match="heads x head size"):
        write_kv_cache(torch.randn(4, 2, 16).half(), torch.randn(4, 2, 16).half(), kc, vc, s)
    with pytest.raises(ValueError, match="one slot per token"):
        write_kv_cache(x, x, kc, vc, s[:3])
    with pytest.raises(ValueError, match="int32 or int64"):
        write_kv_cache(x, x, kc, vc, s.float())
    with pytest.raises(ValueError, match="cast the key/value"):
        write_kv_cache(x.float(), x.float(), kc, vc, s)
    with pytest.raises(ValueError, match="unbind"):
        write_kv_cache(x, x, kc[0], vc[0], s)
    with pytest.raises(ValueError, match="fp8 caches only"):
        write_kv_cache(x, x, kc, vc, s, k_scale=1.0)
    with pytest.raises(ValueError, match="uint8"):
        write_kv_cache(x, x, kc.view(torch.uint8)[..., :32], vc.view(torch.uint8)[..., :32], s)
    f8 = kc.view(torch.float8_e4m3fn)[..., :32]
    with pytest.raises(ValueError, match="k_scale is required"):
        write_kv_cache(x, x, f8, f8, s)
    with pytest.raises(ValueError, match="positive"):
        write_kv_cache(x, x, f8, f8, s, k_scale=0.0, v_scale=1.0)
    with pytest.raises(ValueError, match="one per-tensor scale"):
        write_kv_cache(x, x, f8, f8, s, k_scale=torch.ones(2), v_scale=1.0)


def _mutated(op) -> list[str]:
    return [a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]


def test_custom_op_fake_runs_no_kernel_and_keeps_every_tensor(monkeypatch: pytest.MonkeyPatch):
    """The fake (meta) impl used by torch.compile: returns nothing, launches nothing, and the
    caches it declares written keep their shape, dtype and device."""
    import importlib

    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    wk = importlib.import_module("kvcached.kernels.write_kv")
    op = torch.ops.kvcached.write_kv_cache.default
    assert _mutated(op) == ["k_cache", "v_cache"] and not op._schema.returns
    launched: list = []
    monkeypatch.setattr(wk, "_launch", lambda *args: launched.append(args))
    with FakeTensorMode():
        x = torch.empty(4, 2, 32, dtype=torch.float16)
        kc, vc = torch.empty(8, 16, 2, 32, dtype=torch.float16), torch.empty(8, 16, 2, 32, dtype=torch.float16)
        one = torch.ones(1)
        result = torch.ops.kvcached.write_kv_cache(x, x, kc, vc, torch.arange(4), one, one)
    assert result is None
    for t in (kc, vc):
        assert isinstance(t, FakeTensor)
        assert (tuple(t.shape), t.dtype, t.device) == ((8, 16, 2, 32), torch.float16, torch.device("cpu"))
    assert launched == [], "the fake impl ran the kernel"
    # the real op (kernel patched out) is what runs outside fake mode
    real, ones = torch.zeros(8, 16, 2, 32, dtype=torch.float16), torch.ones(4, 2, 32, dtype=torch.float16)
    torch.ops.kvcached.write_kv_cache(ones, ones, real, real.clone(), torch.arange(4), torch.ones(1), torch.ones(1))
    assert len(launched) == 1


def test_custom_op_passes_opcheck(device):
    """Real vs fake outputs and mutations agree, and only k_cache/v_cache are written."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 2, 32, dtype=torch.float16, generator=gen).to(device)
    kc = torch.zeros(8, 16, 2, 32, dtype=torch.float16, device=device)
    one = torch.ones(1, device=device)
    torch.library.opcheck(torch.ops.kvcached.write_kv_cache.default,
                          (x, x * 2, kc, kc.clone(), torch.tensor([0, 17, 40, -1], device=device), one, one),
                          test_utils=("test_schema", "test_faketensor"))

"""Huge counts, limits past the pages and ints the core cannot hold: a Python exception
with a clear message, never a crash, a hang or an allocation of terabytes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

vmm = pytest.importorskip("kvcached._vmm")

MiB = 1 << 20
U = 2 * MiB
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.usefixtures("own_host_budget")

PRELUDE = """
from kvcached import _vmm as vmm
U = 2 << 20
b = vmm.Backend("host", host_limit_bytes=256 << 20)
vt = vmm.VirtualTensor(b, 8 * U, U)
pa = vmm.PageAllocator(b, [vt], [(0, 0, U)], 8, 0, 0, False)
def expect(exc, text, fn, *args):
    try:
        fn(*args)
    except exc as e:
        assert text in str(e), str(e)
        return
    raise AssertionError(f"{fn.__name__}{args} did not raise {exc.__name__}")
"""


def run_isolated(body: str) -> None:
    """Runs ``body`` in a fresh interpreter: a segfault or a hang fails this test, not the run."""
    code = PRELUDE + textwrap.dedent(body) + "\nprint('done')\n"
    env = dict(os.environ, PYTHONPATH=ROOT)
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, env=env,
                              cwd=ROOT)
    except subprocess.TimeoutExpired:
        pytest.fail("the native call hung")
    assert proc.returncode == 0 and proc.stdout.strip().endswith("done"), (
        f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}")


def test_alloc_past_the_pages_with_a_limit_above_them():
    run_isolated("""
        pa.set_limit_pages(100)
        expect(vmm.OutOfMemoryError, "only 8 pages", pa.alloc_pages, 9)
        assert pa.num_in_use == 0
        assert pa.alloc_pages(8) == list(range(8))
        expect(vmm.OutOfMemoryError, "only 0 pages", pa.alloc_pages, 1)
        pa.set_limit_pages(2**63 - 1)
        expect(vmm.OutOfMemoryError, "only 0 pages", pa.alloc_pages, 1)
    """)


def test_alloc_of_int64_max_pages_with_a_page_in_use():
    run_isolated("""
        pa.alloc_pages(1)
        expect(vmm.OutOfMemoryError, "only 7 pages", pa.alloc_pages, 2**63 - 1)
        assert pa.num_in_use == 1
    """)


def test_block_pool_over_an_allocator_with_a_limit_above_its_pages():
    run_isolated("""
        pa.set_limit_pages(2**63 - 1)
        bp = vmm.BlockPool(pa, 4, 32)
        assert bp.alloc(2**63 - 1) is None
        assert bp.alloc(33) is None
        got = bp.alloc(32)
        assert sorted(got) == list(range(32))
        assert bp.alloc(1) is None
        bp.free(got)
        assert bp.num_allocated() == 0
    """)


def test_page_count_whose_byte_size_wraps_around():
    b = vmm.Backend("host", host_limit_bytes=64 * MiB)
    vt = vmm.VirtualTensor(b, 8 * U, U)
    with pytest.raises(ValueError, match="reach past the tensor"):
        vmm.PageAllocator(b, [vt], [(0, 0, U)], 2**43, 0, 0, False)  # 2**43 * 2 MiB == 2**64


def test_block_count_near_int64_max():
    b = vmm.Backend("host", host_limit_bytes=64 * MiB)
    vt = vmm.VirtualTensor(b, 8 * U, U)
    pa = vmm.PageAllocator(b, [vt], [(0, 0, U)], 8, 0, 0, False)
    with pytest.raises(ValueError, match="need 8589934592 pages"):
        vmm.BlockPool(pa, 2**30, 2**63 - 2**29)


@pytest.mark.parametrize("fn", ["bench_driver_calls", "bench_breakdown"])
def test_benchmarks_refuse_sizes_that_wrap(fn):
    # (2**43 + 16) pages of 2 MiB wrap to 32 MiB: the old core mapped outside its reservation
    # the driver-call timers live in the benchmark module (KVCACHED_BUILD_BENCH=1), not the shipping one
    run_isolated(f"""
        from kvcached import _vmm_bench
        expect(ValueError, "must be at most 2^48 B", _vmm_bench.{fn}, b, 2**43 + 16, U)
    """)


def _allocator():
    b = vmm.Backend("host", host_limit_bytes=64 * MiB)
    vt = vmm.VirtualTensor(b, 8 * U, U)
    pa = vmm.PageAllocator(b, [vt], [(0, 0, U)], 8, 0, 0, False)
    return b, vt, pa


CALLS = {
    "alloc_pages": lambda b, vt, pa, x: pa.alloc_pages(x),
    "set_limit_pages": lambda b, vt, pa, x: pa.set_limit_pages(x),
    "is_in_use": lambda b, vt, pa, x: pa.is_in_use(x),
    "PageAllocator.num_pages": lambda b, vt, pa, x: vmm.PageAllocator(b, [vt], [(0, 0, U)], x, 0, 0, False),
    "PageAllocator.max_reserved": lambda b, vt, pa, x: vmm.PageAllocator(b, [vt], [(0, 0, U)], 4, 0, x, False),
    "BlockPool.alloc": lambda b, vt, pa, x: vmm.BlockPool(pa, 4, 32).alloc(x),
    "BlockPool.num_blocks": lambda b, vt, pa, x: vmm.BlockPool(pa, 4, x),
    "BlockPool.is_allocated": lambda b, vt, pa, x: vmm.BlockPool(pa, 4, 32).is_allocated(x),
    "VirtualTensor.size": lambda b, vt, pa, x: vmm.VirtualTensor(b, x, U),
    "Backend.device": lambda b, vt, pa, x: vmm.Backend("host", x),
    "set_host_limit": lambda b, vt, pa, x: b.set_host_limit(x),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_bool_is_not_a_count(name):
    b, vt, pa = _allocator()
    for flag in (True, False):
        with pytest.raises(TypeError, match="got bool"):
            CALLS[name](b, vt, pa, flag)
    assert pa.num_in_use == 0


@pytest.mark.parametrize("name", list(CALLS))
def test_int_past_64_bits_says_so(name):
    b, vt, pa = _allocator()
    with pytest.raises(ValueError, match="does not fit in 64 bits"):
        CALLS[name](b, vt, pa, 2**64)
    with pytest.raises(TypeError, match="must be an int, got float"):
        CALLS[name](b, vt, pa, 1.0)


def test_bool_ids_are_refused():
    b, vt, pa = _allocator()
    pa.alloc_pages(2)
    with pytest.raises(ValueError, match=r"ids\[0\] is not an int \(a bool\)"):
        pa.free_pages([True])
    assert pa.num_in_use == 2


@pytest.mark.parametrize("regions, match", [
    ([(0, 0, True)], "region 0: size must be an int, got bool"),
    ([(0, 2**64, U)], "region 0: base = 18446744073709551616 does not fit in 64 bits"),
    (5, "regions must be a list of"),
])
def test_region_ints_are_checked(regions, match):
    b, vt, _ = _allocator()
    with pytest.raises(ValueError, match=match):
        vmm.PageAllocator(b, [vt], regions, 4, 0, 0, False)

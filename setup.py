"""Builds kvcached._vmm: pybind11 only, no torch headers, no CUDA/ROCm SDK (drivers are opened at run time).

With KVCACHED_BUILD_BENCH=1 it also builds kvcached._vmm_bench (csrc/bench/: timings of the
raw driver calls for benchmarks/bench_vmm.py), which the shipping module does not carry:

    KVCACHED_BUILD_BENCH=1 python setup.py build_ext --inplace

Respects CC/CXX (the GPU machine builds with CC=/usr/bin/gcc CXX=/usr/bin/g++) and
KVCACHED_BUILD_JOBS (parallel compile jobs; default: one per CPU).
"""

import os
from glob import glob

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

ParallelCompile("KVCACHED_BUILD_JOBS", default=0).install()


def sources(pattern: str) -> list[str]:
    # the pybind11 binding units take most of the time: start them first so that the
    # small units fill the other job (files are compiled in this order)
    return sorted(glob(pattern), key=lambda p: (not os.path.basename(p).startswith("bindings"), p))


common = dict(
    include_dirs=["csrc"],
    cxx_std=17,
    # -g0: Python's CFLAGS add -g, which costs ~15 % of the build and is not needed here
    extra_compile_args=["-O2", "-g0", "-fvisibility=hidden"],
)
ext_modules = [Pybind11Extension("kvcached._vmm", sources("csrc/*.cpp"), libraries=["dl"], **common)]
if os.environ.get("KVCACHED_BUILD_BENCH", "0") not in ("", "0"):
    ext_modules.append(Pybind11Extension("kvcached._vmm_bench", sources("csrc/bench/*.cpp"), **common))

setup(ext_modules=ext_modules, cmdclass={"build_ext": build_ext})

"""Builds kvcached._vmm: pybind11 only, no torch headers, no CUDA/ROCm SDK (drivers are opened at run time).

Respects CC/CXX (the GPU machine builds with CC=/usr/bin/gcc CXX=/usr/bin/g++).
"""

from glob import glob

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

ParallelCompile("KVCACHED_BUILD_JOBS", default=0).install()

ext = Pybind11Extension(
    "kvcached._vmm",
    sorted(glob("csrc/*.cpp")),
    include_dirs=["csrc"],
    cxx_std=17,
    # -g0: Python's CFLAGS add -g, which costs ~15 % of the build and is not needed here
    extra_compile_args=["-O2", "-g0", "-fvisibility=hidden"],
    libraries=["dl"],
)

setup(ext_modules=[ext], cmdclass={"build_ext": build_ext})

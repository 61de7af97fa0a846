"""On the GPU machine, after setup.sh: import what an SGLang engine imports and name every module that is missing,
so that one device call lists what the bundle lacks (add it to build.sh's DEPS)."""

import importlib
import sys
import traceback

MODULES = ["sglang", "sgl_kernel", "flashinfer", "sglang.srt.entrypoints.engine", "sglang.srt.managers.scheduler",
           "sglang.srt.managers.tokenizer_manager", "sglang.srt.managers.detokenizer_manager",
           "sglang.srt.model_executor.model_runner", "sglang.srt.models.llama",
           "sglang.srt.layers.attention.triton_backend", "sglang.srt.layers.sampler",
           "kvcached.integration.sglang.patches"]
failed = 0
for name in MODULES:
    try:
        importlib.import_module(name)
        print("ok  ", name)
    except Exception as exc:  # report every failure, then the next module
        failed += 1
        print("FAIL", name, f"{type(exc).__name__}: {exc}")
        traceback.print_exc(limit=-3)
if not failed:
    from kvcached.integration.sglang import patches

    print("hooks for SGLang", patches.apply())
sys.exit(1 if failed else 0)

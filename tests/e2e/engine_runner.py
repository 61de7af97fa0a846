"""Runs one vLLM engine in this process and prints one ``RESULT <json>`` line.

The end-to-end tests start it as a subprocess (a fresh process per engine
configuration: vLLM's plugins, kvcached's runtime and the Triton interpreter
switch are all per-process). Usage::

    python engine_runner.py '<json spec>'

Spec keys: ``model`` (dir), ``prompts`` (list of str), ``max_tokens``, ``dtype``,
``attention_backend`` (vLLM name or null), ``max_num_seqs``, ``ipc_name`` (the
/dev/shm segment to sample, or null), ``settle_s`` (how long to wait after the
run for the mapped memory to fall), ``limit_bytes`` (a kvctl-style limit written
to the segment before the run), ``repeat`` (generate that many times).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class Sampler:
    """Reads ``used_size`` from a kvcached /dev/shm segment every ``period`` seconds."""

    def __init__(self, name: str | None, period: float = 0.02) -> None:
        self.name = name
        self.period = period
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def read(self) -> int | None:
        if not self.name:
            return None
        from kvcached import mem_info

        try:
            return int(mem_info.read_segment(self.name).used_size)
        except (FileNotFoundError, ValueError):
            return None

    def _run(self) -> None:
        while not self._stop.is_set():
            used = self.read()
            if used is not None:
                self.samples.append((time.time(), used))  # wall clock: comparable across engines
            self._stop.wait(self.period)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    spec = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams

    kwargs = dict(model=spec["model"], max_model_len=spec.get("max_model_len", 256), enforce_eager=True,
                  dtype=spec.get("dtype", "float32"), seed=0, max_num_seqs=spec.get("max_num_seqs", 16))
    if spec.get("attention_backend"):
        kwargs["attention_backend"] = spec["attention_backend"]
    if "enable_prefix_caching" in spec:
        kwargs["enable_prefix_caching"] = spec["enable_prefix_caching"]
    t0 = time.monotonic()
    llm = LLM(**kwargs)
    start_s = time.monotonic() - t0
    sampler = Sampler(spec.get("ipc_name"))
    idle_before = sampler.read()
    if spec.get("limit_bytes") is not None:
        import subprocess

        subprocess.run([sys.executable, "-m", "kvcached.cli.kvctl", "limit", spec["ipc_name"],
                        str(int(spec["limit_bytes"]))], check=True)
        time.sleep(0.5)  # the engine's monitor applies it within one period
    params = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 16), ignore_eos=True)
    outputs = []
    cached_tokens = []
    t1 = time.monotonic()
    with sampler:
        for _ in range(spec.get("repeat", 1)):
            results = llm.generate(spec["prompts"], params, use_tqdm=False)
            outputs.append([list(r.outputs[0].token_ids) for r in results])
            cached_tokens.append([int(r.num_cached_tokens or 0) for r in results])
        run_s = time.monotonic() - t1
        time.sleep(spec.get("settle_s", 0.0))
    after = sampler.read()
    backend = None
    cached_blocks = None
    try:
        core = llm.llm_engine.engine_core.engine_core
        runner = core.model_executor.driver_worker.worker.model_runner
        backend = runner.attn_groups[0][0].backend.get_name()
        pool = core.scheduler.kv_cache_manager.block_pool
        pool_kind = type(pool).__name__
        if pool_kind == "KVCachedBlockPool":
            cached_blocks = pool.free_block_queue.num_free_blocks  # ours holds only cached blocks
    except Exception as exc:  # only diagnostics
        pool_kind = f"unknown ({exc})"
    print("RESULT " + json.dumps({
        "tokens": outputs[0], "all_tokens": outputs, "start_s": start_s, "run_s": run_s,
        "idle_before": idle_before, "after": after, "samples": sampler.samples,
        "backend": backend, "pool": pool_kind, "cached_tokens": cached_tokens, "cached_blocks": cached_blocks,
    }), flush=True)


if __name__ == "__main__":
    main()

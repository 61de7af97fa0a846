"""One SGLang engine in its own process, for tests/gpu/test_sglang_gpu.py.

    python tests/gpu/sglang_runner.py SPEC_JSON OUT_JSON

SPEC: ``model``, ``page_size``, ``prompts``, ``max_tokens``, optional ``attention_backend`` (``triton``),
``logprobs`` (also greedy-decode ``prompts`` with logprobs: ``decode``; and the ``burst`` again after it, unlimited:
``burst_decode``), ``burst`` (prompts), ``burst_tokens``, ``burst_logprobs`` (the burst itself with logprobs:
``burst_decode``), ``limit_bytes`` (a kvctl limit set on this engine's segment before the burst),
``mem_fraction_static``, ``dtype`` (SGLang's ``--dtype``, default ``auto``), ``ready_file`` / ``wait_file``
(written once the engine is up / waited for before the burst: two engines burst together).
OUT: the greedy ``tokens`` of ``prompts`` and of ``burst``, with ``logprobs`` their ``decode`` steps as
``[token, logprob, lead over the runner-up]`` (tests/e2e/harness.check_decode's input), and (with kvcached)
``idle_used``, ``peak_used`` and ``after_used``: the bytes of KV pages in use on this engine's segment before,
at most during, and after the burst, and ``pools``: the names of its kvcached pools. Every request must finish:
a failure is an exception here.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time


def _used(name: str | None) -> int:
    if not name:
        return -1
    from kvcached import mem_info

    try:
        return int(mem_info.read_segment(name).used_size)
    except (OSError, ValueError):
        return -1


def _tokens(engine: object, prompts: list[str], max_tokens: int) -> list[list[int]]:
    outs = engine.generate(prompt=prompts, sampling_params={"temperature": 0.0, "max_new_tokens": max_tokens,
                                                            "ignore_eos": True})
    return [list(o["output_ids"]) for o in outs]


def _decode(engine: object, prompts: list[str], max_tokens: int) -> list[list[list]]:
    outs = engine.generate(prompt=prompts, sampling_params={"temperature": 0.0, "max_new_tokens": max_tokens,
                                                            "ignore_eos": True},
                           return_logprob=True, top_logprobs_num=2)
    steps = []
    for o in outs:
        meta = o["meta_info"]
        rows = []
        for (lp, tok, _), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True):
            lead = top[0][0] - top[1][0] if top and len(top) > 1 else None
            rows.append([tok, lp, lead])
        steps.append(rows)
    return steps


def main(spec: dict, out_path: str) -> None:
    import sglang

    name = os.environ.get("KVCACHED_IPC_NAME") if os.environ.get("ENABLE_KVCACHED") == "true" else None
    engine = sglang.Engine(model_path=spec["model"], page_size=spec.get("page_size", 1),
                           attention_backend=spec.get("attention_backend", "triton"),
                           sampling_backend="pytorch", mem_fraction_static=spec.get("mem_fraction_static", 0.2),
                           disable_cuda_graph=spec.get("disable_cuda_graph", False), log_level="warning",
                           context_length=512, random_seed=0, dtype=spec.get("dtype", "auto"))
    out: dict = {"pid": os.getpid(), "tokens": _tokens(engine, spec["prompts"], spec["max_tokens"])}
    if spec.get("logprobs"):
        out["decode"] = _decode(engine, spec["prompts"], spec["max_tokens"])
    if spec.get("ready_file"):
        open(spec["ready_file"], "w").close()
    if spec.get("burst"):
        if spec.get("limit_bytes") is not None:
            from kvcached import mem_info

            mem_info.write_limit(name, int(spec["limit_bytes"]))
        out["idle_used"] = _used(name)
        peak = [out["idle_used"]]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], _used(name))
                time.sleep(0.01)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        if spec.get("wait_file"):
            while not os.path.exists(spec["wait_file"]):
                time.sleep(0.05)
        if spec.get("burst_logprobs"):
            out["burst_decode"] = _decode(engine, spec["burst"], spec["burst_tokens"])
            out["burst_tokens"] = [[tok for tok, _, _ in rows] for rows in out["burst_decode"]]
        else:
            out["burst_tokens"] = _tokens(engine, spec["burst"], spec["burst_tokens"])
        done.set()
        sampler.join()
        out["peak_used"] = peak[0]
        deadline = time.time() + 30  # finished requests' pages are given back as SGLang frees them
        while _used(name) > out["idle_used"] and time.time() < deadline:
            time.sleep(0.1)
        out["after_used"] = _used(name)
        if name:  # the engine's kvcached pools, by name (a hybrid model's Mamba states: sglang-mamba<group>)
            from kvcached import mem_info

            out["pools"] = [p["pool_name"] for p in mem_info.read_segment(name).pools]
        if spec.get("logprobs") and "burst_decode" not in out:  # the burst again, unlimited, with its logprobs
            out["burst_decode"] = _decode(engine, spec["burst"], spec["burst_tokens"])
    engine.shutdown()
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), sys.argv[2])

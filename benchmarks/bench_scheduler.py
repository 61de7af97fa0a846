"""Host time of vLLM's scheduler with and without kvcached, on the CPU (no GPU, no model).

    python3 benchmarks/bench_scheduler.py [--prompts 128 --input-len 512 --output-len 128 --runs 5]

vLLM's own ``Scheduler`` (prefix caching on, chunked prefill, 16-token blocks) over the KV cache geometry of
``bench_serving.py`` (Llama-3-8B: 32 layers, 8 KV heads of 128, bf16), driven as the engine drives it but with
the model replaced by one sampled token per finished prefill or decode: ``schedule()``, then
``update_from_output()``, until every request has its output. The same set of fresh prompts as the serving
benchmark (random ids, no shared prefix), every request ``--output-len`` tokens, all of them added at once.

What this isolates is the host time the scheduler spends per run where kvcached's hooks wrap or replace vLLM's
block pool. On a GPU with async scheduling a step's host time is hidden behind the device's work while it stays
below the step's GPU time; the first step's allocation and the frees of finishing requests at the end of a run are
not (``docs/serving_overhead.md``).
Configurations, each in its own process: plain vLLM; kvcached in the contiguous and the per-layer layout
(the host backend: the same allocator and block pool as on a GPU, pages mapped in CPU memory).

Writes ``benchmarks/results/scheduler_host_cpu.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO), str(HERE)]

from _bench_common import Table, environment, write_report  # noqa: E402

LAYERS, KV_HEADS, HEAD, BLOCK = 32, 8, 128, 16
CONFIGS = [
    ("vLLM", {}),
    ("kvcached contiguous", {"ENABLE_KVCACHED": "true", "KVCACHED_CONTIGUOUS_LAYOUT": "true"}),
    ("kvcached per-layer", {"ENABLE_KVCACHED": "true", "KVCACHED_CONTIGUOUS_LAYOUT": "false"}),
]
# kvcached's host backend maps CPU memory for the pages in use (untouched: the scheduler writes no KV)
HOST_BUDGET_MB = 24 * 1024


def _scheduler(spec: dict, model_dir: str) -> tuple:
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    max_len = spec["input_len"] + spec["output_len"] + 16
    model = ModelConfig(model=model_dir, dtype="bfloat16", max_model_len=max_len, skip_tokenizer_init=True)
    sched_cfg = SchedulerConfig(max_num_seqs=spec["max_num_seqs"], max_num_batched_tokens=spec["batched_tokens"],
                                max_model_len=max_len, is_encoder_decoder=False, enable_chunked_prefill=True)
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    vllm_config = VllmConfig(model_config=model, scheduler_config=sched_cfg, cache_config=cache)
    vllm_config.cache_config.num_gpu_blocks = spec["num_blocks"]  # what the engine sets from the workers
    attn = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.bfloat16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    num_blocks = spec["num_blocks"]
    # the tensors are the workers' business: the scheduler reads only the block count and the groups
    kv_cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, attn)])
    if os.environ.get("ENABLE_KVCACHED") == "true":
        from kvcached.integration.vllm import kv_alloc, patches

        patches.apply()
        kv_alloc.ensure_initialized("cpu")
        cell = KV_HEADS * HEAD * 2  # bytes of one token of one layer, K or V
        kv_alloc._place(num_blocks, BLOCK, cell, LAYERS, 2, "cpu")
    scheduler = Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cfg,
                          structured_output_manager=StructuredOutputManager(vllm_config), block_size=BLOCK,
                          hash_block_size=BLOCK)
    from vllm.utils.hashing import sha256_cbor

    init_none_hash(sha256_cbor)
    return scheduler, get_request_block_hasher(BLOCK, sha256_cbor)


def _run(scheduler, hasher, spec: dict, seed: int) -> dict:
    """One run: add the prompt set, step until every request is done; host seconds per phase."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=spec["output_len"], ignore_eos=True)
    for i in range(spec["prompts"]):
        ids = [rng.randrange(1000, 120000) for _ in range(spec["input_len"])]
        req = Request(f"{seed}-{i}", ids, params, None, block_hasher=hasher)
        scheduler.add_request(req)
    sched_s, update_s, finishing = [], [], 0.0
    token = 0
    while scheduler.has_requests():
        t0 = time.perf_counter()
        out = scheduler.schedule()
        t1 = time.perf_counter()
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            req = scheduler.requests[rid]
            token = (token + 7919) % 100000
            sampled.append([1000 + token] if req.num_computed_tokens >= req.num_tokens else [])
        mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: k for k, r in enumerate(req_ids)},
                                sampled_token_ids=sampled)
        before = len(scheduler.requests)
        t2 = time.perf_counter()
        scheduler.update_from_output(out, mro)
        t3 = time.perf_counter()
        if len(scheduler.requests) < before:
            finishing += t3 - t2  # steps that finished requests (freed their blocks)
        sched_s.append(t1 - t0)
        update_s.append(t3 - t2)
    return {"schedule_s": sum(sched_s), "update_s": sum(update_s), "steps": len(sched_s),
            "first_schedule_s": sched_s[0], "finishing_update_s": finishing,
            "decode_step_s": statistics.median(s + u for s, u in zip(sched_s, update_s, strict=True))}


def child(spec: dict) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        from bench_serving import LLAMA3_8B

        (Path(tmp) / "config.json").write_text(json.dumps(LLAMA3_8B))
        scheduler, hasher = _scheduler(spec, tmp)
        _run(scheduler, hasher, dict(spec, prompts=32), seed=0)  # warm-up, as the serving benchmark's
        runs = [_run(scheduler, hasher, spec, seed=r + 1) for r in range(spec["runs"])]
        scheduler.shutdown()
    print("RESULT " + json.dumps({"runs": runs}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5, help="runs of the prompt set in each configuration's process")
    ap.add_argument("--rounds", type=int, default=3, help="processes of each configuration, in turn")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--batched-tokens", type=int, default=16384, help="vLLM's max_num_batched_tokens")
    ap.add_argument("--max-cached-tokens", type=int, default=None,
                    help="KVCACHED_MAX_CACHED_TOKENS for the kvcached rows (default: kvcached's)")
    ap.add_argument("--only", default="", help="comma-separated indices into the configurations")
    ap.add_argument("--out", default=str(HERE / "results" / "scheduler_host_cpu.md"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    per_req = -(-(args.input_len + args.output_len) // BLOCK)
    spec = {"prompts": args.prompts, "input_len": args.input_len, "output_len": args.output_len, "runs": args.runs,
            "max_num_seqs": args.max_num_seqs, "batched_tokens": args.batched_tokens,
            "num_blocks": args.prompts * per_req + 64}
    picked = [CONFIGS[int(i)] for i in args.only.split(",")] if args.only else CONFIGS
    rows: dict[str, dict] = {name: {"runs": [], "rounds": []} for name, _ in picked}
    # rounds: the configurations in turn, again and again; this shared 2-core VM's speed drifts between processes
    # by more than kvcached's cost, so a configuration is compared with vLLM's run of the same round
    for _ in range(args.rounds):
        for name, env in picked:
            run_env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", KVCACHED_HOST_MEM_LIMIT_MB=str(HOST_BUDGET_MB),
                           KVCACHED_IPC_NAME=f"kvcached_bench_sched_{os.getpid()}", **env)
            if args.max_cached_tokens is not None:
                run_env["KVCACHED_MAX_CACHED_TOKENS"] = str(args.max_cached_tokens)
            proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=run_env,
                                  capture_output=True, text=True, timeout=1800)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if proc.returncode or line is None:
                sys.exit(f"{name}: the scheduler run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
            runs = json.loads(line[len("RESULT "):])["runs"]
            rows[name]["runs"] += runs
            rows[name]["rounds"].append(_ms(runs, "schedule_s") + _ms(runs, "update_s"))
            print(name, f"{rows[name]['rounds'][-1]:.1f} ms", flush=True)
    write(args, rows)


def _ms(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs) * 1e3


def write(args: argparse.Namespace, rows: dict) -> None:
    import platform

    import torch
    import vllm

    env = environment(torch.device("cpu"))
    env["gpu"] = "none: the scheduler's host time only (no model runs)"
    env["cpu"] = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    env["vllm"] = vllm.__version__
    base = rows.get(CONFIGS[0][0])
    table = Table("Host time per run (medians over every run of every round)",
                  ["configuration", "steps", "schedule() ms", "update_from_output() ms", "host ms / run",
                   "added to vLLM's (median of rounds)", "first schedule() ms", "finishing updates ms",
                   "median step ms"])
    for name, res in rows.items():
        runs = res["runs"]
        total = _ms(runs, "schedule_s") + _ms(runs, "update_s")
        added = (statistics.median(r - b for r, b in zip(res["rounds"], base["rounds"], strict=True))
                 if base is not None else None)
        table.add(name, runs[-1]["steps"], _ms(runs, "schedule_s"), _ms(runs, "update_s"), total,
                  f"{added:+.1f}" if added is not None else "-", _ms(runs, "first_schedule_s"),
                  _ms(runs, "finishing_update_s"), _ms(runs, "decode_step_s"))
    table.notes.append("added to vLLM's: the host milliseconds a run that kvcached adds, against vLLM's run of the "
                       "same round. first schedule(): the step that allocates the first prompts' blocks; finishing "
                       "updates: the update_from_output() calls that finished requests and freed their blocks (with "
                       "prefix caching, into the cache, which kvcached bounds at KVCACHED_MAX_CACHED_TOKENS); median "
                       "step: schedule() + update_from_output() of one step.")
    for name, res in rows.items():
        table.notes.append(f"{name}, each round (median of its runs): "
                           + ", ".join(f"{t:.1f}" for t in res["rounds"]) + " ms")
    lines = [
        f"- workload: {args.prompts} fresh random prompts x {args.input_len} in + {args.output_len} out per run, "
        f"all added at once; Llama-3-8B's KV geometry ({LAYERS} layers, {KV_HEADS} KV heads of {HEAD}, bf16), "
        f"{BLOCK}-token blocks, prefix caching on, max_num_batched_tokens {args.batched_tokens}; "
        f"{args.rounds} rounds of the configurations in turn, each a process with {args.runs} runs after a warm-up "
        "of 32 prompts",
        "",
    ]
    out = Path(args.out)
    write_report(out.parent, out.stem, "vLLM's scheduler: host time per run, with and without kvcached", env,
                 lines, [table])


if __name__ == "__main__":
    main()

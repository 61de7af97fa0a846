"""Serving throughput under vLLM on one GPU, with and without kvcached, and two engines' memory over time.

    python3 benchmarks/bench_serving.py [--prompts 256 --input-len 512 --output-len 256 --runs 3] [--no-timeline]

Model: Llama-3-8B's shape (32 layers, 32 / 8 heads of 128, 14336 MLP, 128256 vocabulary)
with vLLM's dummy weights; prompts are random token ids from a fixed seed. Each
configuration runs in its own process: the engine starts (CUDA graphs, async
scheduling), warms up on 32 prompts, then generates the whole set ``--runs`` times
(``ignore_eos``, so every request produces ``--output-len`` tokens); output tokens
per second of each run, median and spread.

Configurations: plain vLLM with FLASH_ATTN (FA3 on Hopper) and with TRITON_ATTN;
``ENABLE_KVCACHED`` in the contiguous and the per-layer layout (FLASH_ATTN); and
``ENABLE_KVCACHED`` with the kvcached Triton backend (``attention_backend="KVCACHED"``).

The timeline (``benchmarks/results/serving_timeline_<gpu>.png``) runs two kvcached
engines side by side on a bursty trace and plots each one's mapped KV memory and the
device's free memory, sampled from kvcached's /dev/shm segments.

Writes ``benchmarks/results/serving_<gpu>.md`` (+ ``.png``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
RUNNER = REPO / "tests" / "e2e" / "engine_runner.py"

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
    "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001,
}

CONFIGS = [
    ("vLLM FLASH_ATTN", {}, {"attention_backend": "FLASH_ATTN"}),
    ("kvcached contiguous, FLASH_ATTN", {"ENABLE_KVCACHED": "true", "KVCACHED_CONTIGUOUS_LAYOUT": "true"},
     {"attention_backend": "FLASH_ATTN"}),
    ("kvcached per-layer, FLASH_ATTN", {"ENABLE_KVCACHED": "true", "KVCACHED_CONTIGUOUS_LAYOUT": "false"},
     {"attention_backend": "FLASH_ATTN"}),
    ("kvcached contiguous, KVCACHED backend", {"ENABLE_KVCACHED": "true", "KVCACHED_CONTIGUOUS_LAYOUT": "true"},
     {"attention_backend": "KVCACHED"}),
    ("vLLM TRITON_ATTN", {}, {"attention_backend": "TRITON_ATTN"}),
    # diagnostics of the per-layer layout's cost (not in the default set): no prealloc thread (every page
    # mapped inline, in the step), and a reserve of 40-80 pages (5-10 GiB mapped ahead) instead of 5-10
    ("kvcached per-layer, no prealloc thread", {"ENABLE_KVCACHED": "true", "KVCACHED_CONTIGUOUS_LAYOUT": "false",
                                                "KVCACHED_PAGE_PREALLOC_ENABLED": "false"},
     {"attention_backend": "FLASH_ATTN"}),
    ("kvcached per-layer, reserve 40-80 pages", {"ENABLE_KVCACHED": "true", "KVCACHED_CONTIGUOUS_LAYOUT": "false",
                                                 "KVCACHED_MIN_RESERVED_PAGES": "40",
                                                 "KVCACHED_MAX_RESERVED_PAGES": "80"},
     {"attention_backend": "FLASH_ATTN"}),
]
DEFAULT_CONFIGS = "0,1,2,3,4"


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_") and k != "ENABLE_KVCACHED"}
    env.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def child(spec: dict) -> None:
    """One engine: start, warm up, time ``runs`` generations of the whole prompt set."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    def prompt_set(seed: int, n: int) -> list:
        # fresh prompts for every run: no run may hit the prefix cache of an earlier one
        rng = random.Random(seed)
        return [TokensPrompt(prompt_token_ids=[rng.randrange(1000, 120000) for _ in range(spec["input_len"])])
                for _ in range(n)]

    t0 = time.monotonic()
    llm = LLM(model=spec["model"], load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0,
              max_model_len=spec["input_len"] + spec["output_len"] + 16, max_num_seqs=spec["max_num_seqs"],
              async_scheduling=True, **spec["engine"])
    start_s = time.monotonic() - t0
    params = SamplingParams(temperature=0.0, max_tokens=spec["output_len"], ignore_eos=True, detokenize=False)
    llm.generate(prompt_set(0, 32), params, use_tqdm=False)
    rates = []
    for run in range(spec["runs"]):
        prompts = prompt_set(run + 1, spec["prompts"])
        t1 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t1
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
    backend = runner = None
    try:
        runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
        backend = runner.attn_groups[0][0].backend.get_name()
    except Exception:
        pass
    out = {"rates": rates, "start_s": start_s, "backend": backend}
    if spec.get("bursty"):
        out["bursty"] = bursty(llm, params, prompt_set, spec)
    if spec.get("profile"):
        from serving_profile import profile_generate

        out["profile"] = profile_generate(llm, runner, lambda: llm.generate(prompt_set(99, spec["prompts"]), params,
                                                                            use_tqdm=False))
    print("RESULT " + json.dumps(out), flush=True)


def bursty(llm, params, prompt_set, spec: dict) -> dict:
    """Waves of requests with idle gaps between them, so that pages are mapped and unmapped during the run:
    output tokens per second while a wave runs (the gaps left out) and how long each wave took."""
    waves, size, gap = spec["bursty"]
    took, tokens = [], 0
    for w in range(waves):
        prompts = prompt_set(1000 + w, size)
        t1 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        took.append(time.perf_counter() - t1)
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
        time.sleep(gap)  # idle: a kvcached engine gives its pages back
    return {"rate": tokens / sum(took), "wave_s": [round(t, 3) for t in took], "waves": waves, "size": size,
            "gap_s": gap}


def run_config(model: str, args: argparse.Namespace, env_extra: dict, engine: dict) -> dict:
    spec = {"model": model, "prompts": args.prompts, "input_len": args.input_len, "output_len": args.output_len,
            "max_num_seqs": args.max_num_seqs, "runs": args.runs, "engine": engine, "profile": args.profile,
            "bursty": [args.bursty_waves, args.bursty_size, args.bursty_gap] if args.bursty_waves else None}
    if env_extra:
        env_extra = {**env_extra, "KVCACHED_IPC_NAME": f"kvcached_bench_{os.getpid()}"}
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=_env(env_extra),
                          capture_output=True, text=True, timeout=args.timeout)
    # what the engine said about compilation and CUDA graphs: a config that ran without them is not comparable
    notes = [ln.strip()[-160:] for ln in (proc.stdout + proc.stderr).splitlines()
             if re.search(r"Graph capturing finished|torch.compile took|enforce_eager=True", ln)][:12]
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return {**json.loads(line[len("RESULT "):]), "log_notes": notes}
    tail = (proc.stdout + proc.stderr)[-1500:]
    return {"error": f"rc {proc.returncode}: {tail}"}


TIMELINE_PLAN = (
    "Llama-3-8B shape (dummy weights), CUDA graphs, async scheduling, both engines uncapped. Each burst is 48 "
    "prompts of 512 random tokens + 256 generated. A: idle 1 s, burst, 3 s, idle 3 s, burst, 2 s. B: idle 4 s, "
    "burst, 2 s, burst, 2 s. Mapped memory is each engine's /dev/shm segment, sampled every "
    "20 ms; device free memory from the driver.")


def timeline(model: str, out_png: Path, workdir: Path) -> str:
    """Two kvcached engines on a bursty trace: A bursts, then B while A drains, then both; mapped memory over time."""
    rng = random.Random(1)
    prompts = [[rng.randrange(1000, 120000) for _ in range(512)] for _ in range(48)]
    base = {"model": model, "load_format": "dummy", "skip_tokenizer_init": True, "dtype": "bfloat16",
            "enforce_eager": False, "async_scheduling": True, "max_model_len": 1024, "max_num_seqs": 64,
            "prompt_token_ids": prompts, "max_tokens": 256}
    go = workdir / "go"
    plan = {"A": [{"settle_s": 1.0}, {"generate": True, "settle_s": 3.0}, {"settle_s": 3.0}, {"generate": True,
                                                                                                "settle_s": 2.0}],
            "B": [{"settle_s": 4.0}, {"generate": True, "settle_s": 2.0}, {"generate": True, "settle_s": 2.0}]}
    procs = {}
    for name, phases in plan.items():
        spec = {**base, "ipc_name": f"kvcached_timeline_{name}", "phases": phases,
                "ready_file": str(workdir / f"{name}.ready"), "wait_file": str(go)}
        env = _env({"ENABLE_KVCACHED": "true", "KVCACHED_IPC_NAME": f"kvcached_timeline_{name}"})
        spec_file = workdir / f"{name}.json"
        spec_file.write_text(json.dumps(spec))
        procs[name] = subprocess.Popen([sys.executable, str(RUNNER), f"@{spec_file}"], env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600
    while not all((workdir / f"{n}.ready").exists() or p.poll() is not None for n, p in procs.items()):
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    go.touch()
    results = {}
    for name, p in procs.items():
        out, _ = p.communicate(timeout=600)
        line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            return f"timeline engine {name} failed: {out[-1500:]}"
        results[name] = json.loads(line[len("RESULT "):])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(s[0] for r in results.values() for s in r["samples"])
    fig, ax = plt.subplots(figsize=(9, 4))
    for name, r in results.items():
        ax.plot([s[0] - t0 for s in r["samples"]], [s[1] / 2**30 for s in r["samples"]], label=f"engine {name} mapped")
    free = sorted((s[0] - t0, s[2]) for r in results.values() for s in r["samples"] if s[2] is not None)
    if free:
        ax2 = ax.twinx()
        ax2.plot([f[0] for f in free], [f[1] / 2**30 for f in free], color="grey", lw=0.8, label="device free")
        ax2.set_ylabel("device free (GiB)")
        ax2.legend(loc="upper right")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("mapped KV memory (GiB)")
    ax.set_title("Two vLLM engines with kvcached on one GPU, bursty trace (8B-shaped, 48 x 512+256 tokens)")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    peaks = {n: max(s[1] for s in r["samples"]) / 2**30 for n, r in results.items()}
    same = results["A"]["all_tokens"][0] == results["A"]["all_tokens"][1] == results["B"]["all_tokens"][0]
    return (f"peaks: A {peaks['A']:.2f} GiB, B {peaks['B']:.2f} GiB; identical tokens across bursts and engines: "
            f"{same}; plot {out_png.name}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=400)
    ap.add_argument("--no-timeline", action="store_true")
    ap.add_argument("--only", default=DEFAULT_CONFIGS,
                    help="comma-separated config numbers (0-based, see CONFIGS); 'none' runs only the timeline")
    ap.add_argument("--profile", action="store_true",
                    help="after the timed runs, one more run profiled (serving_profile.py): host time in kvcached's "
                         "hooks and vLLM's step, the VMM driver calls, GPU busy and idle time")
    ap.add_argument("--bursty-waves", type=int, default=4, help="waves of the bursty row (0: none)")
    ap.add_argument("--bursty-size", type=int, default=64, help="prompts a wave")
    ap.add_argument("--bursty-gap", type=float, default=3.0,
                    help="idle seconds after each wave (past the lazy reserve's 2 s: pages unmapped, mapped again)")
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    import torch

    sys.path.insert(0, str(HERE))
    from _bench_common import environment, gpu_slug

    device = torch.device("cuda")
    env = environment(device)
    slug = gpu_slug(device)
    work = Path(tempfile.mkdtemp(prefix="kvcached_serving_"))
    model = work / "llama3_8b_shape"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA3_8B))
    import vllm

    chosen = [] if args.only == "none" else [int(i) for i in args.only.split(",")]
    rows = {}
    for i in chosen:
        name, env_extra, engine = CONFIGS[i]
        r = run_config(str(model), args, env_extra, engine)
        rows[name] = r
        print(name, {k: v for k, v in r.items() if k != "error"} or r["error"][-800:], flush=True)
        print(write_table(rows, args, env, slug, vllm.__version__))  # a run cut short still leaves its rows
    if not args.no_timeline:
        # its own file: a timeline run alone (--only none) leaves the throughput table as it was
        result = timeline(str(model), RESULTS / f"serving_timeline_{slug}.png", work)
        header = "\n".join(f"- {k}: {v}" for k, v in env.items())
        text = (f"# Two vLLM {vllm.__version__} engines with kvcached on one GPU ({slug}), bursty trace\n\n"
                f"{header}\n\n{TIMELINE_PLAN}\n\n{result}\n")
        (RESULTS / f"serving_timeline_{slug}.md").write_text(text)
        print(text)


def write_table(rows: dict, args: argparse.Namespace, env: dict, slug: str, version: str) -> str:
    sys.path.insert(0, str(HERE))
    from _bench_common import Table
    table = Table(f"vLLM {version} offline throughput, Llama-3-8B shape (dummy weights), {args.prompts} fresh "
                  f"random prompts per run x {args.input_len} in + {args.output_len} out, max {args.max_num_seqs} seqs",
                  ["configuration", "backend", "output tok/s (median)", "spread (min-max)", "vs vLLM FLASH_ATTN",
                   "vs vLLM TRITON_ATTN", "bursty tok/s", "bursty vs vLLM FLASH_ATTN", "engine start (s)"])
    med = {n: statistics.median(r["rates"]) for n, r in rows.items() if "rates" in r}
    burst = {n: r["bursty"]["rate"] for n, r in rows.items() if r.get("bursty")}
    fa, tri, fa_b = med.get("vLLM FLASH_ATTN"), med.get("vLLM TRITON_ATTN"), burst.get("vLLM FLASH_ATTN")
    for name, r in rows.items():
        if "rates" not in r:
            table.add(name, "failed", "-", "-", "-", "-", "-", "-", "-")
            table.notes.append(f"{name}: {r['error'][-300:]}")
            continue
        m, b = med[name], burst.get(name)
        table.add(name, r["backend"], m, f"{min(r['rates']):.0f}-{max(r['rates']):.0f}",
                  f"{m / fa:.3f}" if fa else "-", f"{m / tri:.3f}" if tri else "-",
                  f"{b:.0f}" if b else "-", f"{b / fa_b:.3f}" if b and fa_b else "-", r["start_s"])
    if burst:
        any_b = next(r["bursty"] for r in rows.values() if r.get("bursty"))
        table.notes.append(f"bursty: {any_b['waves']} waves of {any_b['size']} fresh prompts, each followed by "
                           f"{any_b['gap_s']} s idle; output tok/s while the waves run, the idle gaps left out. A "
                           "kvcached engine keeps freed pages mapped for KVCACHED_LAZY_RESERVE_MS (2000 ms by "
                           "default) after the load's peak: a gap longer than that unmaps them and the next wave "
                           "maps them again")
    for name, r in rows.items():
        if "rates" in r:  # in order: the first run maps the engine's KV pages, the later ones find them mapped
            table.notes.append(f"{name}, each run in order (output tok/s): {', '.join(f'{x:.0f}' for x in r['rates'])}")
    for name, r in rows.items():
        for note in r.get("log_notes", [])[:4]:
            table.notes.append(f"{name} engine log: {note}")
    header = "\n".join(f"- {k}: {v}" for k, v in env.items())
    text = f"# Serving throughput ({slug})\n\n{header}\n\n{table.markdown()}"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"serving_{slug}.md").write_text(text)
    profiles = {n: r["profile"] for n, r in rows.items() if r.get("profile")}
    if profiles:
        from serving_profile import profile_markdown

        (RESULTS / f"serving_profile_{slug}.md").write_text(
            f"# Where a serving step's time goes ({slug})\n\n{header}\n\n" + profile_markdown(profiles))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = [n for n in rows if n in med]
        fig, ax = plt.subplots(figsize=(9, 3.5))
        ax.barh(names, [med[n] for n in names], xerr=[[med[n] - min(rows[n]["rates"]) for n in names],
                                                      [max(rows[n]["rates"]) - med[n] for n in names]])
        ax.set_xlabel("output tokens / s (median of runs, min-max bars)")
        ax.set_title(f"vLLM {version}, Llama-3-8B shape, {env['gpu'].split(' (')[0]}")
        fig.tight_layout()
        fig.savefig(RESULTS / f"serving_{slug}.png", dpi=110)
        plt.close(fig)
    except Exception as exc:
        print("plot failed:", exc)
    return text




if __name__ == "__main__":
    main()

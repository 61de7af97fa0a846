"""Several models served from one GPU through vLLM's OpenAI server: kvcached against a static memory split.

    python3 benchmarks/bench_coserving.py run --policy static   --out DIR   # plain vLLM, a fixed KV slice each
    python3 benchmarks/bench_coserving.py run --policy kvcached --out DIR   # ENABLE_KVCACHED, one shared budget
    python3 benchmarks/bench_coserving.py report DIR                        # record + plots from both runs

Three ``vllm serve`` engines (dummy weights of real shapes: Llama-3-8B, Qwen2.5-7B,
Llama-3.2-3B; CUDA graphs and async scheduling on) behind kvcached's router
(``python -m kvcached.router``), one port each. Both policies have the same KV memory
in total, ``--kv-gib`` x 3:

- ``static``: each engine ``--kv-cache-memory-bytes`` = its slice (``--kv-gib``), and
  ``--gpu-memory-utilization`` its share of the device (weights, activations and slice);
- ``kvcached``: each engine elastic (``ENABLE_KVCACHED=true``, contiguous layout,
  ``KVCACHED_GPU_UTILIZATION`` = the whole budget over the device); once the engines are
  up, a ballast process takes the device's free memory but the budget (what the
  engines have mapped counted in), so they share exactly that much.

The client replays the Azure 2023 conversation trace (see ``_coserving.py``) at each
rate of a grid, skewed (Zipf, the hot model rotating) and uniform, streaming every
request through the router, and records per request the time to first token, the
time per output token and the end-to-end time; per rate the engines' preemptions
(their ``/metrics``) and, for kvcached, each engine's mapped KV memory every 100 ms
(its /dev/shm segment). Before the sweep each model's idle latency is measured with
requests sent one at a time. A policy's sweep of one trace stops after the first rate
whose attainment at the loose multiple falls below one half.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

from _coserving import (  # noqa: E402
    Outcome,
    Request,
    attainment,
    build_trace,
    demand_peak,
    fit_idle,
    kv_bytes_per_token,
    kv_demand,
    max_rate,
    meets_slo,
    memory_bound_rates,
    misses,
    percentile,
    prompt_ids,
    shared_misses,
)

GiB = 1 << 30
KS = (5.0, 10.0)  # SLO multiples of the idle engine's TTFT and TPOT: tight (the headline) and loose

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
    "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "torch_dtype": "bfloat16",
    "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 28,
}
LLAMA32_3B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 3072, "intermediate_size": 8192,
    "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "torch_dtype": "bfloat16", "tie_word_embeddings": True,
}
MODELS = {"llama-3-8b": LLAMA3_8B, "qwen2.5-7b": QWEN25_7B, "llama-3.2-3b": LLAMA32_3B}
WEIGHTS_GIB = {"llama-3-8b": 14.96, "qwen2.5-7b": 14.19, "llama-3.2-3b": 5.98}  # bf16 parameters
MAX_MODEL_LEN = 8192  # the trace's longest prompt + output is 6066 + 1000
ENGINE_ARGS = ["--load-format", "dummy", "--dtype", "bfloat16", "--max-model-len", str(MAX_MODEL_LEN),
               "--seed", "0", "--async-scheduling", "--disable-uvicorn-access-log"]
BASE_PORT = 8300
BALLAST_MARGIN = 256 << 20
ROUTER_PORT = 8290


# -- engines, router, ballast ------------------------------------------------
# --smoke: three tiny Llamas on the CPU (vLLM's CPU build, kvcached's host backend), a check of the harness
SMOKE_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--seed", "0", "--enforce-eager",
              "--disable-uvicorn-access-log", "--gpu-memory-utilization", "0.3"]
SMOKE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
SMOKE_MAX_PROMPT, SMOKE_MAX_OUTPUT = 160, 12


def write_models(workdir: Path, smoke: bool) -> dict[str, Path]:
    if smoke:
        from tools.tiny_model import make_tiny_llama

        return {f"tiny-{i}": make_tiny_llama(workdir / "models" / f"tiny-{i}", seed=i) for i in range(3)}
    from tools.tiny_model import make_shape_only_model

    return {name: make_shape_only_model(workdir / "models" / name, cfg) for name, cfg in MODELS.items()}


def device_memory() -> tuple[int, int]:
    """(free, total) bytes of GPU 0 from nvidia-smi (no CUDA context in this process); (0, 0) without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.free,memory.total", "--format=csv,noheader,nounits",
                              "-i", "0"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return 0, 0
    free, total = (int(x) << 20 for x in out.strip().split(","))
    return free, total


def meta(argv: list[str]) -> dict[str, str]:
    import importlib.metadata

    import torch
    import triton

    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
           "triton": triton.__version__, "command": "python3 benchmarks/bench_coserving.py " + " ".join(argv)}
    for dist in ("vllm", "vllm-cpu"):
        try:
            out["vllm"] = importlib.metadata.version(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            pass
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader", "-i", "0"],
                           capture_output=True, text=True, check=True).stdout.strip().split(", ")
        out["gpu"], out["driver"] = q[0], q[1]
    except (OSError, subprocess.CalledProcessError, IndexError):
        out["gpu"] = "none (CPU)"
    return out


def router_config(policy: str, paths: dict[str, Path], kv_bytes: int, total: int, log_dir: Path,
                  smoke: bool = False) -> dict:
    models = []
    for i, (name, path) in enumerate(paths.items()):
        args = list(SMOKE_ARGS if smoke else ENGINE_ARGS)
        env: dict[str, str] = {}
        if smoke:
            env = dict(SMOKE_ENV)
            if policy == "kvcached":
                env.update({"ENABLE_KVCACHED": "true", "KVCACHED_IPC_NAME": f"kvcached_cosrv_smoke_{os.getpid()}_{i}"})
        elif policy == "static":
            share = (WEIGHTS_GIB[name] * GiB + kv_bytes + 4 * GiB) / total  # + activations, graphs, context
            args += ["--kv-cache-memory-bytes", str(kv_bytes), "--gpu-memory-utilization", f"{share:.4f}"]
        else:
            env = {"ENABLE_KVCACHED": "true", "KVCACHED_CONTIGUOUS_LAYOUT": "true",
                   "KVCACHED_IPC_NAME": f"kvcached_cosrv_{i}",
                   "KVCACHED_GPU_UTILIZATION": f"{min(1.0, 3 * kv_bytes / total):.4f}"}
        models.append({"name": name, "path": str(path), "port": BASE_PORT + i, "args": args, "env": env,
                       "sleep": False})
    return {"router": {"port": ROUTER_PORT, "idle_sleep_s": 0, "start_timeout_s": 600, "log_dir": str(log_dir)},
            "models": models}


BALLAST = """
import sys, time, torch
leave = int(sys.argv[1])
free = torch.cuda.mem_get_info()[0]
take = max(0, free - leave)
x = torch.empty(take, dtype=torch.uint8, device="cuda")
print("BALLAST", take, free, flush=True)
time.sleep(1e9)
"""


def start_ballast(leave: int) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-c", BALLAST, str(leave)], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline() if proc.stdout else ""
    m = re.match(r"BALLAST (\d+) (\d+)", line)
    if not m:
        proc.kill()
        raise RuntimeError(f"ballast process failed: {line!r}")
    return proc, int(m.group(1))


class Mps:
    """CUDA MPS for one run (``--mps``): one control daemon whose clients are every process started after
    :meth:`start` (engines, ballast), so the three engines' kernels run side by side instead of time-slicing the
    GPU. Its pipe and log directories are the run's own; :meth:`stop` ends the daemon and its server."""

    CONTROL = "nvidia-cuda-mps-control"

    def __init__(self, work: Path) -> None:
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": str(work / "mps_pipe"), "CUDA_MPS_LOG_DIRECTORY": str(work / "mps_log")}
        self.exe: str | None = None

    def _ask(self, command: str) -> str:
        assert self.exe is not None
        r = subprocess.run([self.exe], input=command + "\n", capture_output=True, text=True, timeout=30,
                           env={**os.environ, **self.env})
        if r.returncode:
            raise RuntimeError(f"{self.CONTROL} '{command}' exited {r.returncode}: {(r.stderr or r.stdout).strip()}")
        return r.stdout

    def start(self) -> None:
        self.exe = shutil.which(self.CONTROL)
        if self.exe is None:
            raise SystemExit(f"--mps: {self.CONTROL} is not on PATH (it ships with the NVIDIA driver's utilities); "
                             "run without --mps.")
        for d in self.env.values():
            Path(d).mkdir(parents=True, exist_ok=True)
        r = subprocess.run([self.exe, "-d"], capture_output=True, text=True, timeout=30, env={**os.environ, **self.env})
        if r.returncode:
            self.exe = None  # no daemon to stop
            raise SystemExit(f"--mps: '{self.CONTROL} -d' exited {r.returncode}: {(r.stderr or r.stdout).strip()} "
                             "(MPS needs the GPU in the Default or Exclusive_Process compute mode).")
        os.environ.update(self.env)  # before any client starts: they find the daemon through these

    def servers(self) -> list[str]:
        """The MPS servers running (one once a client has connected)."""
        return self._ask("get_server_list").split()

    def stop(self) -> None:
        if self.exe is None:
            return
        try:
            self._ask("quit")
        finally:
            for k in self.env:
                os.environ.pop(k, None)
            self.exe = None


# The MPS check's client by default: kvcached's CUDA backend tests (create, map, access, unmap under the daemon).
MPS_CHECK_CLIENT = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/test_native_cuda.py", "-p",
                    "no:cacheprovider", "--tb=short"]


def mps_check(client: list[str], work: Path) -> int:
    """Start an MPS daemon, run ``client`` as its client, name the servers, stop it: the client's exit code."""
    mps = Mps(work)
    mps.start()
    try:
        try:
            rc = subprocess.run(client, cwd=REPO, timeout=120).returncode
        except (OSError, subprocess.TimeoutExpired) as e:
            raise SystemExit(f"mps-check: the client {client[:1]} did not run to its end: {e}") from e
        print(f"MPS servers: {mps.servers()}", flush=True)
    finally:
        mps.stop()
    return rc


def segment_used(names: dict[str, str]) -> dict[str, int]:
    from kvcached import mem_info

    out = {}
    for model, seg in names.items():
        try:
            info = mem_info.read_segment(seg)
            out[model] = int(info.used_size) + int(info.prealloc_size)
        except Exception:  # an engine that has not published yet
            out[model] = 0
    return out


def preemptions(urls: dict[str, str]) -> dict[str, float]:
    out = {}
    for model, url in urls.items():
        try:
            with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
                text = r.read().decode()
            out[model] = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                             if line.startswith("vllm:num_preemptions_total"))
        except Exception:
            out[model] = float("nan")
    return out


class MemSampler(threading.Thread):
    """Each kvcached engine's mapped KV bytes (used + prealloc) every ``period`` seconds."""

    def __init__(self, segments: dict[str, str], period: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.segments, self.period = segments, period
        self.samples: list[tuple[float, dict[str, int]]] = []
        self.t0 = time.monotonic()
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            self.samples.append((round(time.monotonic() - self.t0, 3), segment_used(self.segments)))
            self._halt.wait(self.period)

    def stop(self) -> list:
        self._halt.set()
        self.join(timeout=5)
        return self.samples


# -- the client ----------------------------------------------------------------
# prompt token ids are drawn below this (every real model's vocabulary is larger; the smoke's tiny one is 384)
TOKEN_HIGH = {"smoke": 380, "real": 30000}
_token_high = TOKEN_HIGH["real"]


async def send(session, url: str, req: Request, seed: int, t0: float) -> Outcome:
    out = Outcome(req.index, req.model, req.prompt_len, req.output_len, sent_s=0.0)
    body = {"model": req.model, "prompt": prompt_ids(req, seed, low=3, high=_token_high),
            "max_tokens": req.output_len, "ignore_eos": True,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.monotonic()
    out.sent_s = round(start - t0, 4)
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return out
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    data = event.strip()[len(b"data: "):]
                    if not data or data == b"[DONE]":
                        continue
                    msg = json.loads(data)
                    if msg.get("choices"):
                        out.chunks += 1
                        if out.ttft_s is None:
                            out.ttft_s = time.monotonic() - start
                    usage = msg.get("usage")
                    if usage:
                        out.tokens = int(usage.get("completion_tokens") or 0)
            out.e2e_s = time.monotonic() - start
            if out.tokens != req.output_len:
                out.error = f"got {out.tokens} of {req.output_len} tokens"
    except Exception as exc:  # noqa: BLE001 - every failure is a recorded outcome, never a crash of the run
        out.error = repr(exc)[:200]
    return out


async def replay(url: str, requests: list[Request], seed: int, drain_s: float) -> list[Outcome]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.monotonic()

        async def at(req: Request) -> Outcome:
            await asyncio.sleep(max(0.0, t0 + req.at_s - time.monotonic()))
            return await send(session, url, req, seed, t0)

        tasks = [asyncio.create_task(at(r)) for r in requests]
        last = requests[-1].at_s if requests else 0.0
        done, pending = await asyncio.wait(tasks, timeout=last + drain_s)
        for t in pending:
            t.cancel()
        outcomes = []
        for req, task in zip(requests, tasks, strict=True):
            if task in done:
                outcomes.append(task.result())
            else:
                outcomes.append(Outcome(req.index, req.model, req.prompt_len, req.output_len, req.at_s,
                                        error=f"unfinished {drain_s:.0f} s after the last arrival"))
        return outcomes


def idle_probe(url: str, models: list[str], seed: int,
               lengths: tuple[int, ...]) -> dict[str, list[tuple[int, float, float]]]:
    """Each model alone, one request at a time: (prompt_len, ttft, tpot) at a few prompt lengths."""
    samples: dict[str, list[tuple[int, float, float]]] = {m: [] for m in models}
    for m in models:
        warm = Request(10**6, 0.0, m, 64, 8)
        asyncio.run(replay(url, [warm], seed + 1, 120))
        for rep in range(2):
            for plen in lengths:
                req = Request(10**6 + 10 * plen + rep, 0.0, m, plen, 32)
                o = asyncio.run(replay(url, [req], seed + 1, 120))[0]
                # a stream whose tokens came in few events (a busy API server coalesces them) has no TPOT
                if o.error is None and o.ttft_s is not None and o.tpot_s is not None and o.chunks >= o.tokens // 2:
                    samples[m].append((plen, o.ttft_s, o.tpot_s))
    return samples


def wait_idle(urls: dict[str, str], timeout: float = 120.0) -> None:
    """Until no engine has a running or waiting request (their /metrics)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = 0.0
        for url in urls.values():
            try:
                with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
                    for line in r.read().decode().splitlines():
                        if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
                            busy += float(line.rsplit(" ", 1)[1])
            except Exception:
                pass
        if busy == 0:
            return
        time.sleep(0.5)


# -- one policy ---------------------------------------------------------------
def run_policy(args: argparse.Namespace) -> None:
    global _token_high
    _token_high = TOKEN_HIGH["smoke" if args.smoke else "real"]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    from kvcached.router.config import parse_config
    from kvcached.router.engines import Engines

    paths = write_models(work, args.smoke)
    free0, total = device_memory()
    kv_bytes = int(args.kv_gib * GiB)
    raw = router_config(args.policy, paths, kv_bytes, total, out_dir / f"logs_{args.policy}", args.smoke)
    cfg_file = work / f"router_{args.policy}.json"
    cfg_file.write_text(json.dumps(raw, indent=1))
    config = parse_config(raw)
    engines = Engines(config)
    urls = {m.name: m.url for m in config.models}
    segments = {m.name: m.env["KVCACHED_IPC_NAME"] for m in config.models if "KVCACHED_IPC_NAME" in m.env}
    result: dict = {"policy": args.policy, "kv_bytes_each": kv_bytes, "device_total": total, "device_free_at_start":
                    free0, "models": list(paths), "ks": list(KS), "duration_s": args.duration, "seed": args.seed,
                    "router_config": raw, "runs": [], "meta": meta(sys.argv[1:]), "mps": bool(args.mps),
                    "not_run": []}
    router = ballast = None
    mps = Mps(work) if args.mps else None
    t_start = time.monotonic()
    try:
        if mps:
            mps.start()
        engines.start()
        result["engine_ready_s"] = engines.wait_ready()
        print(f"[{args.policy}] engines ready: {result['engine_ready_s']}", flush=True)
        if mps:
            result["mps_servers"] = mps.servers()
            if not result["mps_servers"]:
                raise SystemExit("--mps: the engines are up but no MPS server runs: they did not connect to the "
                                 "daemon (CUDA_MPS_PIPE_DIRECTORY).")
        router = subprocess.Popen([sys.executable, "-m", "kvcached.router", str(cfg_file), "--no-launch"],
                                  stdout=open(out_dir / f"logs_{args.policy}" / "router.log", "wb"),
                                  stderr=subprocess.STDOUT, cwd=REPO)
        rurl = f"http://127.0.0.1:{ROUTER_PORT}"
        for _ in range(100):
            try:
                urllib.request.urlopen(rurl + "/v1/models", timeout=2)
                break
            except Exception:
                time.sleep(0.2)
        if args.policy == "kvcached" and not args.smoke:
            mapped = sum(segment_used(segments).values())
            # + a margin for what the engines' own allocators may still ask of the driver (an out-of-memory
            # there would end an engine; static engines hold their activations' memory in the same way)
            leave = max(0, 3 * kv_bytes - mapped) + BALLAST_MARGIN
            ballast, took = start_ballast(leave)
            result["ballast"] = {"bytes": took, "mapped_when_taken": mapped, "left_free": leave}
            print(f"[kvcached] ballast {took / GiB:.1f} GiB, KV mapped {mapped / GiB:.2f} GiB, "
                  f"left {leave / GiB:.2f} GiB", flush=True)
        result["device_free_before_runs"] = device_memory()[0]
        result["idle"] = idle_probe(rurl, list(paths), args.seed, (16, 64, 128) if args.smoke else (128, 1024, 4096))
        for skew, rates in ((args.skew, args.rates), (0.0, args.uniform_rates)):
            for i, rate in enumerate(rates):
                if time.monotonic() - t_start > args.budget_s:
                    print(f"[{args.policy}] time budget spent; rate {rate} not run", flush=True)
                    result["not_run"] += [[skew, r, f"the time budget (--budget-s {args.budget_s:g})"]
                                          for r in rates[i:]]
                    break
                wait_idle(urls)
                reqs = build_trace(list(paths), rate, args.duration, skew, seed=args.seed,
                                   max_prompt=SMOKE_MAX_PROMPT if args.smoke else None)
                if args.smoke:
                    reqs = [Request(q.index, q.at_s, q.model, q.prompt_len, min(q.output_len, SMOKE_MAX_OUTPUT))
                            for q in reqs]
                p0 = preemptions(urls)
                sampler = MemSampler(segments) if segments else None
                if sampler:
                    sampler.start()
                t1 = time.monotonic()
                outs = asyncio.run(replay(rurl, reqs, args.seed, args.drain))
                wall = time.monotonic() - t1
                mem = sampler.stop() if sampler else []
                p1 = preemptions(urls)
                run = {"skew": skew, "rate": rate, "wall_s": round(wall, 2), "outcomes": [o.as_dict() for o in outs],
                       "preemptions": {m: p1[m] - p0[m] for m in urls}, "mem": mem}
                result["runs"].append(run)
                errors = sum(o.error is not None for o in outs)
                idle = {m: fit_idle(s) for m, s in result["idle"].items()}
                att = {k: attainment(outs, idle, k) for k in KS}
                print(f"[{args.policy}] skew {skew} rate {rate}: {len(outs)} requests, errors {errors}, "
                      f"attainment {att}, preemptions {run['preemptions']}, wall {wall:.1f} s", flush=True)
                (out_dir / f"coserving_{args.policy}.json").write_text(json.dumps(result))
                if att[KS[-1]] < 0.5:
                    result["not_run"] += [[skew, r, f"attainment below 0.5 at {rate:g}"] for r in rates[i + 1:]]
                    break
    finally:
        if router is not None:
            router.terminate()
        if ballast is not None:
            ballast.kill()
        result["engine_exit"] = engines.stop()
        result["segments_left"] = sorted(s for s in segments.values() if Path("/dev/shm", s).exists())
        (out_dir / f"coserving_{args.policy}.json").write_text(json.dumps(result))
        if mps:
            mps.stop()  # after the results are written: a daemon that will not quit must not lose them
    print(f"[{args.policy}] done in {time.monotonic() - t_start:.0f} s; exits {result['engine_exit']}, "
          f"segments left {result['segments_left']}", flush=True)


# -- the record ---------------------------------------------------------------
def _outcomes(run: dict) -> list[Outcome]:
    fields = ("index", "model", "prompt_len", "output_len", "sent_s", "ttft_s", "e2e_s", "tokens", "chunks", "error")
    return [Outcome(**{k: o[k] for k in fields if k in o}) for o in run["outcomes"]]


def summarize(results: dict[str, dict]) -> dict:
    """Attainment per policy, trace and rate against one idle reference (static's, plain vLLM, if present)."""
    ref = results.get("static") or next(iter(results.values()))
    idle = {m: fit_idle(s) for m, s in ref["idle"].items()}
    table: dict = {}
    for policy, res in results.items():
        for run in res["runs"]:
            outs = _outcomes(run)
            ok = [o for o in outs if o.error is None]
            row = {"n": len(outs), "errors": len(outs) - len(ok),
                   "preemptions": sum(v for v in run["preemptions"].values() if v == v),
                   "ttft_p50": percentile([o.ttft_s for o in ok], 0.5),
                   "ttft_p99": percentile([o.ttft_s for o in ok], 0.99),
                   "tpot_p50": percentile([o.tpot_s for o in ok if o.tpot_s], 0.5),
                   "tpot_p99": percentile([o.tpot_s for o in ok if o.tpot_s], 0.99),
                   "goodput": {k: sum(1 for o in outs if meets_slo(o, idle[o.model], k)) / max(run["wall_s"], 1e-9)
                               for k in KS},
                   "attainment": {k: attainment(outs, idle, k) for k in KS}}
            table.setdefault(policy, {}).setdefault(run["skew"], {})[run["rate"]] = row
    return {"idle": idle, "table": table}


# what the calls of one policy's grid must share for their rates to stand in one table
SAME_SETUP = ("models", "kv_bytes_each", "duration_s", "mps")
SAME_MACHINE = ("gpu", "driver", "torch", "triton", "vllm")


def load_results(dirs: list[str]) -> dict[str, dict]:
    """Each policy's run file (``coserving_<policy>.json``, or ``.json.gz`` as committed) in ``dirs``.

    A policy's grid may be split over several calls (device calls are short: one rate more in the next call
    on the same machine): files of one policy are merged, the later's runs after the earlier's, if they share
    the set-up and the machine's software and repeat no (trace, rate); each call's command stays in ``calls``.
    The idle reference stays the first call's. Two machines of one model and software look alike here: merge
    only calls made on one machine (one lease), as the comparison needs.
    """
    import gzip

    results: dict[str, dict] = {}
    for d in dirs:
        for f in sorted(Path(d).glob("coserving_*.json*")):
            text = gzip.decompress(f.read_bytes()).decode() if f.suffix == ".gz" else f.read_text()
            res = json.loads(text)
            res.setdefault("calls", [{"file": str(f), **res.get("meta", {}),
                                      **{k: res[k] for k in ("engine_ready_s", "engine_exit", "ballast") if k in res}}])
            if res["policy"] in results:
                _merge_calls(results[res["policy"]], res, str(f))
            else:
                results[res["policy"]] = res
    return results


def _merge_calls(into: dict, more: dict, name: str) -> None:
    """``more``'s runs appended to ``into``'s (one policy, two calls); SystemExit where they cannot share a table."""
    differ = [k for k in SAME_SETUP if into.get(k) != more.get(k)]
    differ += [f"meta.{k}" for k in SAME_MACHINE if into.get("meta", {}).get(k) != more.get("meta", {}).get(k)]
    if differ:
        raise SystemExit(f"report: {name} ({more['policy']}) differs from the earlier file of that policy in "
                         f"{', '.join(differ)}; report them apart.")
    have = {(r["skew"], r["rate"]) for r in into["runs"]}
    again = sorted({(r["skew"], r["rate"]) for r in more["runs"]} & have)
    if again:
        raise SystemExit(f"report: {name} ({more['policy']}) runs (skew, rate) {again} again; keep one of the two "
                         "runs out of the report's directories.")
    into["runs"] = into["runs"] + more["runs"]
    into["calls"] = into["calls"] + more["calls"]
    into["not_run"] = (into.get("not_run") or []) + (more.get("not_run") or [])
    into["segments_left"] = sorted(set(into.get("segments_left") or []) | set(more.get("segments_left") or []))


LOWER_TARGET = 0.95  # a second attainment target, so a ratio held back by a few misses both policies share shows


def _best(s: dict, skew: float, k: float, target: float) -> tuple[dict, float | None]:
    """Each policy's highest rate at ``target`` attainment (k), and kvcached's over the static split's."""
    best = {p: max_rate({rt: r["attainment"][k] for rt, r in s["table"].get(p, {}).get(skew, {}).items()}, target)
            for p in ("static", "kvcached")}
    return best, (best["kvcached"] / best["static"]) if best["kvcached"] and best["static"] else None


def _rates_run(s: dict, skew: float, policy: str) -> list[float]:
    return sorted(s["table"].get(policy, {}).get(skew, {}))


def _grid_note(s: dict, skew: float, best: dict) -> str:
    """Where the rates run leave the ratio open: the static split not run at a rate between its 99 % point and
    kvcached's (it may keep that rate too: the ratio is at most the one shown), or kvcached's point at its highest
    rate run (it may keep more: at least the one shown)."""
    if not (best["static"] and best["kvcached"]):
        return ""
    ran = {p: _rates_run(s, skew, p) for p in ("static", "kvcached")}
    notes = []
    missed = min((r for r in ran["static"] if r > best["static"]), default=float("inf"))  # static's first miss
    gap = [r for r in sorted(set(ran["static"]) | set(ran["kvcached"]))
           if best["static"] < r <= best["kvcached"] and r < missed and r not in ran["static"]]
    if gap:
        notes.append(f"the static split not run at {', '.join(f'{r:g}' for r in gap)}: at most this")
    if ran["kvcached"][-1] == best["kvcached"]:
        notes.append(f"kvcached not run above {best['kvcached']:g}: at least this")
    return f" ({'; '.join(notes)})" if notes else ""


def _best_text(s: dict, skew: float, best: dict) -> str:
    """"static R, kvcached R req/s"; a policy that missed the target at every rate it ran: below the lowest."""
    def one(policy: str) -> str:
        if best[policy] is not None:
            return str(best[policy])
        ran = _rates_run(s, skew, policy)
        return f"below {ran[0]}" if ran else "not run"

    return f"static {one('static')}, kvcached {one('kvcached')} req/s"


def _best_summary(s: dict, skew: float, k: float, target: float, bold: bool = False) -> str:
    """Each policy's highest rate at ``target`` and their ratio, with what the rates run leave open."""
    best, ratio = _best(s, skew, k, target)
    mark = "**" if bold else ""
    return _best_text(s, skew, best) + (f"; ratio {mark}{ratio:.2f}{mark}{_grid_note(s, skew, best)}" if ratio else "")


def _lower_target_lines(s: dict, skew: float, name: str) -> list[str]:
    return [f"- {name}, k={k:g}, a lower target: highest rate at >= {LOWER_TARGET * 100:.0f} % attainment: "
            + _best_summary(s, skew, k, LOWER_TARGET) for k in KS]


def _miss_lines(results: dict[str, dict], idle: dict) -> list[str]:
    """Per rate both policies ran: what their requests missed, and whether kvcached's misses are the static
    split's too (the same trace request missed under both: not a matter of KV memory)."""
    if "static" not in results or "kvcached" not in results:
        return []
    k = KS[-1]
    runs = {p: {(r["skew"], r["rate"]): _outcomes(r) for r in results[p]["runs"]} for p in ("static", "kvcached")}
    rows = []
    for key in sorted(set(runs["static"]) & set(runs["kvcached"]), key=lambda t: (-t[0], t[1])):
        miss = {p: misses(runs[p][key], idle, k) for p in runs}
        kinds = {p: "/".join(str(sum(v == kind for v in miss[p].values())) for kind in ("ttft", "tpot", "both",
                                                                                      "error")) for p in runs}
        shared, own = shared_misses(miss["kvcached"], miss["static"])
        rows.append(f"| {'skewed' if key[0] else 'uniform'} | {key[1]:g} | {len(runs['static'][key])} | "
                    f"{len(miss['static'])} ({kinds['static']}) | {len(miss['kvcached'])} ({kinds['kvcached']}) | "
                    f"{shared} | {own} |")
    if not rows:
        return []
    return [f"## Requests that missed the SLO (k={k:g})", "",
            "Misses by what was late: TTFT only / TPOT only / both / error. The last two columns split kvcached's "
            "misses into requests of the trace that the static split missed too, and ones it met.", "",
            "| trace | rate (req/s) | requests | static misses | kvcached misses | of kvcached's, static missed too | "
            "of kvcached's, static met |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |", *rows, ""]


def _call_tag(res: dict, call: dict) -> str:
    """" (date)" where the policy's runs came from several calls, else nothing."""
    return f" ({call.get('date')})" if len(res["calls"]) > 1 else ""


def _not_run_lines(results: dict[str, dict]) -> list[str]:
    """The rates a policy was asked for and did not run, and why (its time budget, or a rate it already failed)."""
    out = []
    for policy, res in results.items():
        for skew, rate, why in res.get("not_run") or []:
            out.append(f"- not run: {policy} at {rate:g} req/s ({'skewed' if skew else 'uniform'} trace): {why}")
    return out


def _mps_lines(results: dict[str, dict]) -> list[str]:
    """A line only where some policy ran its engines under CUDA MPS (``--mps``), naming which."""
    on = {p: bool(res.get("mps")) for p, res in results.items()}
    if not any(on.values()):
        return []
    return ["- CUDA MPS (the engines' kernels side by side): " + ", ".join(f"{p} {'on' if v else 'off'}"
                                                                          for p, v in on.items())]


def report(dirs: list[str], out_md: Path, tag: str, memory_rate: float | None = None) -> None:
    results = load_results(dirs)
    if not results:
        raise SystemExit(f"no coserving_*.json in {dirs}")
    s = summarize(results)
    meta = (results.get("static") or next(iter(results.values()))).get("meta", {})
    lines = [f"# Several models on one GPU: kvcached against a static split ({tag})", ""]
    for key in ("date", "gpu", "driver", "torch", "triton", "vllm"):
        if key in meta:
            lines.append(f"- {key}: {meta[key]}")
    for policy, res in results.items():
        lines += [f"- command ({policy}){_call_tag(res, call)}: {call.get('command')}" for call in res["calls"]]
    any_res = next(iter(results.values()))
    kv = any_res["kv_bytes_each"] / GiB
    lines += [f"- models (dummy weights, real shapes): {', '.join(any_res['models'])}; `vllm serve` each, CUDA graphs, "
              "async scheduling, requests streamed through `python -m kvcached.router`",
              f"- KV memory: {3 * kv:.1f} GiB in all. static: `--kv-cache-memory-bytes` {kv:.1f} GiB each; kvcached: "
              "elastic, sharing it (a ballast process holds the rest of the device)",
              f"- trace: Azure LLM inference 2023 (conversation), first requests of the trace scaled to each rate, "
              f"{any_res['duration_s']} s of arrivals per rate; skewed = Zipf over the models, the hot model rotating "
              "every third of the run; uniform = equal shares",
              *_mps_lines(results),
              *_not_run_lines(results),
              f"- SLO: TTFT <= k x idle TTFT (fitted per model and prompt length) and TPOT <= k x idle TPOT, "
              f"k = {KS[0]:g} and {KS[1]:g} (the headline: {KS[1]:g}, docs/coserving.md says why); idle figures of "
              "the plain vLLM engines, one request at a time", ""]
    for skew in sorted({sk for p in s["table"].values() for sk in p}, reverse=True):
        name = "skewed" if skew else "uniform"
        lines += [f"## {name} trace", "", "| policy | rate (req/s) | requests | errors | preemptions | "
                  f"attainment k={KS[0]:g} | attainment k={KS[1]:g} | goodput k={KS[0]:g} (req/s) | "
                  "TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for policy in ("static", "kvcached"):
            for rate, r in sorted(s["table"].get(policy, {}).get(skew, {}).items()):
                lines.append(f"| {policy} | {rate:g} | {r['n']} | {r['errors']} | {r['preemptions']:.0f} | "
                             f"{r['attainment'][KS[0]]:.3f} | {r['attainment'][KS[1]]:.3f} | "
                             f"{r['goodput'][KS[0]]:.2f} | {r['ttft_p50']:.3f} / {r['ttft_p99']:.3f} | "
                             f"{1e3 * r['tpot_p50']:.1f} / {1e3 * r['tpot_p99']:.1f} |")
        lines.append("")
        lines += [f"- {name}, k={k:g}: highest rate at >= 99 % attainment: "
                  + _best_summary(s, skew, k, 0.99, bold=True) for k in KS]
        lines += [*_lower_target_lines(s, skew, name), ""]
    lines += _miss_lines(results, s["idle"])
    lines += ["## Idle latency (plain vLLM engines, one request at a time)", "",
              "| model | TTFT = a + b x prompt | TPOT (ms) |", "| --- | --- | ---: |"]
    for m, im in s["idle"].items():
        lines.append(f"| {m} | {1e3 * im.ttft_a:.1f} ms + {1e6 * im.ttft_b:.2f} us/token | {1e3 * im.tpot:.2f} |")
    mem_rows = sorted(((run["rate"], run["mem"]) for run in results.get("kvcached", {}).get("runs", [])
                       if run["skew"] and run["mem"]), key=lambda row: row[0])  # merged calls: rates in order
    if mem_rows:
        lines += ["", "## KV memory of the kvcached engines (skewed trace, sampled every 100 ms)", "",
                  "| rate (req/s) | most mapped in all (GiB) | most one engine mapped (GiB) | "
                  "mapped in all at the start (GiB) |", "| ---: | ---: | ---: | ---: |"]
        for rate, mem in mem_rows:
            totals = [sum(m.values()) for _, m in mem]
            one = max(max(m.values()) for _, m in mem)
            lines.append(f"| {rate:g} | {max(totals) / GiB:.2f} | {one / GiB:.2f} | {totals[0] / GiB:.2f} |")
    lines += _demand_lines(results)
    lines += ["", "## Engines", ""]
    for policy, res in results.items():
        for call in res["calls"]:
            ready = {m: round(t, 1) for m, t in (call.get("engine_ready_s") or {}).items()}
            # the segments left after exit, every call's together (merged): written once, on the last call's line
            last = call is res["calls"][-1]
            left = f"; kvcached segments left after exit: {res.get('segments_left')}" if last else ""
            lines.append(f"- {policy}{_call_tag(res, call)}: ready after {ready} s; "
                         f"exit codes {call.get('engine_exit')}{left}")
            if "ballast" in call:
                b = call["ballast"]
                lines.append(f"  - ballast {b['bytes'] / GiB:.1f} GiB; KV mapped when it was taken "
                             f"{b['mapped_when_taken'] / GiB:.2f} GiB")
    png_att, png_mem = out_md.with_suffix(".png"), out_md.with_name(out_md.stem + "_memory.png")
    _plot_attainment(s, png_att)
    mem_rate = _plot_memory(results, png_mem, memory_rate)
    lines += ["", f"![attainment]({png_att.name})", "", f"![memory]({png_mem.name})",
              f"(memory timeline: kvcached at {mem_rate} req/s, skewed trace)" if mem_rate else "", ""]
    out_md.write_text("\n".join(lines))
    print("\n".join(lines))


def _demand_lines(results: dict[str, dict]) -> list[str]:
    """The KV memory the requests in flight needed at their peak, per policy and rate (skewed trace), and what it
    bounds: with each engine's demand growing in proportion to the rate, the static split stops when the hot
    engine's demand reaches its slice and a perfectly elastic cache when all engines' demand reaches the budget,
    so their highest rates stand at most in the ratio (budget / all) / (slice / hot) = 3 x the hot share."""
    rows = []
    for policy in ("static", "kvcached"):
        res = results.get(policy)
        if res is None:
            continue
        per_token = {m: kv_bytes_per_token(MODELS[m]) for m in res["models"] if m in MODELS}
        if not per_token:
            continue
        for run in sorted(res["runs"], key=lambda r: (r["skew"], r["rate"])):
            if not run["skew"]:
                continue
            peak = demand_peak(kv_demand(_outcomes(run), per_token))
            if peak is None:
                continue
            t, need = peak
            total = sum(need.values())
            hot = max(need, key=need.get)
            share = need[hot] / total if total else float("nan")
            each = ", ".join(f"{m} {need[m] / GiB:.2f}" for m in need)
            rows.append(f"| {policy} | {run['rate']:g} | {t:.1f} | {total / GiB:.2f} | {each} | {hot} | "
                        f"{share:.2f} | {3 * share:.2f} |")
    if not rows:
        return []
    slice_gib = next(iter(results.values()))["kv_bytes_each"] / GiB
    return ["", "## KV memory the requests in flight needed (skewed trace, from the per-request data)", "",
            "Prompt and output tokens so far x each model's KV bytes per token, waiting requests included, every "
            f"100 ms; the row is the moment all engines together needed the most. Budget: {3 * slice_gib:.1f} "
            f"GiB in all, {slice_gib:.1f} GiB a slice (static). Elastic bound: 3 x the hot "
            "engine's share, the most a perfectly elastic cache could gain over the static split at that demand "
            "(each engine's demand in proportion to the rate; it is derived from the run, not measured).", "",
            "| policy | rate (req/s) | at (s) | all engines (GiB) | per engine (GiB) | hot | hot share | "
            "elastic bound |", "| --- | ---: | ---: | ---: | --- | --- | ---: | ---: |", *rows]


def _plot_attainment(s: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, k in zip(axes, KS, strict=True):
        for policy, color in (("static", "tab:red"), ("kvcached", "tab:blue")):
            for skew, style in ((max([sk for sk in s["table"].get(policy, {})] or [0]), "-"), (0.0, "--")):
                pts = sorted(s["table"].get(policy, {}).get(skew, {}).items())
                if pts:
                    ax.plot([p[0] for p in pts], [p[1]["attainment"][k] for p in pts], style, color=color, marker="o",
                            label=f"{policy}, {'skewed' if skew else 'uniform'}")
        ax.axhline(0.99, color="grey", lw=0.8)
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(f"SLO = {k:g} x idle TTFT and TPOT")
        ax.set_ylim(0, 1.02)
    axes[0].set_ylabel("SLO attainment")
    axes[0].legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def _plot_memory(results: dict[str, dict], png: Path, rate: float | None = None) -> float | None:
    """kvcached's engines' KV memory over one skewed run: ``rate``'s, else the highest rate whose attainment
    at the loose multiple is >= 99 %, else the lowest rate."""
    res = results.get("kvcached")
    if not res:
        return None
    runs = [r for r in res["runs"] if r["skew"] and r["mem"]]
    if not runs:
        return None
    s = summarize({"kvcached": res, **({"static": results["static"]} if "static" in results else {})})
    good = [r for r in runs if s["table"]["kvcached"][r["skew"]][r["rate"]]["attainment"][KS[-1]] >= 0.99]
    chosen = [r for r in runs if r["rate"] == rate] if rate is not None else []
    run = chosen[0] if chosen else (good[-1] if good else runs[0])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    ts = [m[0] for m in run["mem"]]
    for model in res["models"]:
        ax.plot(ts, [m[1].get(model, 0) / GiB for m in run["mem"]], label=f"{model} (kvcached)")
    ax.plot(ts, [sum(m[1].values()) / GiB for m in run["mem"]], color="black", lw=1, label="all engines")
    ax.axhline(res["kv_bytes_each"] / GiB, color="tab:red", ls="--", lw=1, label="static slice of each engine")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("mapped KV memory (GiB)")
    ax.set_title(f"kvcached, skewed trace at {run['rate']:g} req/s: KV memory mapped by each engine")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return run["rate"]


def estimate(skews: list[float], tpots: list[float], rates: list[float], kv_gib: float, duration: float) -> None:
    """``memory_bound_rates`` for this benchmark's three models on the committed trace: what a set-up can show
    before a GPU run is spent on it."""
    models = list(MODELS)
    per_token = {m: kv_bytes_per_token(MODELS[m]) for m in models}
    ttft_s = 0.15
    print(f"Memory-bound rates on the trace (no GPU): {duration:g} s per rate, {kv_gib:g} GiB a slice, "
          f"{len(models) * kv_gib:g} GiB shared, TTFT {ttft_s:g} s, rates {','.join(f'{r:g}' for r in rates)}; "
          "an estimate, not a measurement.\n")
    print("| Zipf skew | TPOT (ms) | static: highest rate | elastic: highest rate | ratio |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for skew in skews:
        for tpot in tpots:
            st, el = memory_bound_rates(models, per_token, int(kv_gib * GiB), rates, duration, skew, ttft_s=ttft_s,
                                        tpot_s=tpot / 1000)
            ratio = f"{el / st:.2f}" if st and el else "-"
            print(f"| {skew:g} | {tpot:g} | {st if st is not None else '-'} | {el if el is not None else '-'} | "
                  f"{ratio} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def floats(text: str) -> list[float]:  # argparse names it in its error: "invalid floats value"
        return [float(x) for x in text.split(",")]

    r = sub.add_parser("run")
    r.add_argument("--policy", choices=("static", "kvcached"), required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--workdir", default="/tmp/kvcached_coserving")
    r.add_argument("--kv-gib", type=float, default=2.0, help="KV memory per engine (GiB); the budget is 3x this")
    r.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per rate")
    r.add_argument("--drain", type=float, default=30.0, help="seconds a run waits after its last arrival")
    r.add_argument("--skew", type=float, default=1.5, help="Zipf exponent of the skewed trace")
    r.add_argument("--rates", type=floats, default=[3, 4.5, 6.75, 10, 15])
    r.add_argument("--uniform-rates", type=lambda s: [float(x) for x in s.split(",") if x], default=[6.75, 10])
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--budget-s", type=float, default=480, help="start no new rate after this many seconds")
    r.add_argument("--smoke", action="store_true", help="three tiny models on the CPU: a check of the harness")
    r.add_argument("--mps", action="store_true",
                   help="run the engines as clients of one CUDA MPS daemon (kernels of the engines side by side)")
    p = sub.add_parser("report")
    p.add_argument("dirs", nargs="+")
    p.add_argument("--md", default=str(HERE / "results" / "coserving_h200.md"))
    p.add_argument("--tag", default="NVIDIA H200")
    p.add_argument("--memory-rate", type=float, help="the skewed run whose memory timeline is plotted")
    e = sub.add_parser("estimate", help="the memory-bound rates the trace allows per skew (no GPU, no engines)")
    e.add_argument("--skews", type=floats, default=[0, 1.5, 2.0, 2.5, 3.0])
    e.add_argument("--tpot-ms", type=floats, default=[15, 25], help="time per output token assumed (ms)")
    e.add_argument("--rates", type=floats, default=[x / 4 for x in range(4, 41)])
    e.add_argument("--kv-gib", type=float, default=2.0)
    e.add_argument("--duration", type=float, default=30.0)
    m = sub.add_parser("mps-check", help="whether CUDA MPS runs here with kvcached's CUDA backend as its client")
    m.add_argument("--workdir", default=None, help="the daemon's pipe and log directories (default: a new temp dir)")
    m.add_argument("client", nargs="*", help="the client command (default: the CUDA backend's GPU tests)")
    args = ap.parse_args()
    if args.cmd == "mps-check":
        sys.exit(mps_check(args.client or MPS_CHECK_CLIENT, Path(args.workdir or tempfile.mkdtemp(prefix="mps_"))))
    if args.cmd == "run":
        run_policy(args)
    elif args.cmd == "estimate":
        estimate(args.skews, args.tpot_ms, args.rates, args.kv_gib, args.duration)
    else:
        report(args.dirs, Path(args.md), args.tag, args.memory_rate)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()

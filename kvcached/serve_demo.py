"""Two real vLLM engines sharing one device's memory through kvcached.

    python -m kvcached.serve_demo [--models DIR_A DIR_B] [--requests 32] [--max-tokens 120]

Starts two vLLM engines (each in its own process, ``ENABLE_KVCACHED=true``: the
``vllm.general_plugins`` entry point does the rest) on vLLM's default device, by
default on two tiny local models made on the spot (random weights, no downloads;
the repository's ``tools/tiny_model.py`` makes them, so run that from the root).
Engine A gets a burst of requests, then engine B. Every half second it prints
each engine's mapped KV memory, read from its ``/dev/shm`` segment (what
``kvctl list`` shows), then a few outputs and a one-line verdict: memory rose
under each burst and fell back after it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MiB = 1 << 20


_TOPICS = ("elastic memory for the KV cache", "two engines sharing one device", "paged attention over blocks",
           "pages that follow the load", "a small model with random weights", "the numbers from zero to sixteen")


def _prompts(n: int, tag: str) -> list[str]:
    return [f"{tag}{i} Tell me about {_TOPICS[i % len(_TOPICS)]}, part {i * 7 % 13}." for i in range(n)]


def _tiny_model_maker():
    """``tools.tiny_model.make_tiny_llama``: a development tool of the repository, not of the package."""
    try:
        from tools.tiny_model import make_tiny_llama
    except ModuleNotFoundError as exc:
        if exc.name not in ("tools", "tools.tiny_model"):
            raise
        raise SystemExit("serve_demo: the default tiny models are made by tools/tiny_model.py, which is in "
                         "kvcached's repository, not in the installed package. Run the demo from the repository "
                         "root (bash scripts/dev.sh demo), or pass --models DIR_A DIR_B.") from None
    return make_tiny_llama


def run_engine(args: argparse.Namespace) -> None:
    """Child: one engine; waits for ``go`` on stdin, serves the burst, prints the outputs, idles."""
    # vLLM logs to stdout; keep stdout for our protocol lines and send everything else to the log
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, max_model_len=256, enforce_eager=True, seed=0, max_num_seqs=args.requests)
    print("READY", file=proto, flush=True)
    sys.stdin.readline()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    # a burst can be over between two of the parent's samples: the engine records its own peak
    peak, stop = [0], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _used(os.environ.get("KVCACHED_IPC_NAME", "")) or 0)
            stop.wait(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t0 = time.monotonic()
    results = llm.generate(_prompts(args.requests, args.name), params, use_tqdm=False)
    stop.set()
    watcher.join()
    texts = [r.outputs[0].text for r in results]
    print("DONE " + json.dumps({"seconds": time.monotonic() - t0, "texts": texts, "peak": peak[0],
                                "tokens": sum(len(r.outputs[0].token_ids) for r in results)}), file=proto,
          flush=True)
    sys.stdin.readline()  # stay up (and keep the segment) until the parent has seen memory fall


def _used(name: str) -> int | None:
    from kvcached import mem_info

    try:
        return int(mem_info.read_segment(name).used_size)
    except (FileNotFoundError, ValueError):
        return None


class Engine:
    def __init__(self, label: str, model: str, ipc: str, args: argparse.Namespace) -> None:
        env = dict(os.environ, ENABLE_KVCACHED="true", KVCACHED_IPC_NAME=ipc, HF_HUB_OFFLINE="1",
                   VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false")
        env.setdefault("KVCACHED_MAX_CACHED_TOKENS", "0")  # the demo shows load, not the prefix cache
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        cmd = [sys.executable, "-m", "kvcached.serve_demo", "--engine", label, "--model", model,
               "--requests", str(args.requests), "--max-tokens", str(args.max_tokens)]
        self.label, self.ipc = label, ipc
        self.log = open(Path(args.workdir) / f"engine_{label}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True)
        self.samples: list[int] = []
        self.result: dict | None = None

    def expect(self, word: str) -> str:
        line = self.proc.stdout.readline()
        if not line.startswith(word):
            raise SystemExit(f"engine {self.label} failed (see {self.log.name}): {line.strip() or 'exited'}")
        return line

    def send(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.log.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs=2, metavar=("DIR_A", "DIR_B"), help="two local HF models (default: tiny)")
    parser.add_argument("--requests", type=int, default=32, help="requests per burst")
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--timeout", type=float, default=900, help="give up after this many seconds")
    parser.add_argument("--workdir", default=None, help="where models and engine logs go (default: a temp dir)")
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.engine:
        args.name = args.engine
        run_engine(args)
        return 0

    args.workdir = args.workdir or tempfile.mkdtemp(prefix="kvcached_serve_demo_")
    if args.models:
        models = list(args.models)
    else:
        make_tiny_llama = _tiny_model_maker()
        # head size 64 x 4 KV heads: a 256 KiB block per layer, so a burst needs many 2 MiB pages
        models = [str(make_tiny_llama(Path(args.workdir) / f"model_{x}", seed=i, hidden_size=256, num_kv_heads=4))
                  for i, x in enumerate("ab")]
    tag = os.getpid()
    engines = [Engine(x.upper(), m, f"kvcached_demo_{x}_{tag}", args) for x, m in zip("ab", models, strict=True)]
    try:
        print(f"starting two vLLM engines with ENABLE_KVCACHED=true (logs in {args.workdir}) ...", flush=True)
        for e in engines:
            e.expect("READY")
        print(f"{'t (s)':>6} {'A mapped KV':>12} {'B mapped KV':>12}  event", flush=True)
        t0 = time.monotonic()
        started: list[Engine] = []
        while time.monotonic() - t0 < args.timeout:
            now = time.monotonic() - t0
            event = ""
            if not started and now >= 1.0:
                engines[0].send()
                started.append(engines[0])
                event = f"burst of {args.requests} requests to A"
            for e in started:
                if e.result is None and _ready(e):
                    e.result = json.loads(e.expect("DONE")[5:])
                    e.samples.append(e.result["peak"])
                    event = f"{e.label} done: {e.result['tokens']} tokens in {e.result['seconds']:.1f} s"
                    if e is engines[0]:
                        engines[1].send()
                        started.append(engines[1])
                        event += f"; burst of {args.requests} requests to B"
            used = [_used(e.ipc) for e in engines]
            for e, u in zip(engines, used, strict=True):
                if u is not None:
                    e.samples.append(u)
            cells = [f"{u / MiB:8.0f} MiB" if u is not None else f"{'-':>12}" for u in used]
            print(f"{now:6.1f} {cells[0]} {cells[1]}  {event}", flush=True)
            if all(e.result and e.samples[-1] == min(e.samples) for e in engines):
                break
            time.sleep(0.5)
        for e in engines:
            print(f"\nengine {e.label} ({models[engines.index(e)]}), first outputs:")
            for text in (e.result or {}).get("texts", [])[:2]:
                print(f"  {text[:70]!r}")
        ok = all(e.result and e.samples and max(e.samples) > min(e.samples) and e.samples[-1] == min(e.samples)
                 for e in engines)
        peaks = ", ".join(f"{e.label} {min(e.samples) / MiB:.0f} -> {max(e.samples) / MiB:.0f} -> "
                          f"{e.samples[-1] / MiB:.0f} MiB" for e in engines if e.samples)
        print(f"\nverdict: {'OK' if ok else 'FAILED'}: mapped KV memory followed each burst ({peaks})")
        return 0 if ok else 1
    finally:
        for e in engines:
            e.stop()


def _ready(engine: Engine) -> bool:
    import select

    return bool(select.select([engine.proc.stdout], [], [], 0)[0])


if __name__ == "__main__":
    sys.exit(main())

"""Runs one vLLM engine in this process and prints one ``RESULT <json>`` line.

The end-to-end tests start it as a subprocess (a fresh process per engine
configuration: vLLM's plugins, kvcached's runtime and the Triton interpreter
switch are all per-process). Usage::

    python engine_runner.py '<json spec>'    (or @file holding it)
    python engine_runner.py --fork-server    (see fork_server)

Spec keys: ``model`` (dir), ``prompts`` (list of str) or ``prompt_token_ids``,
``max_tokens``, ``dtype``, ``max_num_seqs``, ``ipc_name`` (the /dev/shm segment to
sample, or null), ``settle_s`` (how long to wait after the run for the mapped memory
to fall), ``repeat`` (generate that many times) or ``phases`` (a list of
``{"generate": true}``, ``{"limit_bytes": N}`` (as kvctl sets it; -1 lifts it),
``{"settle_s": x}``), ``prompt_logprobs`` (k: teacher-forced logprobs of the prompts),
``ready_file`` / ``wait_file`` / ``signal_file`` (written after start / waited for
before the first phase / written after the last), ``start_after`` (a file waited for
before the engine starts), ``linger_s``, and vLLM's own
``attention_backend``, ``enforce_eager``, ``gpu_memory_utilization``,
``kv_cache_memory_bytes``, ``load_format``, ``async_scheduling``,
``compilation_config``, ``max_num_batched_tokens``, ``block_size``,
``skip_tokenizer_init``, ``enable_prefix_caching``, ``max_model_len``.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import threading
import time
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _device_free() -> int | None:
    import torch

    return int(torch.cuda.mem_get_info()[0]) if torch.cuda.is_available() else None


class Sampler:
    """Reads ``used_size`` from a kvcached /dev/shm segment every ``period`` seconds."""

    def __init__(self, name: str | None, period: float = 0.02) -> None:
        self.name = name
        self.period = period
        self.samples: list[tuple[float, int, int | None]] = []
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

    def read_now(self) -> int | None:
        """:meth:`read` after this process's publisher has published (an engine in this process). It publishes
        every 0.1 s (and soon after a pool registers), and vLLM builds its scheduler, whose pool maps the null
        block's page, late in ``LLM()``: a reading taken right after could miss that page (0 B idle, then the
        page's bytes after the run: GPU vLLM runs 17 and 22; run 24 caught a segment at 0 B with the page held)."""
        if self.name:
            from kvcached import mem_info

            publisher = mem_info.publisher()
            if publisher is not None and publisher.name == self.name:
                publisher.tick()
        return self.read()

    def _run(self) -> None:
        while not self._stop.is_set():
            used = self.read()
            if used is not None:
                self.samples.append((time.time(), used, _device_free()))  # wall clock: comparable across engines
            self._stop.wait(self.period)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _prompts(spec: dict) -> list:
    if spec.get("prompt_token_ids"):
        from vllm.inputs import TokensPrompt

        return [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompt_token_ids"]]
    return spec["prompts"]


def _teacher_forced(results: list) -> list[dict]:
    """Per prompt: the logprob vLLM gave each actual next prompt token, and its top-1 token."""
    out = []
    for r in results:
        ids = list(r.prompt_token_ids)
        lps, top, margin = [], [], []
        for pos, entry in enumerate(r.prompt_logprobs or []):
            if entry is None or pos == 0:
                continue
            lps.append(float(entry[ids[pos]].logprob))
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)
            top.append(int(ranked[0][0]))
            # how far ahead the top token is (with prompt_logprobs >= 2): near-ties may flip between kernels
            margin.append(float(ranked[0][1].logprob - ranked[1][1].logprob) if len(ranked) > 1 else None)
        out.append({"logprobs": lps, "top1": top, "margin": margin, "targets": ids[1:]})
    return out


def _decode_steps(out: object) -> list[list]:
    """Per generated token (``logprobs`` >= 2): [token, its logprob, its lead over the second best]."""
    steps = []
    for tok, entry in zip(out.token_ids, out.logprobs or [], strict=False):
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)
        lead = float(ranked[0][1].logprob - ranked[1][1].logprob) if len(ranked) > 1 else None
        steps.append([int(tok), float(entry[tok].logprob), lead])
    return steps


def _scheduler(llm: object) -> object | None:
    """vLLM's scheduler when the engine core runs in this process, else None (every hook below needs it)."""
    try:
        return llm.llm_engine.engine_core.engine_core.scheduler
    except AttributeError:  # the engine core runs in its own process
        return None


def _watch_peak(llm: object) -> list:
    """The pool's mapped bytes after every allocation (an engine in this process only): a burst's peak can
    fall between two of the sampler's reads."""
    peak: list = [None]
    kv = getattr(getattr(getattr(_scheduler(llm), "kv_cache_manager", None), "block_pool", None), "kv", None)
    if kv is None:
        return peak
    alloc = kv.alloc
    peak[0] = int(kv.get_mapped_memory_size())

    def watched(n: int) -> object:
        got = alloc(n)
        peak[0] = max(peak[0], int(kv.get_mapped_memory_size()))
        return got

    kv.alloc = watched
    return peak


def _pool_state(llm: object) -> dict | None:
    """Who holds the pool's pages (an engine in this process only), for a run whose memory did not fall back:
    blocks requests hold, reservations, cached blocks, frees waiting for the device, and the waiter's health."""
    sched = _scheduler(llm)
    if sched is None:
        return None
    try:
        pool = sched.kv_cache_manager.block_pool
        kv = pool.kv
        deferred = getattr(kv, "_deferred", None)
        queue = list(getattr(deferred, "_queue", ()))
        waiter = getattr(deferred, "_waiter", None)
        alloc = kv.page_allocator
        return {
            "pages_in_use": int(alloc.num_in_use), "pages_reserved": int(alloc.num_reserved),
            "allocated_blocks": kv.num_allocated_blocks(), "request_blocks": pool._num_in_use(),
            "held_for_scheduler": pool._held, "try_to_reserve": len(kv.reserved_blocks),
            "cached_blocks": pool.free_block_queue.num_free_blocks, "pending_free": kv.pending_free_blocks,
            "pending_batches": len(queue), "pending_done": [bool(e.query()) for e, _ in queue][:8],
            "waiter_alive": None if waiter is None else waiter.is_alive(),
            "waiter_error": repr(getattr(deferred, "error", None)),
            "pages_with_blocks": sorted(p for p, n in pool._page_count.items() if n > 0)[:16],
        }
    except Exception as exc:  # only diagnostics (a plain vLLM pool has none of this)
        return {"error": repr(exc)}


def _late_fall_back(llm: object, sampler: Sampler, idle: int) -> dict:
    """Who holds the pages now, then whether they go back given more time (a delay) or not (a leak)."""
    late = {"state": _pool_state(llm)}
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10 and sampler.read() != idle:
        time.sleep(0.05)
    late.update(used=sampler.read(), waited_s=round(time.monotonic() - t0, 2), state_after=_pool_state(llm))
    print(f"kvcached: memory did not fall back after the run: {late}", flush=True)
    return late


def _kv_views(runner: object, layers: int = 4) -> list | None:
    """Shape, strides, dtype and base-address alignment (bytes mod 1024) of the KV cache tensors of the first
    ``layers`` layers (Mamba layers: their state tensors), as the model sees them: which specialisation of a
    Triton kernel runs (alignment, strides divisible by 16) may follow from them."""
    caches = getattr(runner, "kv_caches", None)
    if not caches:  # a runner without the list: the layers' own caches (vLLM binds them to every layer)
        ctx = getattr(getattr(getattr(runner, "vllm_config", None), "compilation_config", None),
                      "static_forward_context", None) or {}
        caches = [getattr(layer, "kv_cache", None) for layer in ctx.values() if hasattr(layer, "kv_cache")]
    if not caches:
        return None

    def flat(x: object) -> list:
        if isinstance(x, (list, tuple)):
            return [t for y in x for t in flat(y)]
        return [x] if hasattr(x, "stride") else []

    try:
        return [[[list(t.shape), list(t.stride()), str(t.dtype), int(t.data_ptr()) % 1024] for t in flat(entry)]
                for entry in list(caches)[:layers]]
    except Exception as exc:  # only diagnostics
        return [repr(exc)]


def _nixl_state() -> dict | None:
    """What this worker's NixlConnector registered (``kv_transfer_config`` engines): per region its base
    address, block length and stride, and the bytes of the storages it registered."""
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    except ImportError:
        return None
    worker = getattr(get_kv_transfer_group(), "connector_worker", None) if has_kv_transfer_group() else None
    if worker is None or not hasattr(worker, "block_len_per_layer"):
        return None
    storages = {v.untyped_storage().data_ptr(): v.untyped_storage().nbytes() for v in worker.device_kv_caches.values()}
    return {"num_blocks": worker.num_blocks, "block_len": worker.block_len_per_layer,
            "block_stride": worker.block_stride_per_layer, "registered": sorted(storages.values()),
            "bases": [b - min(storages) for b in worker.kv_caches_base_addr[worker.engine_id][worker.tp_rank]]}


def _count_preemptions(llm: object) -> list[int]:
    """Preemptions the scheduler makes (an engine in this process only): batches with a preempted and
    recomputed request differ from an unpreempted run's, so their bf16 rounding may differ too."""
    count = [0]
    sched = _scheduler(llm)
    preempt = getattr(sched, "_preempt_request", None)
    if preempt is None:
        return count

    def counted(*args: object, **kwargs: object) -> object:
        count[0] += 1
        return preempt(*args, **kwargs)

    sched._preempt_request = counted
    return count


def _record_batches(llm: object) -> list[list] | None:
    """Every batch the scheduler makes (an engine in this process only), as (request id, tokens scheduled) per
    request. Two engines that schedule the same batches give their kernels the same shapes (a GEMM's algorithm,
    and so its rounding, follows the batch's token count); preemption counts alone do not show that, since a
    request can also wait for room without being preempted. The caller empties the list per phase."""
    sched = _scheduler(llm)
    if sched is None:
        return None
    schedule = sched.schedule
    steps: list[list] = []

    def recorded(*args: object, **kwargs: object) -> object:
        out = schedule(*args, **kwargs)
        counts = getattr(out, "num_scheduled_tokens", None)
        if counts:
            steps.append([(str(rid), int(n)) for rid, n in counts.items()])
        return out

    sched.schedule = recorded
    return steps


def _batch_digests(steps: list[list]) -> list[str]:
    """One short digest per batch, with request ids counted from the phase's first (``LLM.generate`` numbers
    requests on from the last call, and newer vLLM appends a random suffix to each id)."""

    def number(rid: str) -> int | str:
        head = rid.split("-")[0]
        return int(head) if head.isdigit() else rid

    numbered = [[(number(r), k) for r, k in step] for step in steps]
    first = min((n for step in numbered for n, _ in step if isinstance(n, int)), default=0)
    out = []
    for step in numbered:
        rows = sorted((n - first if isinstance(n, int) else n, k) for n, k in step)
        out.append(hashlib.blake2s(repr(rows).encode(), digest_size=6).hexdigest())
    return out


def _segment_peak(name: str | None, reset: bool = False) -> int | None:
    """The engine's own high-water mark of KV bytes in use, from its segment (any process layout);
    ``reset`` starts a new window first, as ``kvctl peak --reset`` does."""
    if not name:
        return None
    from kvcached import mem_info

    if reset:
        return mem_info.wait_peak_reset(name, mem_info.request_peak_reset(name)).peak_used
    time.sleep(2 * mem_info.PERIOD)  # the engine publishes once a period
    return mem_info.read_segment(name).peak_used


def _wait_for(path: str | None, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while path and not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.05)


def _granite_layer_names() -> None:
    """vLLM 0.24 knows Granite-4.0-H's layer types by their names before transformers 5.13 ("mamba",
    "attention"); transformers >= 5.13 loads every config under the new names ("linear_attention",
    "full_attention"), so plain vLLM 0.24 cannot build the model at all. vLLM 0.27 added the new names
    to the same table; this adds them the same way, in this engine process (the GPU machine has
    transformers 5.17). Nothing of kvcached is involved."""
    try:
        from vllm.model_executor.models import granitemoehybrid as g
    except ImportError:
        return
    table = getattr(g, "ALL_DECODER_LAYER_TYPES", None)
    if isinstance(table, dict) and "mamba" in table:
        table.setdefault("linear_attention", table["mamba"])
        table.setdefault("full_attention", table["attention"])


def _autotune_choices() -> dict[str, list[str]]:
    """The config each of vLLM's autotuned Triton kernels chose in this process, by kernel. Each process times
    the candidates itself, so engines sharing a GPU can choose differently; two choices that tile a reduction
    differently sum it in another order and give other bits (vLLM 0.24's Mamba2 prefill kernels are autotuned)."""
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        return {}
    out: dict[str, list[str]] = {}
    for mod_name, mod in list(sys.modules.items()):
        if not mod_name.startswith("vllm.") or mod is None:
            continue
        for attr, obj in list(vars(mod).items()):
            if isinstance(obj, Autotuner) and obj.cache:
                out[f"{mod_name}.{attr}"] = sorted(f"{key}: {cfg}" for key, cfg in obj.cache.items())
    return out


def main() -> None:
    arg = sys.argv[1]
    if arg.startswith("@"):  # a spec too long for the command line
        with open(arg[1:]) as f:
            arg = f.read()
    spec = json.loads(arg)
    from vllm import LLM, SamplingParams

    _granite_layer_names()

    kwargs = dict(model=spec["model"], max_model_len=spec.get("max_model_len", 256),
                  enforce_eager=spec.get("enforce_eager", True), dtype=spec.get("dtype", "float32"), seed=0,
                  max_num_seqs=spec.get("max_num_seqs", 16))
    for key in ("attention_backend", "enable_prefix_caching", "gpu_memory_utilization", "kv_cache_memory_bytes",
                "load_format", "async_scheduling", "compilation_config", "max_num_batched_tokens", "block_size",
                "skip_tokenizer_init", "tensor_parallel_size", "distributed_executor_backend", "kv_transfer_config"):
        if spec.get(key) is not None:
            kwargs[key] = spec[key]
    # start_after: another engine's ready file (it has autotuned and cached its Triton kernels' choices for this one)
    _wait_for(spec.get("start_after"))
    t0 = time.monotonic()
    llm = LLM(**kwargs)
    start_s = time.monotonic() - t0
    if spec.get("warmup"):  # the first full prefill: activation memory is held from here on
        llm.generate(_prompts(spec), SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
        time.sleep(1.0)  # its blocks go back once the device is done with them
    if spec.get("ready_file"):
        open(spec["ready_file"], "w").close()
    sampler = Sampler(spec.get("ipc_name"))
    idle_published = sampler.read()  # what the segment said then (diagnostics: see Sampler.read_now)
    idle_before = sampler.read_now()
    idle_state = _pool_state(llm) if idle_before is not None else None  # the holders then, for a late fall-back
    peak = _watch_peak(llm)
    preemptions = _count_preemptions(llm)
    batches = _record_batches(llm)
    _segment_peak(spec.get("ipc_name"), reset=True)  # the window starts at the idle engine
    prompts = _prompts(spec)
    params = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 16), ignore_eos=True,
                            detokenize=not spec.get("skip_tokenizer_init", False), logprobs=spec.get("logprobs"))
    outputs, cached_tokens, phases, decode = [], [], [], None
    teacher = None
    with sampler:
        _wait_for(spec.get("wait_file"))
        t1 = time.monotonic()
        # phases: {"generate": true} | {"limit_bytes": N} (as kvctl sets it; -1 lifts it) | {"settle_s": x}
        for phase in spec.get("phases") or [{"generate": True}] * spec.get("repeat", 1):
            record = {"phase": phase, "used_before": sampler.read(), "t0": time.time()}
            if batches is not None:
                batches.clear()
            if phase.get("limit_bytes") is not None:
                import subprocess

                size = "none" if phase["limit_bytes"] < 0 else str(int(phase["limit_bytes"]))
                subprocess.run([sys.executable, "-m", "kvcached.cli.kvctl", "limit", spec["ipc_name"], size],
                               check=True)
                time.sleep(0.5)  # the engine's monitor applies it within one period
            if phase.get("generate"):
                results = llm.generate(prompts, params, use_tqdm=False)
                tokens = [list(r.outputs[0].token_ids) for r in results]
                outputs.append(tokens)
                record["tokens"] = tokens
                if spec.get("logprobs"):
                    record["decode"] = [_decode_steps(r.outputs[0]) for r in results]
                    decode = record["decode"] if decode is None else decode
                cached_tokens.append([int(r.num_cached_tokens or 0) for r in results])
                record["batches"] = _batch_digests(batches) if batches is not None else None
            time.sleep(phase.get("settle_s", 0.0))
            record["used_after"] = sampler.read()
            record["preemptions"] = preemptions[0]
            record["t1"] = time.time()
            if spec.get("rank_state"):  # tensor parallel: what every worker maps (kvcached's worker RPC)
                record["ranks"] = llm.collective_rpc("kvcached_rank_state")
            phases.append(record)
        segment_peak = _segment_peak(spec.get("ipc_name"))
        if spec.get("prompt_logprobs"):
            tp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=int(spec["prompt_logprobs"]))
            teacher = _teacher_forced(llm.generate(prompts, tp, use_tqdm=False))
        run_s = time.monotonic() - t1
        time.sleep(spec.get("settle_s", 0.0))
        if spec.get("signal_file"):
            open(spec["signal_file"], "w").close()
        time.sleep(spec.get("linger_s", 0.0))
    after = sampler.read_now()
    late = None
    if after is not None and idle_before is not None and after != idle_before:
        late = {"state_idle": idle_state, **_late_fall_back(llm, sampler, idle_before)}
    backend = None
    cached_blocks = None
    kv_planned = None
    kv_groups = None
    kv_views = None
    try:
        core = llm.llm_engine.engine_core.engine_core
        pool = core.scheduler.kv_cache_manager.block_pool
        pool_kind = type(pool).__name__
        kv_groups = [type(g.kv_cache_spec).__name__ for g in core.scheduler.kv_cache_config.kv_cache_groups]
        if pool_kind == "KVCachedBlockPool":
            cached_blocks = pool.free_block_queue.num_free_blocks  # ours holds only cached blocks
        worker = core.model_executor.driver_worker.worker  # the uniprocess executor only
        kv_planned = getattr(worker, "available_kv_cache_memory_bytes", None)
        runner = worker.model_runner
        kv_views = _kv_views(runner)
        backend = runner.attn_groups[0][0].backend.get_name()
    except Exception as exc:  # only diagnostics
        pool_kind = locals().get("pool_kind") or f"unknown ({exc})"
    limit = None
    from kvcached import vmm_ops

    page_size = vmm_ops.runtime().page_size if vmm_ops.is_initialized() else None  # this process's runtime
    if spec.get("ipc_name"):
        from kvcached import mem_info

        try:
            limit = int(mem_info.read_segment(spec["ipc_name"]).limit)
        except (FileNotFoundError, ValueError):
            pass
    print("RESULT " + json.dumps({
        "tokens": outputs[0] if outputs else None, "all_tokens": outputs, "start_s": start_s, "run_s": run_s,
        "idle_before": idle_before, "idle_published": idle_published, "after": after, "late": late,
        "samples": sampler.samples, "phases": phases,
        "backend": backend, "pool": pool_kind, "cached_tokens": cached_tokens, "cached_blocks": cached_blocks,
        "teacher": teacher, "decode": decode, "limit": limit, "kv_planned": kv_planned, "peak_used": peak[0],
        "segment_peak": segment_peak, "preemptions": preemptions[0], "kv_groups": kv_groups, "page_size": page_size,
        "runner": type(runner).__module__ if backend else None, "autotune": _autotune_choices(),
        "batches": next((p["batches"] for p in phases if "batches" in p), None),
        "kv_views": kv_views, "nixl": _nixl_state(),
    }), flush=True)


def fork_server() -> None:
    """Import vLLM once, then fork an engine for each request: ``{"spec", "env", "log"}`` JSON lines on stdin.

    Importing vLLM is most of a CPU engine's start (about 10 of 17 s on the 2-core CI machine). For each request
    this answers the forked engine's pid; the engine takes ``env`` as its whole environment and writes its output
    to ``log``, and its exit status goes to ``log + ".rc"`` once it has exited. The harness starts one server per
    environment without kvcached's own variables (they are the engine's own: kvcached is not imported here, so
    nothing of it is set up before the engine's environment is in place) and talks to it from one thread. The
    engine then exits as a fresh process would (non-daemon threads joined, atexit handlers run).
    """
    replies = os.fdopen(os.dup(1), "w", buffering=1)  # the harness reads pids here, and nothing else
    os.dup2(2, 1)  # what vLLM prints goes with its errors
    from vllm import LLM, SamplingParams  # noqa: F401

    early = sorted(m for m in sys.modules if m == "kvcached" or m.startswith("kvcached."))
    if early:
        raise SystemExit(f"fork server: importing vLLM imported {early}; engines would not read their own "
                         "KVCACHED_* settings (start them without the fork server: KVCACHED_E2E_FORK=0)")
    logs: dict[int, str] = {}
    signal.signal(signal.SIGCHLD, lambda *_: reap_engines(logs))
    replies.write("ready\n")
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # its pid is in logs before it can be reaped
        pid = os.fork()
        if pid == 0:
            replies.close()
            _forked_engine(request)  # raises SystemExit: the interpreter's own exit, as a fresh process's
        logs[pid] = request["log"]
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        replies.write(f"{pid}\n")


def reap_engines(logs: dict[int, str]) -> None:
    """Write each exited child's status to its ``logs[pid] + ".rc"``, then reap it. The order is the harness's
    contract (``harness.ForkedEngine``): an engine's pid stays (a zombie) until its status is on disk, so a pid
    that is gone with no status means the server is gone, never that the status is on its way."""
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)  # its status, not yet reaped
        except ChildProcessError:
            return
        if info is None:
            return
        log = logs.pop(info.si_pid, None)
        if log:
            code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status  # killed: minus the signal
            with open(log + ".rc.tmp", "w") as f:
                f.write(str(code))
            os.replace(log + ".rc.tmp", log + ".rc")
        os.waitpid(info.si_pid, 0)


def _forked_engine(request: dict) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the engine's own children (kvctl, TP ranks) are its to wait for
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # not the server's request pipe
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    sys.argv = [__file__, request["spec"]]
    code = 1
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:
        traceback.print_exc()
    raise SystemExit(code)


if __name__ == "__main__":
    if sys.argv[1:] == ["--fork-server"]:
        fork_server()
    else:
        main()

"""Starting engines for the end-to-end tests: one process per engine (``engine_runner.py``), forked from a
server that has imported vLLM where the engine is a CPU one."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
RUNNER = HERE / "engine_runner.py"
REPO = HERE.parent.parent


# vLLM releases installed beside the venv's own (``pip install --target``; see scripts/dev.sh), put first on an
# engine's path by ``engine_env(vllm=...)``: the supported range's other end runs in CI too.
# KVCACHED_E2E_VLLM_RANGE=1 adds every release between (``bash scripts/dev.sh range`` installs and runs them).
VLLM_OVERLAYS = {"0.27.0": REPO / ".venv-vllm027"}
if os.environ.get("KVCACHED_E2E_VLLM_RANGE") == "1":
    VLLM_OVERLAYS.update({f"0.{minor}.0": REPO / f".venv-vllm0{minor}" for minor in (28, 29, 30, 31)})
LOGPROB_TOL = 0.06  # bf16: two correct attention kernels differ by rounding only


def check_teacher_forced(base: list[dict], ours: list[dict], tol: float = LOGPROB_TOL,
                         min_agree: float = 0.99) -> None:
    """Teacher-forced logprobs of the same prompts (``prompt_logprobs=2``): every logprob within ``tol``; the
    top-1 token the same wherever the baseline's lead over the second exceeds ``2 * tol`` (closer calls may
    flip between two correct kernels) and at ``min_agree`` of all positions."""
    diffs, agree, total, decisive_wrong = [], 0, 0, []
    for a, b in zip(base, ours, strict=True):
        assert a["targets"] == b["targets"]
        diffs += [abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True)]
        for x, y, m in zip(a["top1"], b["top1"], a["margin"], strict=True):
            agree += x == y
            total += 1
            if x != y and (m is None or m > 2 * tol):
                decisive_wrong.append((x, y, m))
    assert total >= 50 and all(d == d for d in diffs), (total, diffs[:5])
    print(f"teacher-forced logprobs over {total} positions: max |diff| {max(diffs):.2e}, top-1 agreement "
          f"{agree}/{total}")
    assert max(diffs) <= tol
    assert not decisive_wrong, f"top-1 differs where the baseline led by > {2 * tol}: {decisive_wrong[:5]}"
    assert agree >= min_agree * total


def check_decode(base: list[list], ours: list[list], tol: float = LOGPROB_TOL, min_steps: int = 50) -> tuple[int, int]:
    """Greedy decoding with ``logprobs=2`` on two kernels: step by step, the same token with a logprob within
    ``tol`` until the two part; they may part only where the baseline's lead was within ``2 * tol`` (a near-tie
    two correct kernels can break either way). Returns (steps compared, requests that parted)."""
    compared = parted = 0
    for a, b in zip(base, ours, strict=True):
        for (ta, la, lead), (tb, lb, _) in zip(a, b, strict=False):
            if ta != tb:
                assert lead is not None and lead <= 2 * tol, f"parted at token {ta} vs {tb} with a lead of {lead}"
                parted += 1
                break
            assert abs(la - lb) <= tol, f"token {ta}: logprob {la} vs {lb}"
            compared += 1
    print(f"decode: {compared} greedy steps agree within {tol}; {parted} of {len(base)} requests parted at a near-tie")
    assert compared >= min_steps, f"only {compared} steps compared before the requests parted"
    return compared, parted


# What an engine on vLLM's CPU build gets (engine_env(cpu=True)): the kernels in Triton's interpreter, a small CPU KV
# space, one compute thread: the tiny models run as fast on one core, and two engines side by side (the test
# workers) otherwise each spin on both cores (2 cores: a burst of 0.8 s alone took 4.4 s beside another; with one
# thread each, 1.0 s).
CPU_ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "TRITON_INTERPRET": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                  "OMP_NUM_THREADS": "1"}


def engine_env(vllm: str | None = None, *, cpu: bool = True, **overrides: str | None) -> dict[str, str]:
    """A clean environment for one engine: no inherited KVCACHED_*/ENABLE_KVCACHED, then ``overrides``.

    ``vllm``: run that release from :data:`VLLM_OVERLAYS` instead of the installed one. ``cpu``: the engine runs
    vLLM's CPU build (:data:`CPU_ENGINE_ENV`); else a GPU engine, with the compiled kernels and inherited threads.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_") and k != "ENABLE_KVCACHED"}
    env.update({"HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"})
    if cpu:
        env.update(CPU_ENGINE_ENV)
    else:
        env.pop("TRITON_INTERPRET", None)
    overlay = str(VLLM_OVERLAYS[vllm]) if vllm else ""
    env["PYTHONPATH"] = os.pathsep.join(p for p in (overlay, str(REPO), env.get("PYTHONPATH", "")) if p)
    if overlay:
        # vLLM caches what it learns of a model class in one file a class, checked against the hash of that
        # release's model file: two releases sharing a cache root evict each other's entry, and every miss
        # inspects the class in a fresh interpreter that imports vLLM again (about 12 s here).
        env["VLLM_CACHE_ROOT"] = os.path.join(overlay, ".vllm-cache")
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def spec_arg(spec: dict) -> str:
    """The runner's argument: the JSON itself, or ``@file`` when it is too long for one argument (128 KiB)."""
    text = json.dumps(spec)
    if len(text) < 64_000:
        return text
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="kvcached_spec_", delete=False) as f:
        f.write(text)
    return "@" + f.name


class ForkedEngine:
    """An engine forked by a fork server (``engine_runner.fork_server``), with what the tests use of a Popen."""

    def __init__(self, pid: int, log: str) -> None:
        self.pid = pid
        self.log = log
        self.returncode: int | None = None

    def _exited(self) -> bool:
        try:
            with open(self.log + ".rc") as f:
                self.returncode = int(f.read())
            return True
        except FileNotFoundError:
            pass
        try:
            os.kill(self.pid, 0)  # an exited engine stays a zombie until its server has written .rc and reaped it
            return False
        except ProcessLookupError:  # its server is gone (the engine was reparented and reaped): status unknown
            return True

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._exited():
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked engine {self.pid}", timeout)
            time.sleep(0.05)
        with open(self.log, errors="replace") as f:
            out = f.read()
        for path in (self.log, self.log + ".rc"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        return out, None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


# vLLM settings that it reads only when an engine starts (vllm.envs reads the environment at each access until an
# engine core caches it; no module reads these at import): an engine forked with its own value is the same as one
# started fresh with it, so they need no server of their own (each had cost a vLLM import in every worker).
_READ_AT_ENGINE_START = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND")


def _engine_only(key: str) -> bool:
    """Variables that need no server of their own: kvcached's settings (the fork server never imports kvcached),
    pytest's name of the running test (which changes with every test; vLLM, torch and Triton never read it) and
    the vLLM settings read only when an engine starts."""
    return key.startswith("KVCACHED_") or key in ("ENABLE_KVCACHED", "PYTEST_CURRENT_TEST", *_READ_AT_ENGINE_START)


_SERVERS: dict[tuple, subprocess.Popen] = {}


def _fork_server(env: dict[str, str]) -> subprocess.Popen:
    """This process's fork server for ``env`` without kvcached's variables: one per such environment, so that
    everything vLLM reads while it is imported (the interpreter switch, the release on the path, its cache root,
    the thread settings) is what the engine would have read itself."""
    key = tuple(sorted((k, v) for k, v in env.items() if not _engine_only(k)))
    server = _SERVERS.get(key)
    if server is None or server.poll() is not None:
        server = subprocess.Popen([sys.executable, str(RUNNER), "--fork-server"], env=dict(key),
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = server.stdout.readline().strip()
        if line != "ready":
            server.kill()
            raise AssertionError(f"the engine fork server did not start (it said {line!r}; its error is above)")
        _SERVERS[key] = server
    return server


def start_engine(spec: dict, env: dict[str, str]) -> subprocess.Popen | ForkedEngine:
    """Start one engine: forked from a server that has imported vLLM where the engine runs vLLM's CPU build
    (``engine_env(cpu=True)``; ``KVCACHED_E2E_FORK=0`` in the tests' environment turns that off), else a fresh
    process (GPU engines: CUDA must not be set up before a fork, and their imports are a small share)."""
    cpu = all(env.get(k) == v for k, v in CPU_ENGINE_ENV.items() if k not in _READ_AT_ENGINE_START)
    if cpu and os.environ.get("KVCACHED_E2E_FORK", "1") != "0":
        server = _fork_server(env)
        fd, log = tempfile.mkstemp(prefix="kvcached_engine_", suffix=".log")
        os.close(fd)
        server.stdin.write(json.dumps({"spec": spec_arg(spec), "env": env, "log": log}) + "\n")
        server.stdin.flush()
        reply = server.stdout.readline().strip()
        if not reply.isdigit():
            raise AssertionError(f"the engine fork server did not fork (it said {reply!r}; its error is above)")
        return ForkedEngine(int(reply), log)
    return subprocess.Popen([sys.executable, str(RUNNER), spec_arg(spec)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish_engine(proc: subprocess.Popen | ForkedEngine, timeout: float = 400) -> dict:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"engine did not finish within {timeout} s; its output ends:\n{out[-4000:]}") from None
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise AssertionError(f"engine exited with {proc.returncode} and no result; its output ends:\n{out[-6000:]}")


def run_engine(spec: dict, env: dict[str, str], timeout: float = 400) -> dict:
    return finish_engine(start_engine(spec, env), timeout)


def once_per_session(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[], dict]) -> dict:
    """``make()`` once per test session, its result shared by pytest-xdist's workers (a session fixture is made
    in every worker that needs it: an engine baseline would run twice)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return make()
    path = tmp_path_factory.getbasetemp().parent / f"{name}.json"  # a worker's basetemp is in the session's
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other worker waits while this one runs it
        if path.is_file():
            return json.loads(path.read_text())
        result = make()
        path.write_text(json.dumps(result))
        return result


_PROBE_HOLD = """
import sys
from kvcached import _vmm
b = _vmm.Backend("host", 0, 8 << 20)
vt = _vmm.VirtualTensor(b, 2 << 20, 2 << 20)
pa = _vmm.PageAllocator(b, [vt], [(0, 0, 2 << 20)], 1, 0, 0, False)
pa.alloc_pages(1)
print("held", flush=True)
sys.stdin.read()
"""

_PROBE_LOOK = """
from kvcached import _vmm
print(_vmm.Backend("host", 0, 8 << 20).mem_info()[0])
"""


def host_budget_is_shared(env: dict[str, str]) -> bool:
    """Does a page mapped by one process count against another process's host budget?"""
    holder = subprocess.Popen([sys.executable, "-c", _PROBE_HOLD], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if holder.stdout.readline().strip() != "held":
            raise AssertionError(f"host backend probe failed: {holder.stderr.read()[-2000:]}")
        look = subprocess.run([sys.executable, "-c", _PROBE_LOOK], env=env, capture_output=True, text=True,
                              timeout=60, check=True)
        return int(look.stdout.strip()) < (8 << 20)
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)

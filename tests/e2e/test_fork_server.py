"""The engines' fork server (``engine_runner.fork_server``): a forked engine is a fresh process's equal, and its
failures and hangs reach the test as a fresh process's would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ForkedEngine, engine_env, finish_engine, start_engine  # noqa: E402
from tiny_model import LONG_PROMPTS  # noqa: E402

SHORT = {"prompts": LONG_PROMPTS[:2], "max_tokens": 8, "dtype": "bfloat16", "prompt_logprobs": 2}


def test_forked_engine_matches_a_fresh_process(tiny_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same tokens and the same teacher-forced logprobs, to the bit; and kvcached, off in the server, is on in
    the engine whose environment enables it (the plugin reads the engine's settings, not the server's)."""
    spec = {"model": tiny_model, **SHORT}
    name = "kvcached_e2e_fork"
    ours_env = engine_env(ENABLE_KVCACHED="true", KVCACHED_IPC_NAME=name, KVCACHED_MAX_CACHED_TOKENS="0")
    plain, ours = start_engine(spec, engine_env()), start_engine({**spec, "ipc_name": name}, ours_env)
    assert isinstance(plain, ForkedEngine) and isinstance(ours, ForkedEngine)
    monkeypatch.setenv("KVCACHED_E2E_FORK", "0")
    fresh = start_engine(spec, engine_env())
    assert isinstance(fresh, subprocess.Popen)
    fresh_r, plain_r, ours_r = finish_engine(fresh), finish_engine(plain), finish_engine(ours)
    assert plain.returncode == 0 and ours.returncode == 0
    assert plain_r["tokens"] == fresh_r["tokens"] == ours_r["tokens"]
    assert plain_r["teacher"] == fresh_r["teacher"]
    assert (plain_r["pool"], fresh_r["pool"], ours_r["pool"]) == ("BlockPool", "BlockPool", "KVCachedBlockPool")


def test_forked_engine_failure_is_reported(tmp_path: Path) -> None:
    proc = start_engine({"model": str(tmp_path / "no_such_model"), **SHORT}, engine_env())
    assert isinstance(proc, ForkedEngine)
    with pytest.raises(AssertionError, match="no_such_model") as err:
        finish_engine(proc)
    assert "engine exited with 1 and no result" in str(err.value)
    assert proc.returncode == 1


_REAP = r"""
import os, signal, sys, time
sys.path.insert(0, sys.argv[1])
from engine_runner import reap_engines
logs, seen = {}, {}
for name, how in (("exits", "exit"), ("killed", "kill")):
    pid = os.fork()
    if pid == 0:
        if how == "exit":
            os._exit(3)
        time.sleep(60)
    if how == "kill":
        os.kill(pid, signal.SIGKILL)
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # a zombie now
    logs[pid] = os.path.join(sys.argv[2], name)
    seen[pid] = name
reap = os.waitpid
def checked(pid, options):  # the status must be on disk before the pid is reaped
    print(seen[pid], "written before reaped:", os.path.exists(logs[pid] + ".rc"))
    return reap(pid, options)
os.waitpid = checked
reap_engines(dict(logs))  # it takes each pid out of the map it is given
for pid, name in seen.items():
    print(name, "status", open(logs[pid] + ".rc").read(), "pid gone:", not os.path.exists(f"/proc/{pid}"))
"""


def test_server_writes_the_status_before_it_reaps(tmp_path: Path) -> None:
    """The harness reads a gone pid without a status as a gone server: the server writes an engine's status before
    it reaps the engine (CI once read a status of None between the two)."""
    out = subprocess.run([sys.executable, "-c", _REAP, str(Path(__file__).resolve().parent), str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = sorted(out.stdout.splitlines())
    assert lines == sorted(["exits written before reaped: True", "killed written before reaped: True",
                            "exits status 3 pid gone: True", "killed status -9 pid gone: True"]), out.stdout


def test_forked_engine_past_its_timeout_is_killed(tmp_path: Path) -> None:
    proc = start_engine({"model": "unused", **SHORT, "start_after": str(tmp_path / "never")}, engine_env())
    assert isinstance(proc, ForkedEngine)
    with pytest.raises(AssertionError, match="did not finish within 2 s"):
        finish_engine(proc, timeout=2)
    assert proc.returncode == -9  # SIGKILL, as its server saw it
    with pytest.raises(ProcessLookupError):
        os.kill(proc.pid, 0)


def test_gpu_engines_are_fresh_processes() -> None:
    """CUDA must not be set up before a fork: an engine without the CPU build's settings is not forked."""
    proc = start_engine({"model": "unused"}, engine_env(cpu=False))
    assert isinstance(proc, subprocess.Popen)
    proc.kill()
    proc.communicate()

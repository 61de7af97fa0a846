"""Starting engines for the end-to-end tests: one subprocess per engine (``engine_runner.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNNER = HERE / "engine_runner.py"
REPO = HERE.parent.parent


def engine_env(**overrides: str | None) -> dict[str, str]:
    """A clean environment for one engine: no inherited KVCACHED_*/ENABLE_KVCACHED, then ``overrides``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_") and k != "ENABLE_KVCACHED"}
    env.update({"HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                "TOKENIZERS_PARALLELISM": "false", "TRITON_INTERPRET": "1"})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def start_engine(spec: dict, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(RUNNER), json.dumps(spec)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish_engine(proc: subprocess.Popen, timeout: float = 400) -> dict:
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

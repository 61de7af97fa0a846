"""``vllm serve`` force-kills its engine-core process at shutdown; the API server, which exits after it, removes
the /dev/shm segment the engine could not (``kvcached.integration.vllm.plugin.remove_dead_segments``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvcached import mem_info
from kvcached.integration.vllm import plugin

PUBLISH_AND_DIE = """
import os, sys, time
from kvcached import mem_info
mem_info.start_publisher()
print("ready", flush=True)
if sys.argv[1] == "die":
    os._exit(0)  # as SIGKILL would: no atexit, the segment stays
time.sleep(60)
"""


def _publisher(name: str, mode: str) -> subprocess.Popen:
    env = {**os.environ, "KVCACHED_IPC_NAME": name}
    proc = subprocess.Popen([sys.executable, "-c", PUBLISH_AND_DIE, mode], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_dead_engines_segment_is_removed_a_live_ones_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"kvcached_cleanup_{os.getpid()}"
    dead = _publisher(name, "die")
    dead.wait(10)
    assert Path("/dev/shm", name).exists()
    monkeypatch.setenv("KVCACHED_IPC_NAME", name)
    assert plugin.remove_dead_segments() == [name]
    assert not Path("/dev/shm", name).exists()

    live = _publisher(name, "live")
    try:
        assert plugin.remove_dead_segments() == []  # its engine still runs
        assert mem_info.read_segment(name).pid == live.pid
    finally:
        live.kill()
        live.wait(10)
    time.sleep(0.05)
    assert plugin.remove_dead_segments() == [name]


def test_default_names_of_this_process_group_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVCACHED_IPC_NAME", raising=False)
    ours = f"kvcached_vLLM_{os.getpgid(0)}_7"
    other = f"kvcached_vLLM_{os.getpgid(0) + 100000}"  # another server's group
    for name in (ours, other):
        proc = _publisher(name, "die")
        proc.wait(10)
    try:
        assert plugin.remove_dead_segments() == [ours]
        assert Path("/dev/shm", other).exists()
    finally:
        mem_info.delete_segment(other)

"""The demo (`python -m kvcached.demo`, `kvcached demo`) runs and passes on the default device."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid


def test_demo_passes() -> None:
    env = dict(os.environ, KVCACHED_IPC_NAME=f"kvcached_test_demo_{uuid.uuid4().hex[:8]}")
    out = subprocess.run([sys.executable, "-m", "kvcached", "demo"], capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("PASS: contiguous:") and "per_layer:" in last
    assert "layout contiguous" in out.stdout and "layout per_layer" in out.stdout
    assert "after trim: mapped 0 MiB" in out.stdout

"""The ``vllm.general_plugins`` entry point: ``ENABLE_KVCACHED=true`` is all a user sets.

vLLM calls :func:`register` in every one of its processes (API server, engine
core, workers). With kvcached enabled it checks the vLLM version (an unsupported
one is an error, never a silent run without kvcached) and installs the hooks.
"""

from __future__ import annotations

import atexit
import os

from kvcached import config

_cleanup_registered = False


def register() -> None:
    global _cleanup_registered
    if not config.kvcached_enabled():
        return
    from kvcached.integration.vllm import patches

    patches.apply()  # checks the vLLM version first
    from kvcached import metrics

    metrics.register_engine_collector()  # this engine's KV memory on vLLM's /metrics (with prometheus_client)
    if not _cleanup_registered:
        _cleanup_registered = True
        atexit.register(remove_dead_segments)


def _gone(pid: int) -> bool:
    """The process has exited: no such pid, or a zombie waiting to be reaped."""
    from kvcached import mem_info

    try:
        if not mem_info.pid_alive(pid):
            return True
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, OverflowError, ValueError, IndexError):
        return False


def remove_dead_segments() -> list[str]:
    """At a vLLM process's exit: remove the /dev/shm segments of this server's engines that have exited.

    ``vllm serve`` stops its engine-core process with SIGKILL once its shutdown timeout (0 s by
    default) has passed, so that process cannot remove its own segment; the API server, whose
    exit comes after, removes it here. The driver has already released the engine's memory; this
    keeps kvctl and kvtop from listing a dead engine. Only segments of this server are touched:
    ``KVCACHED_IPC_NAME`` when set, else the default names of this process group.
    """
    from kvcached import mem_info

    explicit = config.ipc_name_override()
    try:
        if explicit:
            names = [mem_info.sanitize_ipc_name(explicit)]
        else:
            base = mem_info.default_ipc_base("vLLM")
            names = [n for n in mem_info.list_segments() if n == base or n.startswith(base + "_")]
    except OSError:
        return []
    removed = []
    for name in names:
        try:
            info = mem_info.read_segment(name)
            if info.pid != os.getpid() and _gone(info.pid) and mem_info.delete_segment(name):
                removed.append(name)
        except (OSError, ValueError, TimeoutError, OverflowError):
            continue
    return removed

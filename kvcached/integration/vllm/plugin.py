"""The ``vllm.general_plugins`` entry point: ``ENABLE_KVCACHED=true`` is all a user sets.

vLLM calls :func:`register` in every one of its processes (API server, engine
core, workers). With kvcached enabled it checks the vLLM version (an unsupported
one is an error, never a silent run without kvcached) and installs the hooks.
"""

from __future__ import annotations

from kvcached import config


def enabled() -> bool:
    return bool(config.env_bool("ENABLE_KVCACHED", False))


def register() -> None:
    if not enabled():
        return
    from kvcached.integration.vllm import patches

    patches.apply()  # checks the vLLM version first
    from kvcached import metrics

    metrics.register_engine_collector()  # this engine's KV memory on vLLM's /metrics (with prometheus_client)

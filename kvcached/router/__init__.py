"""An OpenAI-compatible router over several engines, launched from one config file.

    python -m kvcached.router models.toml

See :mod:`kvcached.router.config` for the file and :mod:`kvcached.router.app` for
what the router does (per-model routing, traffic counts, idle sleep and wake).
Needs aiohttp (vLLM depends on it).
"""

from kvcached.router.config import ModelRoute, RouterConfig, load_config, parse_config

__all__ = ["ModelRoute", "RouterConfig", "load_config", "parse_config"]

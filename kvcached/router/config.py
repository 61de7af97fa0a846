"""The router's configuration: one TOML (or YAML / JSON) file naming the models.

    [router]
    port = 8000              # where clients send OpenAI requests
    idle_sleep_s = 300       # put an engine that had no request for this long to sleep (0: never)

    [[models]]
    name = "llama-3-8b"      # the ``model`` field of a request
    path = "/models/llama-3-8b"   # launch ``vllm serve path`` on ``port`` ...
    port = 8101
    args = ["--max-model-len", "8192"]
    env = { ENABLE_KVCACHED = "true" }

    [[models]]
    name = "qwen-7b"
    url = "http://127.0.0.1:8102"   # ... or route to an engine that is already running

Every model is either launched (``path`` or ``command``) or reached (``url``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcached.errors import KVCachedConfigError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


@dataclass(frozen=True)
class ModelRoute:
    name: str
    url: str  # base URL of the engine's OpenAI server, no trailing slash
    path: str | None = None  # model to launch with ``vllm serve``
    port: int | None = None
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    command: tuple[str, ...] | None = None  # launch this instead of ``vllm serve`` (tests, wrappers)
    sleep: bool = True  # may be put to sleep when idle

    @property
    def launched(self) -> bool:
        return self.path is not None or self.command is not None


@dataclass(frozen=True)
class RouterConfig:
    models: tuple[ModelRoute, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    idle_sleep_s: float = 0.0
    start_timeout_s: float = 900.0
    log_dir: str | None = None

    def route(self, name: str) -> ModelRoute | None:
        return next((m for m in self.models if m.name == name), None)


def _read(path: Path) -> dict[str, Any]:
    text = path.read_text()
    suffix = path.suffix.lower()
    if suffix == ".toml":
        try:
            import tomllib
        except ImportError:  # Python 3.10
            try:
                import tomli as tomllib
            except ImportError:
                raise KVCachedConfigError(f"{path}: reading TOML on Python 3.10 needs tomli (pip install tomli), "
                                          "or use YAML / JSON.") from None
        return tomllib.loads(text)
    if suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise KVCachedConfigError(f"{path}: reading YAML needs PyYAML (pip install pyyaml), or use TOML.") from None
        return yaml.safe_load(text) or {}
    if suffix == ".json":
        return json.loads(text)
    raise KVCachedConfigError(f"{path}: unknown config format {suffix!r}; use .toml, .yaml or .json.")


def _port(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise KVCachedConfigError(f"{where}: port must be an int in 1..65535, got {value!r}.")
    return value


def _strings(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise KVCachedConfigError(f"{where} must be a list of strings, got {value!r}.")
    return tuple(value)


def _model(raw: Any, i: int) -> ModelRoute:
    where = f"models[{i}]"
    if not isinstance(raw, dict):
        raise KVCachedConfigError(f"{where} must be a table, got {raw!r}.")
    known = {"name", "url", "path", "port", "args", "env", "command", "sleep"}
    unknown = set(raw) - known
    if unknown:
        raise KVCachedConfigError(f"{where}: unknown keys {sorted(unknown)}; known: {sorted(known)}.")
    name = raw.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise KVCachedConfigError(f"{where}: name must be 1-128 characters of letters, digits, '._:/-', got {name!r}.")
    port = _port(raw["port"], where) if "port" in raw else None
    path, command = raw.get("path"), raw.get("command")
    if path is not None and not isinstance(path, str):
        raise KVCachedConfigError(f"{where}: path must be a string, got {path!r}.")
    cmd = _strings(command, f"{where}.command") if command is not None else None
    url = raw.get("url")
    if path is not None or cmd is not None:
        if url is not None:
            raise KVCachedConfigError(f"{where}: give either url (a running engine) or path/command (launch one).")
        if port is None:
            raise KVCachedConfigError(f"{where}: a launched engine needs a port.")
        url = f"http://127.0.0.1:{port}"
    elif not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise KVCachedConfigError(f"{where}: needs url = 'http://host:port' or path (and port) to launch.")
    env = raw.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, (str, int, float, bool))
                                            for k, v in env.items()):
        raise KVCachedConfigError(f"{where}.env must be a table of strings, got {env!r}.")
    sleep = raw.get("sleep", True)
    if not isinstance(sleep, bool):
        raise KVCachedConfigError(f"{where}.sleep must be true or false, got {sleep!r}.")
    return ModelRoute(name, url.rstrip("/"), path, port, _strings(raw.get("args", []), f"{where}.args"),
                      {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in env.items()}, cmd, sleep)


def parse_config(raw: dict[str, Any]) -> RouterConfig:
    if not isinstance(raw, dict):
        raise KVCachedConfigError(f"router config must be a table, got {type(raw).__name__}.")
    router = raw.get("router", {})
    if not isinstance(router, dict):
        raise KVCachedConfigError(f"[router] must be a table, got {router!r}.")
    models = raw.get("models")
    if not isinstance(models, list) or not models:
        raise KVCachedConfigError("router config: needs at least one [[models]] entry.")
    routes = tuple(_model(m, i) for i, m in enumerate(models))
    names = [m.name for m in routes]
    if len(set(names)) != len(names):
        raise KVCachedConfigError(f"router config: model names must be unique, got {names}.")
    ports = [m.port for m in routes if m.port is not None]
    port = _port(router.get("port", 8000), "[router]")
    if len(set(ports)) != len(ports) or port in ports:
        raise KVCachedConfigError(f"router config: every engine and the router need their own port, got {ports} "
                                  f"and router {port}.")
    idle = router.get("idle_sleep_s", 0)
    timeout = router.get("start_timeout_s", 900)
    for key, value in (("idle_sleep_s", idle), ("start_timeout_s", timeout)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or value == float("inf"):
            raise KVCachedConfigError(f"[router] {key} must be a finite number of seconds >= 0, got {value!r}.")
    host = router.get("host", "127.0.0.1")
    log_dir = router.get("log_dir")
    if not isinstance(host, str) or (log_dir is not None and not isinstance(log_dir, str)):
        raise KVCachedConfigError("[router] host and log_dir must be strings.")
    return RouterConfig(routes, host, port, float(idle), float(timeout), log_dir)


def load_config(path: str | Path) -> RouterConfig:
    path = Path(path)
    if not path.is_file():
        raise KVCachedConfigError(f"router config {path} does not exist.")
    return parse_config(_read(path))

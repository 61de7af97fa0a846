"""One OpenAI-compatible front end for several engines: each request goes to the engine serving its ``model``.

Built on aiohttp (server and client). Streams are passed through chunk by chunk, so
time to first token is the engine's plus one hop. Per model it counts requests,
requests in flight and errors; with ``idle_sleep_s`` it puts an engine that has had
no request for that long to sleep through vLLM's own sleep mode (the engine must run
with ``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1``; the launcher adds both)
and wakes it before the next request for it is forwarded. Before sleeping it drops
the engine's prefix cache, which with kvcached gives those KV pages back to the device.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector, web

from kvcached.router.config import ModelRoute, RouterConfig
from kvcached.utils import get_kvcached_logger

logger = get_kvcached_logger()

FORWARDED = ("/v1/completions", "/v1/chat/completions")
PASS_HEADERS = ("authorization",)


@dataclass
class Traffic:
    """What the router saw of one model (``GET /router/stats``)."""

    requests: int = 0
    in_flight: int = 0
    errors: int = 0
    last_request: float = field(default_factory=time.monotonic)
    sleeping: bool = False
    sleeps: int = 0
    wakes: int = 0
    last_wake_s: float | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def as_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "in_flight": self.in_flight, "errors": self.errors,
                "idle_s": round(time.monotonic() - self.last_request, 3), "sleeping": self.sleeping,
                "sleeps": self.sleeps, "wakes": self.wakes, "last_wake_s": self.last_wake_s}


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.traffic = {m.name: Traffic() for m in config.models}
        self._session: ClientSession | None = None
        self._idle_task: asyncio.Task | None = None

    # -- life cycle (aiohttp on_startup / on_cleanup) ----------------------
    async def start(self, _app: web.Application | None = None) -> None:
        # no total timeout: a stream lasts as long as its generation; a dead engine fails the connect
        self._session = ClientSession(timeout=ClientTimeout(total=None, sock_connect=10),
                                      connector=TCPConnector(limit=0))
        if self.config.idle_sleep_s > 0:
            self._idle_task = asyncio.create_task(self._idle_loop())

    async def close(self, _app: web.Application | None = None) -> None:
        if self._idle_task is not None:
            self._idle_task.cancel()
        if self._session is not None:
            await self._session.close()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)
        for path in FORWARDED:
            app.router.add_post(path, self.forward)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/router/stats", self.stats)
        app.router.add_get("/health", self.health)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.close)
        return app

    # -- handlers -----------------------------------------------------------
    async def forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        try:
            payload = json.loads(body)
        except ValueError:
            return _error(400, "the request body is not JSON", "BadRequestError")
        name = payload.get("model") if isinstance(payload, dict) else None
        route = self.config.route(name) if isinstance(name, str) else None
        if route is None:
            served = [m.name for m in self.config.models]
            return _error(404, f"model {name!r} is not served here; served models: {served}", "NotFoundError")
        t = self.traffic[route.name]
        t.requests += 1
        t.in_flight += 1  # before any await: the idle loop never sleeps an engine with a request on its way
        t.last_request = time.monotonic()
        assert self._session is not None
        headers = {"Content-Type": "application/json"}
        headers.update({k: v for k, v in request.headers.items() if k.lower() in PASS_HEADERS})
        try:
            await self._ensure_awake(route, t)
            async with self._session.post(route.url + request.path, data=body, headers=headers) as up:
                resp = web.StreamResponse(status=up.status)
                resp.content_type = up.content_type
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                if up.status >= 400:
                    t.errors += 1
                return resp
        except (ClientError, OSError, asyncio.TimeoutError) as exc:
            t.errors += 1
            return _error(502, f"the engine of model {route.name!r} at {route.url} did not answer: {exc!r}",
                          "BadGatewayError")
        finally:
            t.in_flight -= 1
            t.last_request = time.monotonic()

    async def models(self, _request: web.Request) -> web.Response:
        now = int(time.time())
        data = [{"id": m.name, "object": "model", "created": now, "owned_by": "kvcached-router"}
                for m in self.config.models]
        return web.json_response({"object": "list", "data": data})

    async def stats(self, _request: web.Request) -> web.Response:
        return web.json_response({"models": {n: t.as_dict() for n, t in self.traffic.items()}})

    async def health(self, _request: web.Request) -> web.Response:
        assert self._session is not None
        out = {}
        for m in self.config.models:
            try:
                async with self._session.get(m.url + "/health", timeout=ClientTimeout(total=5)) as r:
                    out[m.name] = r.status == 200
            except (ClientError, OSError, asyncio.TimeoutError):
                out[m.name] = False
        return web.json_response(out, status=200 if all(out.values()) else 503)

    # -- sleep and wake -----------------------------------------------------
    async def _post(self, route: ModelRoute, path: str) -> None:
        assert self._session is not None
        async with self._session.post(route.url + path) as r:
            if r.status >= 400:
                text = (await r.text())[:300]
                raise ClientError(f"{path} answered {r.status}: {text} (is the engine started with "
                                  "--enable-sleep-mode and VLLM_SERVER_DEV_MODE=1?)")

    async def _ensure_awake(self, route: ModelRoute, t: Traffic) -> None:
        if not t.sleeping:
            return
        async with t.lock:
            if t.sleeping:
                t0 = time.monotonic()
                await self._post(route, "/wake_up")
                t.sleeping = False
                t.wakes += 1
                t.last_wake_s = round(time.monotonic() - t0, 4)
                logger.info("router: woke %s in %.3f s", route.name, t.last_wake_s)

    async def sleep_idle(self) -> list[str]:
        """Put to sleep every engine idle for at least ``idle_sleep_s``; the names put to sleep."""
        slept = []
        now = time.monotonic()
        for m in self.config.models:
            t = self.traffic[m.name]
            if not m.sleep or t.sleeping or t.in_flight or now - t.last_request < self.config.idle_sleep_s:
                continue
            async with t.lock:
                if t.in_flight or t.sleeping:
                    continue
                try:
                    await self._post(m, "/reset_prefix_cache")
                    await self._post(m, "/sleep?level=1")
                except (ClientError, OSError, asyncio.TimeoutError) as exc:
                    logger.warning("router: could not put %s to sleep: %s", m.name, exc)
                    t.last_request = time.monotonic()  # try again after another idle period, not every second
                    continue
                t.sleeping = True
                t.sleeps += 1
                slept.append(m.name)
                logger.info("router: %s idle for %.0f s, put to sleep", m.name, now - t.last_request)
        return slept

    async def _idle_loop(self) -> None:
        period = min(1.0, self.config.idle_sleep_s / 4)
        while True:
            await asyncio.sleep(period)
            await self.sleep_idle()

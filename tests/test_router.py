"""kvcached's router (``python -m kvcached.router``): config checks, routing by model, streams passed through,
errors, traffic counts, idle sleep and wake, and launching engines. Fake OpenAI engines (aiohttp) stand in
for vLLM: the GPU test ``tests/gpu/test_vllm_serve_gpu.py`` runs it in front of real ``vllm serve``."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import textwrap
from pathlib import Path

import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from kvcached.errors import KVCachedConfigError  # noqa: E402
from kvcached.router import load_config, parse_config  # noqa: E402
from kvcached.router.app import Router  # noqa: E402
from kvcached.router.engines import Engines, serve_command  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeEngine:
    """An OpenAI-ish engine: answers with its name, streams three chunks, records sleep/wake calls."""

    def __init__(self, name: str) -> None:
        self.name, self.calls, self.sleeping = name, [], False
        self.app = web.Application()
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_post("/v1/chat/completions", self.completions)
        for path in ("/sleep", "/wake_up", "/reset_prefix_cache"):
            self.app.router.add_post(path, self.control)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/v1/models", self.models)

    async def health(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": self.name}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.calls.append(("generate", body.get("prompt"), request.headers.get("Authorization")))
        if self.sleeping:
            return web.json_response({"error": "asleep"}, status=500)
        if body.get("prompt") == "fail":
            return web.json_response({"error": {"message": "bad prompt"}}, status=400)
        if not body.get("stream"):
            return web.json_response({"model": self.name, "choices": [{"text": f"{self.name}:{body['prompt']}"}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(3):
            await resp.write(f"data: {json.dumps({'choices': [{'text': f'{self.name}{i}'}]})}\n\n".encode())
            await asyncio.sleep(0.05)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def control(self, request: web.Request) -> web.Response:
        self.calls.append((request.path, dict(request.query)))
        if request.path == "/sleep":
            self.sleeping = True
        elif request.path == "/wake_up":
            self.sleeping = False
        return web.Response()


async def _serve(app: web.Application, port: int) -> web.AppRunner:
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


def _config(ports: dict[str, int], router_port: int, **router: object) -> dict:
    return {"router": {"port": router_port, **router},
            "models": [{"name": n, "url": f"http://127.0.0.1:{p}"} for n, p in ports.items()]}


def _run(coro):
    return asyncio.run(coro)


async def _with_router(test, idle_sleep_s: float = 0.0, dead: bool = False):
    engines = {"a": FakeEngine("a"), "b": FakeEngine("b")}
    ports = {n: _free_port() for n in engines}
    rport = _free_port()
    runners = [] if dead else [await _serve(e.app, ports[n]) for n, e in engines.items()]
    router = Router(parse_config(_config(ports, rport, idle_sleep_s=idle_sleep_s)))
    rrun = await _serve(router.app(), rport)
    try:
        async with aiohttp.ClientSession() as s:
            await test(s, f"http://127.0.0.1:{rport}", engines, router)
    finally:
        await rrun.cleanup()
        for r in runners:
            await r.cleanup()


def test_routes_by_model_and_counts_traffic() -> None:
    async def test(s, url, engines, router):
        for name in ("a", "b", "a"):
            async with s.post(url + "/v1/completions", json={"model": name, "prompt": "hi"},
                              headers={"Authorization": "Bearer k"}) as r:
                assert r.status == 200
                assert (await r.json())["choices"][0]["text"] == f"{name}:hi"
        assert [c[0] for c in engines["a"].calls] == ["generate", "generate"]
        assert engines["a"].calls[0][2] == "Bearer k"  # the client's key reaches the engine
        async with s.get(url + "/router/stats") as r:
            stats = (await r.json())["models"]
        assert stats["a"]["requests"] == 2 and stats["b"]["requests"] == 1 and stats["a"]["in_flight"] == 0
        async with s.get(url + "/v1/models") as r:
            assert [m["id"] for m in (await r.json())["data"]] == ["a", "b"]
        async with s.get(url + "/health") as r:
            assert r.status == 200 and await r.json() == {"a": True, "b": True}

    _run(_with_router(test))


def test_stream_is_passed_through_chunk_by_chunk() -> None:
    async def test(s, url, engines, router):
        times = []
        async with s.post(url + "/v1/chat/completions", json={"model": "b", "prompt": "x", "stream": True}) as r:
            assert r.status == 200 and r.content_type == "text/event-stream"
            body = b""
            async for chunk in r.content.iter_any():
                times.append(asyncio.get_running_loop().time())
                body += chunk
        texts = [json.loads(line[6:])["choices"][0]["text"] for line in body.decode().split("\n\n")
                 if line.startswith("data: {")]
        assert texts == ["b0", "b1", "b2"] and body.endswith(b"data: [DONE]\n\n")
        assert len(times) >= 3 and times[-1] - times[0] >= 0.08  # not buffered into one piece

    _run(_with_router(test))


def test_errors_are_openai_shaped() -> None:
    async def test(s, url, engines, router):
        async with s.post(url + "/v1/completions", json={"model": "zzz", "prompt": "hi"}) as r:
            assert r.status == 404
            err = (await r.json())["error"]
            assert "zzz" in err["message"] and "'a'" in err["message"]
        async with s.post(url + "/v1/completions", data=b"{not json") as r:
            assert r.status == 400
        async with s.post(url + "/v1/completions", json=["model", "a"]) as r:
            assert r.status == 404
        async with s.post(url + "/v1/completions", json={"model": "a", "prompt": "fail"}) as r:
            assert r.status == 400  # the engine's own error, passed on
        assert router.traffic["a"].errors == 1

    _run(_with_router(test))


def test_unreachable_engine_is_a_502() -> None:
    async def test(s, url, engines, router):
        async with s.post(url + "/v1/completions", json={"model": "a", "prompt": "hi"}) as r:
            assert r.status == 502
            assert "did not answer" in (await r.json())["error"]["message"]
        async with s.get(url + "/health") as r:
            assert r.status == 503
        assert router.traffic["a"].errors == 1 and router.traffic["a"].in_flight == 0

    _run(_with_router(test, dead=True))


def test_idle_engine_sleeps_and_wakes_on_demand() -> None:
    async def test(s, url, engines, router):
        async with s.post(url + "/v1/completions", json={"model": "a", "prompt": "hi"}) as r:
            assert r.status == 200
        await asyncio.sleep(0.6)  # past idle_sleep_s: the loop puts both engines to sleep
        assert engines["a"].sleeping and engines["b"].sleeping
        assert [c[0] for c in engines["a"].calls[1:]] == ["/reset_prefix_cache", "/sleep"]
        async with s.post(url + "/v1/completions", json={"model": "a", "prompt": "again"}) as r:
            assert r.status == 200 and (await r.json())["choices"][0]["text"] == "a:again"
        assert not engines["a"].sleeping and engines["b"].sleeping
        t = router.traffic["a"]
        assert t.sleeps == 1 and t.wakes == 1 and t.last_wake_s is not None

    _run(_with_router(test, idle_sleep_s=0.3))


def test_busy_engine_is_not_put_to_sleep() -> None:
    async def test(s, url, engines, router):
        router.traffic["a"].in_flight = 1  # a request on its way
        router.traffic["a"].last_request -= 10
        assert await router.sleep_idle() == ["b"] or not router.traffic["b"].sleeping
        assert not engines["a"].sleeping
        router.traffic["a"].in_flight = 0

    _run(_with_router(test, idle_sleep_s=5))


@pytest.mark.parametrize("raw, words", [
    ({"models": []}, "at least one"),
    ({"models": [{"name": "a"}]}, "url"),
    ({"models": [{"name": "a", "url": "ftp://x"}]}, "url"),
    ({"models": [{"name": "a", "path": "/m"}]}, "port"),
    ({"models": [{"name": "a", "path": "/m", "port": 99999}]}, "port"),
    ({"models": [{"name": "a", "path": "/m", "port": 9, "url": "http://x"}]}, "either"),
    ({"models": [{"name": "a", "url": "http://x"}, {"name": "a", "url": "http://y"}]}, "unique"),
    ({"models": [{"name": "a", "path": "/m", "port": 9}, {"name": "b", "path": "/m", "port": 9}]}, "own port"),
    ({"models": [{"name": "a b", "url": "http://x"}]}, "name"),
    ({"models": [{"name": "a", "url": "http://x", "colour": 1}]}, "unknown keys"),
    ({"models": [{"name": "a", "url": "http://x", "args": "--x"}]}, "list of strings"),
    ({"models": [{"name": "a", "url": "http://x", "env": {"A": [1]}}]}, "env"),
    ({"router": {"idle_sleep_s": -1}, "models": [{"name": "a", "url": "http://x"}]}, "idle_sleep_s"),
    ({"router": {"idle_sleep_s": float("nan")}, "models": [{"name": "a", "url": "http://x"}]}, "idle_sleep_s"),
    ({"router": {"port": True}, "models": [{"name": "a", "url": "http://x"}]}, "port"),
])
def test_bad_configs_are_refused_with_a_reason(raw: dict, words: str) -> None:
    with pytest.raises(KVCachedConfigError, match=words):
        parse_config(raw)


def test_config_files(tmp_path: Path) -> None:
    toml = tmp_path / "models.toml"
    toml.write_text(textwrap.dedent("""
        [router]
        port = 9000
        idle_sleep_s = 60

        [[models]]
        name = "llama"
        path = "/models/llama"
        port = 9001
        args = ["--max-model-len", "4096"]
        env = { ENABLE_KVCACHED = true, KVCACHED_IPC_NAME = "kvcached_llama" }

        [[models]]
        name = "qwen"
        url = "http://10.0.0.2:8000/"
    """))
    cfg = load_config(toml)
    llama, qwen = cfg.models
    assert cfg.port == 9000 and cfg.idle_sleep_s == 60
    assert llama.url == "http://127.0.0.1:9001" and llama.env["ENABLE_KVCACHED"] == "true" and llama.launched
    assert qwen.url == "http://10.0.0.2:8000" and not qwen.launched
    cmd = serve_command(llama, sleep_mode=True)
    assert cmd[-3:] == ["--max-model-len", "4096", "--enable-sleep-mode"] and "llama" in cmd
    assert "--enable-sleep-mode" not in serve_command(llama, sleep_mode=False)
    as_json = tmp_path / "m.json"
    as_json.write_text(json.dumps({"models": [{"name": "q", "url": "http://h:1"}]}))
    assert load_config(as_json).models[0].name == "q"
    for bad, words in ((tmp_path / "m.ini", "unknown config format"), (tmp_path / "none.toml", "does not exist")):
        if "format" in words:
            bad.write_text("x")
        with pytest.raises(KVCachedConfigError, match=words):
            load_config(bad)


FAKE_SERVER = """
import sys
from aiohttp import web
async def models(request):
    return web.json_response({"data": []})
app = web.Application()
app.router.add_get("/v1/models", models)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
"""


def test_engines_start_wait_and_stop(tmp_path: Path) -> None:
    port = _free_port()
    raw = {"router": {"port": _free_port(), "log_dir": str(tmp_path)}, "models": [
        {"name": "fake", "command": [sys.executable, "-c", FAKE_SERVER, str(port)], "port": port},
        {"name": "dies", "command": [sys.executable, "-c", "print('bad model path'); raise SystemExit(3)"],
         "port": _free_port()}]}
    engines = Engines(parse_config(raw))
    engines.start(["fake"])
    try:
        took = engines.wait_ready(30)
        assert set(took) == {"fake"}
    finally:
        codes = engines.stop(10)
    assert set(codes) == {"fake"} and codes["fake"] is not None
    engines.start(["dies"])
    with pytest.raises(Exception, match="(?s)exited with 3.*bad model path"):
        engines.wait_ready(30)
    engines.stop(5)


def test_main_refuses_a_bad_config(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from kvcached.router.__main__ import main

    bad = tmp_path / "r.toml"
    bad.write_text("[router]\nport = 1\n")
    assert main([str(bad), "--no-launch"]) == 1
    assert "at least one" in capsys.readouterr().err

"""kvcached under ``vllm serve`` on a real GPU: the OpenAI API over HTTP, tokens equal to plain vLLM's.

Two servers of one small Llama (random weights scaled for peaked logits, a trained tokenizer) start
together: plain vLLM and ``ENABLE_KVCACHED=true``; then kvcached's router in front of both. Every
answer is greedy, so the two servers must agree token for token: ``/v1/completions`` (streamed and
not), ``/v1/chat/completions`` (streamed and not), the same through the router, and ``/metrics``.
The kvcached server runs with vLLM's sleep mode: the router puts it to sleep when idle and wakes it
on the next request, which must again give the same tokens. After the servers exit no kvcached
segment is left. Needs vLLM with its HTTP extras (on our H200: ``benchmarks/gpu_session.sh serve``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

E2E = Path(__file__).resolve().parent.parent / "e2e"
sys.path.insert(0, str(E2E))
from harness import engine_env  # noqa: E402
from tiny_model import PROMPTS, make_tiny_model  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
    pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("vllm", "uvicorn", "aiohttp")),
                       reason="needs vLLM with its HTTP server (uvicorn) and aiohttp"),
]

GiB = 1 << 30
PLAIN_PORT, KV_PORT, ROUTER_PORT = 8411, 8412, 8410
SEGMENT = "kvcached_gpu_serve"
# eager: this test is about the HTTP path (CUDA graphs under kvcached: tests/gpu/test_vllm_gpu.py, and every
# engine of benchmarks/bench_coserving.py serves through `vllm serve` with them)
ARGS = ["--max-model-len", "512", "--max-num-seqs", "64", "--dtype", "bfloat16", "--async-scheduling",
        "--disable-uvicorn-access-log", "--enforce-eager"]


def _post(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _stream(url: str, body: dict, timeout: float = 120) -> tuple[str, int]:
    """Concatenated text of an SSE stream, and its number of data events."""
    req = urllib.request.Request(url, json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    text, events = [], 0
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events += 1
            for choice in json.loads(line[6:]).get("choices", []):
                text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(text), events


def _get(url: str, timeout: float = 10) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read().decode()


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    from kvcached.router.config import parse_config
    from kvcached.router.engines import Engines
    from tools.tiny_model import CHAT_TEMPLATE

    model = make_tiny_model(tmp_path_factory.mktemp("serve_llama"), hidden_size=512, num_heads=8, num_kv_heads=2,
                            num_layers=4)
    template = model / "chat_template.jinja"
    template.write_text(CHAT_TEMPLATE)  # the tiny tokenizer has none; vLLM refuses chat requests without one
    # KVCACHED_SERVE_LOG_DIR: keep the servers' logs (benchmarks/gpu_session.sh collects them)
    logs = Path(os.environ.get("KVCACHED_SERVE_LOG_DIR") or tmp_path_factory.mktemp("serve_logs"))
    logs.mkdir(parents=True, exist_ok=True)
    base = engine_env(cpu=False)
    base.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # `vllm serve` runs its engine core as a process
    plain_env = {k: v for k, v in base.items() if k.startswith(("PYTHON", "HF_", "TOKENIZERS"))}
    # sleep mode on (the router's idle period here is an hour: nothing sleeps until the `router` fixture's own)
    raw = {"router": {"port": ROUTER_PORT, "idle_sleep_s": 3600, "log_dir": str(logs)}, "models": [
        {"name": "plain", "path": str(model), "port": PLAIN_PORT, "sleep": False,
         "args": [*ARGS, "--chat-template", str(template), "--gpu-memory-utilization", "0.1",
                  "--kv-cache-memory-bytes", str(2 * GiB)], "env": plain_env},
        {"name": "kvcached", "path": str(model), "port": KV_PORT, "args": [*ARGS, "--chat-template", str(template)],
         "env": {**plain_env, "ENABLE_KVCACHED": "true", "KVCACHED_IPC_NAME": SEGMENT}},
    ]}
    config = parse_config(raw)
    engines = Engines(config)
    engines.start()
    try:
        ready = engines.wait_ready(600)
        print(f"servers ready: {ready}")
        yield engines, raw, logs
    finally:
        codes = engines.stop()
        print(f"servers stopped: {codes}")
        for name in ("plain", "kvcached"):
            print(f"--- {name} log tail ---\n{engines.tail(name, 2000)}")


@pytest.fixture(scope="module")
def router(servers):
    """The router in its own process, putting an engine to sleep after 4 s without a request."""
    _, raw, logs = servers
    cfg = logs / "router.json"
    cfg.write_text(json.dumps({**raw, "router": {**raw["router"], "idle_sleep_s": 4}}))
    proc = subprocess.Popen([sys.executable, "-m", "kvcached.router", str(cfg), "--no-launch"],
                            stdout=open(logs / "router.log", "wb"), stderr=subprocess.STDOUT)
    try:
        for _ in range(100):
            try:
                _get(f"http://127.0.0.1:{ROUTER_PORT}/v1/models")
                break
            except OSError:
                time.sleep(0.2)
        yield proc
    finally:
        proc.terminate()
        proc.wait(30)
        print(f"--- router log ---\n{(logs / 'router.log').read_text()[-2000:]}")


def _both(path: str, body: dict) -> tuple[dict, dict]:
    plain = _post(f"http://127.0.0.1:{PLAIN_PORT}{path}", {**body, "model": "plain"})
    kv = _post(f"http://127.0.0.1:{KV_PORT}{path}", {**body, "model": "kvcached"})
    return plain, kv


def test_completions_match_plain_vllm(servers) -> None:
    body = {"prompt": PROMPTS, "max_tokens": 24, "temperature": 0.0, "return_token_ids": True}
    plain, kv = _both("/v1/completions", body)
    assert [c["text"] for c in kv["choices"]] == [c["text"] for c in plain["choices"]]
    assert all(c["text"] for c in plain["choices"])
    ids = [c.get("token_ids") for c in plain["choices"]]
    if all(ids):
        assert [c.get("token_ids") for c in kv["choices"]] == ids
    # streamed: the same text, one event per step or so
    for i, prompt in enumerate(PROMPTS):
        for port, name in ((PLAIN_PORT, "plain"), (KV_PORT, "kvcached")):
            text, events = _stream(f"http://127.0.0.1:{port}/v1/completions",
                                   {"prompt": prompt, "max_tokens": 24, "temperature": 0.0, "model": name})
            assert text == plain["choices"][i]["text"], (name, prompt)
            assert events >= 2


def test_chat_completions_match_plain_vllm(servers) -> None:
    msgs = [{"role": "user", "content": "Elastic KV caches map memory only for blocks that hold tokens."}]
    body = {"messages": msgs, "max_tokens": 20, "temperature": 0.0}
    plain, kv = _both("/v1/chat/completions", body)
    want = plain["choices"][0]["message"]["content"]
    assert kv["choices"][0]["message"]["content"] == want
    text, _ = _stream(f"http://127.0.0.1:{KV_PORT}/v1/chat/completions", {**body, "model": "kvcached"})
    assert text == want


def test_metrics_and_segment(servers) -> None:
    from kvcached import mem_info

    for port in (PLAIN_PORT, KV_PORT):
        status, text = _get(f"http://127.0.0.1:{port}/metrics")
        assert status == 200 and "vllm:num_requests_running" in text
    info = mem_info.read_segment(SEGMENT)
    assert info.pid > 0 and info.capacity > 0
    assert info.peak_used > 0  # the requests above mapped pages


def test_router_routes_by_model(router) -> None:
    body = {"prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0.0}
    direct = _post(f"http://127.0.0.1:{PLAIN_PORT}/v1/completions", {**body, "model": "plain"})
    for name in ("plain", "kvcached"):
        via = _post(f"http://127.0.0.1:{ROUTER_PORT}/v1/completions", {**body, "model": name})
        assert via["choices"][0]["text"] == direct["choices"][0]["text"], name
        text, _ = _stream(f"http://127.0.0.1:{ROUTER_PORT}/v1/completions", {**body, "model": name})
        assert text == direct["choices"][0]["text"], name
    req = urllib.request.Request(f"http://127.0.0.1:{ROUTER_PORT}/v1/completions",
                                 json.dumps({**body, "model": "nope"}).encode(), {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 404
    _, stats = _get(f"http://127.0.0.1:{ROUTER_PORT}/router/stats")
    counts = json.loads(stats)["models"]
    assert counts["plain"]["requests"] >= 2 and counts["kvcached"]["requests"] >= 2


def test_router_sleeps_idle_engine_and_wakes_it(router) -> None:
    from kvcached import mem_info

    body = {"prompt": PROMPTS[1], "max_tokens": 16, "temperature": 0.0, "model": "kvcached"}
    before = _post(f"http://127.0.0.1:{ROUTER_PORT}/v1/completions", body)["choices"][0]["text"]
    # a burst whose finished blocks stay as prefix cache on several pages (16000 tokens may stay cached);
    # each prompt stays under the server's --max-model-len (512 with its 8 new tokens: 40 repeats made 559)
    burst = [" ".join(f"{p} {i}" for _ in range(20)) for i, p in enumerate(PROMPTS * 16)]
    _post(f"http://127.0.0.1:{ROUTER_PORT}/v1/completions",
          {"prompt": burst, "max_tokens": 8, "temperature": 0.0, "model": "kvcached"})
    cached = mem_info.read_segment(SEGMENT).used_size
    deadline = time.monotonic() + 60
    sleeping = False
    while time.monotonic() < deadline and not sleeping:
        time.sleep(0.5)
        sleeping = json.loads(_get(f"http://127.0.0.1:{KV_PORT}/is_sleeping")[1])["is_sleeping"]
    assert sleeping, "the router did not put the idle kvcached engine to sleep"
    asleep = mem_info.read_segment(SEGMENT)
    print(f"KV pages in use: {cached} B with the burst's prefix cache, {asleep.used_size} B asleep")
    assert asleep.used_size < cached  # the prefix cache was dropped: only vLLM's null block keeps its page
    t0 = time.monotonic()
    after = _post(f"http://127.0.0.1:{ROUTER_PORT}/v1/completions", body)["choices"][0]["text"]
    print(f"wake + request: {time.monotonic() - t0:.3f} s")
    assert after == before
    stats = json.loads(_get(f"http://127.0.0.1:{ROUTER_PORT}/router/stats")[1])["models"]["kvcached"]
    assert stats["sleeps"] >= 1 and stats["wakes"] >= 1
    print(f"router stats: {stats}")


def test_no_segment_left_after_exit(servers) -> None:
    codes = servers[0].stop()
    assert all(c is not None for c in codes.values())
    assert not Path("/dev/shm", SEGMENT).exists()

"""One client's bad input costs no one else anything, against a live server on 127.0.0.1: every sampling value
checked (400 naming the field), a request failing inside a shared batch fails alone, oversized or deeply nested
bodies refused without stalling the event loop, and every outcome counted in /metrics beside both tiers' blocks."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

aiohttp = pytest.importorskip("aiohttp")

POISON_SEED = 666
POLICIES = {"dense": {}, "flexicache": dict(budget=32, rerank_interval=2, unstable_heads=[[1, 0]])}


def _start(tiny_llama_dir, policy: str):
    from systems.engine.system import EngineSystem
    from systems.openai_server import start_in_thread

    engine = SimpleNamespace(device_memory_gb=0.01, host_memory_gb=0.01, max_num_seqs=4, page_size=16)
    system = EngineSystem(str(tiny_llama_dir), policy, POLICIES[policy], engine=engine, dtype="float32")
    return start_in_thread(system, "tiny", max_queue=4)


@pytest.fixture(scope="module", params=sorted(POLICIES))
def any_server(request, tiny_llama_dir):
    handle = _start(tiny_llama_dir, request.param)
    yield handle
    handle.close()


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    handle = _start(tiny_llama_dir, "dense")
    yield handle
    handle.close()


def health(server) -> dict:
    return httpx.get(server.url + "/health").json()


def wait_idle(server, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        snap = health(server)
        if snap["running"] == 0 and snap["waiting"] == 0:
            return snap
        time.sleep(0.05)
    raise AssertionError(f"server still busy: {snap}")


def _text(raw: str) -> str:
    """A completion's text (JSON or SSE), or the error message of an error body."""
    if raw.startswith("data: "):
        chunks = [json.loads(e[len("data: "):]) for e in raw.split("\n\n") if e and e != "data: [DONE]"]
        return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    body = json.loads(raw)
    return body["error"]["message"] if "error" in body else body["choices"][0]["text"]


def post_raw(server, text: str, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(server.url + path, content=text.encode(), headers={"content-type": "application/json"})


@pytest.mark.parametrize("body, param", [
    ('{"prompt": "x", "temperature": NaN}', "temperature"),
    ('{"prompt": "x", "temperature": Infinity}', "temperature"),
    ('{"prompt": "x", "temperature": "hot"}', "temperature"),
    ('{"prompt": "x", "top_p": NaN}', "top_p"),
    ('{"prompt": "x", "top_p": -Infinity}', "top_p"),
    (f'{{"prompt": "x", "temperature": 0.7, "seed": {2 ** 70}}}', "seed"),
    (f'{{"prompt": "x", "seed": {-(2 ** 64)}}}', "seed"),
    ('{"prompt": "x", "seed": 1.5}', "seed"),
    ('{"prompt": "x", "seed": true}', "seed"),
    ('{"prompt": "x", "max_tokens": 2.0}', "max_tokens"),
    ('{"prompt": "x", "max_tokens": NaN}', "max_tokens"),
    (f'{{"prompt": "x", "max_tokens": {10 ** 30}}}', "max_tokens"),
    ('{"prompt": "x", "ignore_eos": 1}', "ignore_eos"),
    (json.dumps({"prompt": "x", "stop": [str(i) for i in range(17)]}), "stop"),
    (json.dumps({"prompt": [5, 6.0]}), "prompt"),
])
def test_every_sampling_value_is_checked_with_a_400_naming_it(server, body, param):
    before = health(server)["requests"]["invalid"]
    resp = post_raw(server, body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and len(err["message"].splitlines()) == 1
    assert health(server)["requests"]["invalid"] == before + 1


def test_a_request_failing_in_a_shared_batch_fails_alone(any_server, monkeypatch):
    """A request whose sampling fails inside the engine (the server's checks bypassed, as a bug would) beside
    healthy greedy and sampled requests: it alone gets a 500, the others get what they get alone."""
    import systems.engine.sampler as sampler

    server = any_server
    real = sampler._draw

    def draw(row, seq):
        if seq.request.seed == POISON_SEED:
            raise RuntimeError("poisoned draw")
        return real(row, seq)

    monkeypatch.setattr(sampler, "_draw", draw)
    healthy = [{"prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0, "ignore_eos": True},
               {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.9, "seed": 5, "ignore_eos": True},
               {"prompt": "Hello there", "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stream": True}]
    poisoned = {"prompt": "Poison", "max_tokens": 16, "temperature": 0.7, "seed": POISON_SEED, "ignore_eos": True}

    async def one(session, body):
        async with session.post(server.url + "/v1/completions", json=body) as resp:
            return resp.status, _text(await resp.text())

    async def together(bodies):
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(one(session, b) for b in bodies))

    alone = [asyncio.run(together([b]))[0] for b in healthy]
    before = wait_idle(server)
    nan = '{"prompt": "x", "temperature": NaN}'    # the probe: refused at the door, beside the others
    results = asyncio.run(together([healthy[0], poisoned, healthy[1], json.loads(nan, parse_constant=float),
                                    healthy[2]]))
    assert results[1][0] == 500 and "poisoned draw" in results[1][1]
    assert results[3][0] == 400 and "temperature" in results[3][1]
    assert [results[0], results[2], results[4]] == alone and all(status == 200 for status, _ in alone)
    after = wait_idle(server)
    delta = {k: after["requests"][k] - before["requests"][k] for k in before["requests"]}
    assert delta == {**dict.fromkeys(delta, 0), "received": 5, "completed": 3, "failed": 1, "invalid": 1}
    assert after["kv"]["device_blocks_used"] == 0 and after["kv"]["host_blocks_used"] == 0


def test_a_value_the_engine_refuses_never_joins_a_batch(server):
    """Defense in depth: a request that reaches the engine loop with a NaN temperature is refused there (400)."""
    from systems.base import GenerationRequest
    from systems.engine_link import Live

    async def submit():
        live = Live(GenerationRequest("direct", [5, 6, 7], 4, temperature=float("nan")))
        server.server.client.submit(live)
        try:
            return await asyncio.wait_for(live.events.get(), 10)
        finally:
            live.done = True
            server.server.client.release(live)

    kind, message, param = asyncio.run_coroutine_threadsafe(submit(), server.loop).result(15)
    assert kind == "invalid" and "temperature=nan must be a finite number" in message and param is None
    assert health(server)["running"] == 0


def test_deeply_nested_json_gets_400(server):
    before = health(server)["requests"]
    for body in ("[" * 50_000 + "]" * 50_000, '{"prompt": ' + "[" * 40 + "1" + "]" * 40 + "}"):
        resp = post_raw(server, body)
        assert resp.status_code == 400 and "nests JSON deeper" in resp.json()["error"]["message"]
    after = health(server)["requests"]
    assert after["invalid"] == before["invalid"] + 2 and after["received"] == before["received"] + 2


def test_a_body_over_the_limit_is_refused_from_its_header_unread(server):
    host, port = server.url.removeprefix("http://").split(":")
    before = health(server)["requests"]["too_large"]
    with socket.create_connection((host, int(port)), timeout=5) as sock:      # headers only: the body never comes
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 10485760\r\n\r\n")
        reply = sock.recv(65536).decode()
    assert reply.startswith("HTTP/1.1 413"), reply
    assert "shorten the prompt" in reply and "Connection: close" in reply
    assert health(server)["requests"]["too_large"] == before + 1


def _health_latencies(server, during) -> tuple[list[float], object]:
    """/health round trips (s) while `during()` runs on another thread; returns them and during's result."""
    result: list = []
    worker = threading.Thread(target=lambda: result.append(during()))
    lat = []
    with httpx.Client() as client:
        client.get(server.url + "/health")                                  # connection warm
        worker.start()
        while worker.is_alive() or len(lat) < 5:
            t0 = time.perf_counter()
            assert client.get(server.url + "/health").status_code == 200
            lat.append(time.perf_counter() - t0)
            time.sleep(0.01)
    worker.join()
    return lat, result[0]


def _fast_health_during(server, during, check) -> None:
    """/health stays under 100 ms while `during()` runs. A stalled event loop stalls every try for as long as the
    work takes (seconds), so the best of three tries tells it apart from a busy neighbour on a shared machine."""
    worst = []
    for _ in range(3):
        lat, result = _health_latencies(server, during)
        check(result)
        worst.append(max(lat))
        if worst[-1] < 0.1:
            return
    pytest.fail(f"/health took up to {min(worst) * 1e3:.0f} ms at best of 3 tries")


@pytest.mark.parametrize("how", ["content-length", "chunked"])
def test_health_answers_within_100ms_while_a_10mb_body_is_refused(server, how):
    body = b'{"prompt": "' + b"a " * (5 << 20) + b'"}'                        # 10 MiB of text prompt

    def upload():
        content = body if how == "content-length" else (body[i:i + (64 << 10)] for i in range(0, len(body), 64 << 10))
        try:
            return httpx.post(server.url + "/v1/completions", content=content,
                              headers={"content-type": "application/json"}, timeout=30).status_code
        except httpx.TransportError:          # the server may close before a chunked upload is fully sent
            return 413

    def check(status):
        assert status == 413

    _fast_health_during(server, upload, check)


def test_a_prompt_longer_than_the_context_is_refused_without_stalling_health(server):
    """Under the byte limit: a prompt too long even at the longest tokens is refused by its length, untokenized;
    one that has to be tokenized to know is tokenized off the event loop."""
    chars = server.server.max_chars
    for text, param in (("z" * (chars + 1), "prompt"), ("hello world " * (chars // 13), "prompt")):
        def send(text=text):
            return httpx.post(server.url + "/v1/completions", json={"prompt": text}, timeout=30)

        def check(resp, param=param):
            assert resp.status_code == 400 and resp.json()["error"]["param"] == param

        _fast_health_during(server, send, check)


def test_metrics_count_every_outcome_and_show_both_tiers(server):
    before = wait_idle(server)["requests"]
    url = server.url + "/v1/completions"
    statuses = [
        httpx.post(url, json={"prompt": "hi", "max_tokens": 2}).status_code,              # completed
        httpx.post(url, json={"prompt": "hi", "top_p": 0}).status_code,                   # invalid
        httpx.post(url, json={"prompt": "hi", "model": "gpt-4"}).status_code,             # unknown model
        post_raw(server, "{broken").status_code,                                           # malformed JSON
        post_raw(server, "[" * 50_000).status_code,                                        # too deep (and broken)
        post_raw(server, '"just a string"').status_code,                                   # not an object
        httpx.post(url, content=b"\xff\xfe", headers={"content-type": "application/json"}).status_code,
        httpx.post(url, content=b"x" * (server.server.max_body_bytes + 1)).status_code,    # too large
    ]
    assert statuses == [200, 400, 404, 400, 400, 400, 400, 413]
    after = wait_idle(server)["requests"]
    delta = {k: after[k] - before[k] for k in before}
    assert delta["received"] == len(statuses) == sum(v for k, v in delta.items() if k != "received")
    assert delta["too_large"] == 1 and delta["completed"] == 1 and delta["invalid"] == 6
    metrics = httpx.get(server.url + "/metrics").text
    for name in ("requests_too_large_total", "kv_device_blocks_used", "kv_host_blocks_used", "kv_host_blocks_total"):
        assert f"kvharness_{name} " in metrics, name
    assert 'kvharness_http_responses_total{code="413"}' in metrics


def test_host_tier_blocks_in_use_show_in_metrics(tiny_llama_dir):
    """FlexiCache keeps stable heads' full KV on the host: /metrics shows those blocks while a request runs and
    shows them returned once it is gone, so a host-tier leak is visible from outside."""
    handle = _start(tiny_llama_dir, "flexicache")
    try:
        def gauge(name: str) -> int:
            text = httpx.get(handle.url + "/metrics").text
            return int(next(line.split()[1] for line in text.splitlines() if line.startswith(f"kvharness_{name} ")))

        body = {"prompt": "word " * 200, "max_tokens": 1500, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", handle.url + "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            for _ in range(4):
                next(lines)
            assert gauge("kv_host_blocks_used") > 0 and gauge("kv_device_blocks_used") > 0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (gauge("kv_host_blocks_used") or gauge("kv_device_blocks_used")):
            time.sleep(0.05)
        assert gauge("kv_host_blocks_used") == 0 and gauge("kv_device_blocks_used") == 0
    finally:
        handle.close()

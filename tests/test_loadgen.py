"""Arrival processes (vLLM's gamma + rescale) and the streaming client's timing against a scripted SSE server."""
from __future__ import annotations

import asyncio
import json
import threading

import numpy as np
import pytest

from harness.measuring.loadgen import Prompt, arrival_times, run_load


def test_poisson_is_seeded_and_lands_last_arrival_at_n_over_rate():
    a = arrival_times(50, rate=4.0, seed=3)
    assert a[-1] == pytest.approx(50 / 4.0) and np.all(np.diff(a) >= 0) and a[0] > 0
    assert np.array_equal(a, arrival_times(50, rate=4.0, seed=3))
    assert not np.array_equal(a, arrival_times(50, rate=4.0, seed=4))


def test_constant_and_infinite_rates():
    assert np.allclose(arrival_times(4, rate=2.0, process="constant"), [0.5, 1.0, 1.5, 2.0])
    assert np.allclose(arrival_times(3, rate=2.0, process="gamma", burstiness=float("inf")), [0.5, 1.0, 1.5])
    assert np.array_equal(arrival_times(5, rate=float("inf")), np.zeros(5))


def test_burstiness_shapes_the_gaps():
    """Gamma gaps have coefficient of variation 1/sqrt(b): b < 1 is burstier than Poisson, b > 1 more regular."""
    cv = {}
    for b in (0.25, 1.0, 4.0):
        gaps = np.diff(arrival_times(4000, rate=10.0, process="gamma", burstiness=b, seed=0))
        cv[b] = gaps.std() / gaps.mean()
        assert cv[b] == pytest.approx(1 / np.sqrt(b), rel=0.1)
    assert cv[0.25] > cv[1.0] > cv[4.0]


@pytest.mark.parametrize("kwargs, needle", [
    ({"num_requests": 0, "rate": 1.0}, "num_requests"),
    ({"num_requests": 3, "rate": 0.0}, "rate"),
    ({"num_requests": 3, "rate": 1.0, "process": "uniform"}, "unknown"),
    ({"num_requests": 3, "rate": 1.0, "process": "poisson", "burstiness": 2.0}, "process=gamma"),
    ({"num_requests": 3, "rate": 1.0, "process": "gamma", "burstiness": 0.0}, "burstiness"),
])
def test_bad_arrival_arguments(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        arrival_times(**kwargs)


CONNECTIONS: list[int] = []


@pytest.fixture(scope="module")
def scripted_server():
    """SSE server with known timing: 100 ms to the first token, then 2 more tokens 50 ms apart, then usage; the
    connection each request came on (the client's port) is appended to CONNECTIONS."""
    from aiohttp import web

    async def completions(request):
        CONNECTIONS.append(request.transport.get_extra_info("peername")[1])     # the client's port
        body = await request.json()
        if body["prompt"] == "busy":
            return web.json_response({"error": {"message": "overloaded"}}, status=503, headers={"Retry-After": "1"})
        if body["prompt"] == "hang":
            await asyncio.sleep(30)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(0.1)
        for i, text in enumerate(["a", "b", "c"]):
            if i:
                await asyncio.sleep(0.05)
            await resp.write(f"data: {json.dumps({'choices': [{'index': 0, 'text': text}]})}\n\n".encode())
        await asyncio.sleep(0.05)     # the usage chunk must not move the last-token time
        usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        return resp

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app, handler_cancellation=True)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
    host, port = runner.addresses[0][:2]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://{host}:{port}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def test_client_measures_ttft_itl_and_e2el_like_vllm(scripted_server):
    prompts = [Prompt("hello", 1), Prompt("hello", 1), Prompt("busy", 1)]
    outs, duration = asyncio.run(run_load(scripted_server, "m", prompts, [0.0, 0.2, 0.25], max_tokens=3))
    ok, _, busy = outs
    assert ok.success and ok.output_tokens == 3 and ok.prompt_len == 7 and ok.generated_text == "abc"
    # lower bounds only: the server sleeps at least this long; a loaded machine may add any delay
    assert ok.ttft >= 0.1
    assert len(ok.itl) == 2 and all(gap >= 0.045 for gap in ok.itl)
    assert ok.latency == pytest.approx(ok.ttft + sum(ok.itl))               # ends at the last token chunk
    assert outs[1].start_time - ok.start_time >= 0.195                        # sent at its arrival offset
    assert not busy.success and busy.status == 503 and "503" in busy.error
    assert duration >= 0.25 + 0.2


def test_client_drops_connections_idle_before_a_server_closes_them(scripted_server, monkeypatch):
    """A connection idle longer than IDLE_CONNECTION_S is not reused (a server closing it just then would fail the
    request); one idle less is."""
    from harness.measuring import loadgen

    monkeypatch.setattr(loadgen, "IDLE_CONNECTION_S", 0.5)
    prompts = [Prompt("hello", 1) for _ in range(3)]
    # one connection at a time: the second request waits for the first's connection however late it ends
    outs, _ = asyncio.run(run_load(scripted_server, "m", prompts, [0.0, 0.45, 2.0], max_tokens=3,
                                   max_concurrency=1))
    assert all(o.success for o in outs)
    first, second, third = CONNECTIONS[-3:]
    assert first == second              # idle about 0.2 s (or none): kept
    assert third != second              # idle about 1.3 s: a new connection


def test_cell_time_limit_cancels_requests_still_in_flight(scripted_server):
    prompts = [Prompt("hang", 1), Prompt("hello", 1), Prompt("late", 1)]
    outs, duration = asyncio.run(run_load(scripted_server, "m", prompts, [0.0, 0.05, 5.0], max_tokens=3,
                                          max_seconds=1.0))
    assert len(outs) == 2                                                     # the 5 s arrival is never sent
    assert not outs[0].success and "time limit" in outs[0].error
    assert outs[1].success
    assert duration < 3.0


def test_same_draws_as_vllm_bench_for_a_seed():
    """vLLM seeds the global numpy RNG and draws one gamma gap per request, then rescales the cumulative sum."""
    rate, b, n, seed = 3.0, 0.5, 100, 5
    np.random.seed(seed)
    delays = np.cumsum([np.random.gamma(shape=b, scale=1.0 / (rate * b)) for _ in range(n)])
    delays *= (n / rate) / delays[-1]
    assert np.allclose(arrival_times(n, rate, process="gamma", burstiness=b, seed=seed), delays)

"""The OpenAI-compatible server over the engine: standard clients, validation, overload, disconnects, loopback."""
from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

openai = pytest.importorskip("openai")

MAX_NUM_SEQS, MAX_QUEUE = 2, 2


@pytest.fixture(scope="module")
def system(tiny_llama_dir):
    from systems.engine.system import EngineSystem

    engine = SimpleNamespace(device_memory_gb=0.01, host_memory_gb=0.01, max_num_seqs=MAX_NUM_SEQS, page_size=16)
    return EngineSystem(str(tiny_llama_dir), "dense", {}, engine=engine, dtype="float32")


class ProcessServer:
    """HTTP in a process of its own (as `python -m systems.server` runs it), the engine loop on a thread here."""

    def __init__(self, system, **kwargs) -> None:
        import threading

        from systems import http_process
        from systems.engine_loop import EngineLoop

        self.front = http_process.start(system, "tiny", **kwargs)
        self.url, self.engine_loop = self.front.url, EngineLoop(system.engine, self.front.engine_end)
        self.thread = threading.Thread(target=self.engine_loop.run, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.engine_loop.stop_soon()
        self.thread.join(timeout=30)
        self.front.close()


@pytest.fixture(scope="module", params=["thread", "process"])
def server(system, request):
    """Every test here runs against both layouts: HTTP on a thread beside the engine loop, and in its own process."""
    from systems.openai_server import start_in_thread

    kwargs = {"max_queue": MAX_QUEUE, "retry_after_s": 2}
    handle = start_in_thread(system, "tiny", **kwargs) if request.param == "thread" else ProcessServer(system, **kwargs)
    yield handle
    handle.close()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def health(server) -> dict:
    return httpx.get(server.url + "/health").json()


def wait_idle(server, timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        snap = health(server)
        if snap["running"] == 0 and snap["waiting"] == 0:
            return snap
        time.sleep(0.05)
    raise AssertionError(f"server still busy: {snap}")


def test_streamed_completion_matches_engine_and_non_streamed(client, system, server):
    wait_idle(server)
    prompt = "The quick brown fox"
    chunks = list(client.completions.create(
        model="tiny", prompt=prompt, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    token_chunks = [c for c in chunks if c.choices]
    assert len(token_chunks) == 8                              # one SSE chunk per generated token
    assert [c.choices[0].finish_reason for c in token_chunks] == [None] * 7 + ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    prompt_ids = system.tokenizer.encode(prompt, add_special_tokens=True)
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids)
    streamed = "".join(c.choices[0].text for c in token_chunks)
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert whole.choices[0].text == streamed and whole.usage.completion_tokens == 8
    # Greedy tokens through HTTP are the engine's own greedy tokens for the same ids.
    by_ids = client.completions.create(model="tiny", prompt=prompt_ids, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == streamed


def test_streamed_chat_completion(client, system):
    messages = [{"role": "user", "content": "Say hi."}]
    chunks = list(client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    token_chunks = [c for c in chunks if c.choices]
    assert token_chunks[0].choices[0].delta.role == "assistant"
    assert len(token_chunks) == 6 and token_chunks[-1].choices[0].finish_reason == "length"
    text = system.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chunks[-1].usage.prompt_tokens == len(system.tokenizer.encode(text, add_special_tokens=False))
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert whole.choices[0].message.content == "".join(c.choices[0].delta.content for c in token_chunks)


def test_stop_string_cuts_text_and_finishes_with_stop(client, server):
    free = client.completions.create(model="tiny", prompt="Once upon", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = free[len(free) // 2:len(free) // 2 + 3]
    expected = free[:free.find(stop)]
    whole = client.completions.create(model="tiny", prompt="Once upon", max_tokens=12, temperature=0, stop=[stop],
                                      extra_body={"ignore_eos": True})
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "stop"
    chunks = [c for c in client.completions.create(model="tiny", prompt="Once upon", max_tokens=12, temperature=0,
                                                   stop=stop, stream=True, extra_body={"ignore_eos": True})]
    assert "".join(c.choices[0].text for c in chunks) == expected and chunks[-1].choices[0].finish_reason == "stop"
    assert wait_idle(server)["kv"]["device_blocks_free"] == health(server)["kv"]["device_blocks_total"]


def test_raw_sse_framing_ends_with_done(server):
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 3, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    usage = json.loads(events[-2][len("data: "):])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    (entry,) = httpx.get(server.url + "/v1/models").json()["data"]
    assert entry["root"].endswith(Path(entry["root"]).name) and Path(entry["root"], "config.json").is_file()
    assert entry["parent"] is None
    snap = health(server)
    assert snap["status"] == "ok"
    assert set(snap["requests"]) == {"received", "completed", "rejected", "invalid", "too_large", "failed",
                                     "aborted"}
    metrics = httpx.get(server.url + "/metrics").text
    assert f"kvharness_requests_completed_total {snap['requests']['completed']}" in metrics
    # the engine's forwards by kind: a request of 4 tokens makes 3 of them in decode rows
    before = wait_idle(server)["steps"]
    client.completions.create(model="tiny", prompt="Hi", max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    steps = wait_idle(server)["steps"]
    assert steps["decode_rows"] + steps["mixed_rows"] - before["decode_rows"] - before["mixed_rows"] == 3
    metrics = httpx.get(server.url + "/metrics").text
    assert steps["decode_rows"] + steps["mixed_rows"] > 0 and steps["decode_s"] > 0
    assert f"kvharness_engine_decode_rows_total {steps['decode_rows']}" in metrics
    assert "kvharness_engine_mixed_seconds_total" in metrics


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -3}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 5000}, "max_tokens"),           # beyond the 2048-token context
    ({"prompt": [5] * 2048, "max_tokens": 1}, "prompt"),           # the prompt alone fills the context
    ({"prompt": "x", "temperature": 2.5}, "temperature"),
    ({"prompt": "x", "temperature": -0.1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "n": 3}, "n"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [10, 10 ** 9]}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "stop": 3}, "stop"),
])
def test_bad_completion_bodies_get_400(server, body, param):
    before = health(server)["requests"]["invalid"]
    resp = httpx.post(server.url + "/v1/completions", json=body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and err["message"]
    assert health(server)["requests"]["invalid"] == before + 1


@pytest.mark.parametrize("path, payload, status", [
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, 400),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404),
])
def test_bad_chat_bodies_and_unknown_model(server, path, payload, status):
    resp = httpx.post(server.url + path, json=payload)
    assert resp.status_code == status and resp.json()["error"]["message"]


def test_malformed_json_gets_400(server):
    resp = httpx.post(server.url + "/v1/completions", content=b"{not json",
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]


def test_overload_burst_is_bounded_and_every_request_accounted(server):
    """A burst far beyond slots + queue: some are turned away with 503 + Retry-After, the rest complete."""
    import aiohttp

    wait_idle(server)
    before = health(server)["requests"]
    n, max_tokens = 12, 96
    body = {"model": "tiny", "prompt": "Load test", "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0, "stream_options": {"include_usage": True}}

    async def one(session):
        async with session.post(server.url + "/v1/completions", json=body) as resp:
            text = await resp.text()
            return resp.status, resp.headers.get("Retry-After"), text

    async def burst():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(one(session) for _ in range(n)))

    results = asyncio.run(burst())
    statuses = [r[0] for r in results]
    assert set(statuses) <= {200, 503}
    rejected = [r for r in results if r[0] == 503]
    assert rejected, "the burst should overflow 2 slots + 2 queued requests"
    assert all(r[1] == "2" for r in rejected)
    assert statuses.count(200) >= MAX_NUM_SEQS + MAX_QUEUE
    for status, _, text in results:
        if status == 200:
            usage = json.loads([e for e in text.split("\n\n") if e][-2][len("data: "):])["usage"]
            assert usage["completion_tokens"] == max_tokens
    after = wait_idle(server)
    delta = {k: after["requests"][k] - before[k] for k in before}
    assert delta["received"] == n
    assert delta["completed"] == statuses.count(200) and delta["rejected"] == len(rejected)
    assert delta["completed"] + delta["rejected"] == n and delta["failed"] == 0
    assert after["kv"]["device_blocks_free"] == after["kv"]["device_blocks_total"]


def test_client_disconnect_frees_kv_blocks(server):
    idle = wait_idle(server)
    total = idle["kv"]["device_blocks_total"]
    assert idle["kv"]["device_blocks_free"] == total
    body = {"model": "tiny", "prompt": "A long story", "max_tokens": 1900, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as resp:
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]                 # a few tokens in: the sequence holds blocks
        assert any(line.startswith("data: ") for line in got)
        busy = health(server)
        assert busy["running"] == 1 and busy["kv"]["device_blocks_free"] < total
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        snap = health(server)
        if snap["running"] == 0 and snap["kv"]["device_blocks_free"] == total:
            break
        time.sleep(0.05)
    assert snap["kv"]["device_blocks_free"] == total and snap["running"] == 0
    assert snap["requests"]["aborted"] == idle["requests"]["aborted"] + 1


def _non_loopback_address() -> str | None:
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("10.255.255.255", 1))          # no packet is sent: this only picks a route
        addr = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if addr.startswith("127.") else addr


def test_binds_loopback_only_by_default(server):
    from systems.server import build_parser

    assert build_parser().parse_args(["--model", "m"]).host == "127.0.0.1"
    host, port = server.url.removeprefix("http://").split(":")
    assert host == "127.0.0.1"
    addr = _non_loopback_address()
    if addr is not None:
        with pytest.raises(OSError):
            socket.create_connection((addr, int(port)), timeout=1).close()


@pytest.mark.parametrize("argv, needle", [
    (["--policy", "no_such_policy"], "unknown policy"),
    (["--params", "[1, 2]"], "--params must be a JSON object"),
    (["--params", "{budget: 5}"], "--params must be a JSON object"),
    (["--policy", "dense", "--params", '{"budget": 5}'], "unknown parameter"),
    (["--max-queue", "-1"], "--max-queue"),
    (["--max-body-mb", "0"], "--max-body-mb"),
    (["--model", "/nonexistent/folder"], "has no config.json"),
])
def test_cli_rejects_bad_arguments_before_loading(argv, needle, capsys):
    from systems.server import main

    if "--model" not in argv:
        argv = ["--model", "/nonexistent/folder", *argv]     # the argument checks come before the folder's
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_detokenizer_cuts_stop_strings_and_holds_partial_matches(system):
    from systems.openai_api import Detokenizer

    tok = system.tokenizer
    ids = tok.encode(" alpha beta STOP gamma", add_special_tokens=False)
    detok = Detokenizer(tok, ("STOP",))
    text = "".join(detok.push([t], final=False) for t in ids)
    assert text == " alpha beta " and detok.stopped
    plain = Detokenizer(tok, ())
    assert "".join(plain.push([t], final=i == len(ids) - 1) for i, t in enumerate(ids)) == tok.decode(ids)


@pytest.mark.slow
def test_vllm_bench_serve_runs_unchanged_against_the_cli_server(tiny_llama_dir, tmp_path):
    """`python -m systems.server` in a subprocess, measured by vLLM's own `bench serve` code."""
    import argparse
    import subprocess
    import sys

    serve = pytest.importorskip("vllm.benchmarks.serve")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "systems.server", "--model", str(tiny_llama_dir),
                             "--served-model-name", "tiny", "--port", str(port), "--dtype", "float32",
                             "--device-memory-gb", "0.05"], start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        parser = argparse.ArgumentParser()
        serve.add_cli_args(parser)
        args = parser.parse_args([
            "--backend", "openai", "--base-url", url, "--model", "tiny", "--tokenizer", str(tiny_llama_dir),
            "--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "8", "--num-prompts",
            "6", "--request-rate", "10", "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el"])
        result = serve.main(args)
        assert result["completed"] == 6 and result["failed"] == 0 and result["total_output_tokens"] == 48
        # One chunk per token: vLLM's pooled ITL mean equals its TPOT mean.
        assert result["mean_itl_ms"] == pytest.approx(result["mean_tpot_ms"], rel=1e-6)
        assert httpx.get(url + "/health").json()["requests"]["completed"] == 6
    finally:
        proc.terminate()
        proc.wait(30)


def test_request_larger_than_the_device_tier_is_refused_before_it_joins_a_batch(server, system):
    """A request that alone would outgrow the device tier (by the policy's own rule) gets a 400 naming the fix from
    the engine loop, not a failed engine step; one token less fits."""
    engine = system.engine
    capacity, page = engine.kv.device_blocks.capacity, engine.kv.page_size
    fits = capacity // (engine.kv.num_layers * engine.kv.num_kv_heads) * page         # whole pages, every head
    if fits >= engine.max_model_len:
        pytest.skip("the device tier holds a whole context")
    url = server.url + "/v1/completions"
    too_big = httpx.post(url, json={"model": "tiny", "prompt": [5], "max_tokens": fits}, timeout=30)
    assert too_big.status_code == 400, too_big.text
    error = too_big.json()["error"]
    assert error["param"] == "max_tokens" and "--device-memory-gb" in error["message"]
    assert wait_idle(server)["kv"]["device_blocks_used"] == 0

"""OpenAI-compatible HTTP server over the paged engine: completions and chat (SSE streaming), bounded queue.

    python -m systems.server --policy quest --params '{"budget": 512}' --port 8000   # 127.0.0.1 unless --host

Routes: POST /v1/completions (`logprobs`, `echo`: systems/openai_logprobs.py), POST /v1/chat/completions (`stream`,
`stream_options.include_usage`, `ignore_eos`), GET /v1/models, GET /health (JSON), GET /metrics (Prometheus).

One thread (systems.engine_loop) owns the engine (it is not thread-safe): it takes new requests and aborts through a
link (systems.engine_link), steps while any request exists, and sends each step's new tokens back, which land on the
request's asyncio queue. From the command line the engine loop runs on the main thread of the process that built the
engine and HTTP on a second thread (`start_in_thread(engine_thread=False)`), or in a process of its own
(systems.http_process).
Every token becomes one SSE chunk, so a client's inter-chunk gaps are the engine's per-token gaps (what vLLM's bench
measures as ITL); the chunk carrying the last token also carries `finish_reason`.

Overload: at most max_num_seqs (running) + `max_queue` (waiting) requests, beyond that 503 with Retry-After. A
client that disconnects has its sequence taken out of the scheduler, freeing its KV blocks, at the engine's next turn.

One client's bad input costs no one else anything. Bad bodies get 400 with an OpenAI-style JSON error naming the
field before the request reaches the engine (the engine checks the sampling values again at add_request); a failure
inside one sequence's step fails that request alone (Engine.step). A body over `max_body_bytes` is refused with 413
from its Content-Length, or as soon as a chunked body passes the limit, without reading the rest; JSON parsing and
tokenizing run on worker threads, so the event loop (and /health) stays responsive meanwhile. Every generation
request ends in exactly one outcome counter (`received` = the sum of the others once none is in flight), and
/metrics also counts every HTTP response by status code.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from systems import openai_api as api
from systems.engine_link import EngineClient, EngineFacts, Live, QueueClient, QueuePort, facts_of
from systems.engine_loop import EngineLoop
from systems.openai_api import ApiError, Detokenizer, Params, parse_body
from systems.openai_logprobs import ChoiceText
from systems.openai_logprobs import merge as merge_logprobs

log = logging.getLogger("kvharness.server")
OUTCOMES = ("completed", "rejected", "invalid", "too_large", "failed", "aborted")


class OpenAIServer:
    """The HTTP side: validation, admission (bounded queue), SSE framing, counters."""

    def __init__(self, client: EngineClient, facts: EngineFacts, tokenizer: Any, model_name: str,
                 max_queue: int = 64, retry_after_s: int = 1, max_body_bytes: int | None = None) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue={max_queue} must be >= 0")
        self.client, self.facts, self.tokenizer, self.model_name = client, facts, tokenizer, model_name
        self.max_queue, self.retry_after_s = max_queue, retry_after_s
        self.max_body_bytes = max_body_bytes or api.default_max_body_bytes(facts.max_model_len)
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes={self.max_body_bytes} must be >= 1")
        self.max_chars = api.max_prompt_chars(self.tokenizer, facts.max_model_len)
        # parsing and tokenizing off the event loop (HF tokenizers release the GIL while they encode)
        self.workers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="http-parse")
        self.in_flight = 0
        # Requests not yet admitted count as waiting only beyond the running slots, so a burst fills both.
        self.capacity = facts.max_num_seqs + max_queue
        self.counts = {"received": 0, **dict.fromkeys(OUTCOMES, 0)}
        self.http_status: Counter[int] = Counter()
        self.started = time.time()

    def app(self) -> web.Application:
        # +1: aiohttp refuses a body once it reaches client_max_size; max_body_bytes itself is allowed
        app = web.Application(client_max_size=self.max_body_bytes + 1, middlewares=[self._count_status])
        app.add_routes([web.post("/v1/completions", self.completions),
                        web.post("/v1/chat/completions", self.chat_completions),
                        web.get("/v1/models", self.models), web.get("/health", self.health),
                        web.get("/metrics", self.metrics)])
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        self.client.start(asyncio.get_running_loop())

    async def _stop(self, app: web.Application) -> None:
        self.workers.shutdown(wait=False, cancel_futures=True)

    @web.middleware
    async def _count_status(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Every response counted by status; an unexpected exception becomes a JSON 500, never a bare traceback."""
        try:
            resp = await handler(request)
        except web.HTTPException as exc:
            self.http_status[exc.status] += 1
            raise
        except Exception:  # noqa: BLE001 - logged; the client gets a JSON 500
            log.exception("unhandled error in %s %s", request.method, request.path)
            self.http_status[500] += 1
            return ApiError("internal server error; see the server log", status=500,
                            kind="internal_error").response()
        self.http_status[resp.status] += 1
        return resp

    # --- info routes -------------------------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": int(self.started), "owned_by": "kvharness",
             # vLLM's fields: `root` is the weights the name serves (clients such as `vllm bench serve` load its
             # tokenizer from it), `parent` a base model for adapters (none here)
             "root": self.facts.model_dir, "parent": None, "permission": [],
             "max_model_len": self.facts.max_model_len}]})

    def snapshot(self) -> dict:
        st = self.client.stats
        return {"status": "ok" if self.client.healthy else "error", "model": self.model_name,
                "policy": self.facts.policy, "requests": dict(self.counts),
                "running": st.running, "waiting": max(self.in_flight - st.running, 0),
                "max_queue": self.max_queue, "max_body_bytes": self.max_body_bytes, "last_error": st.last_error,
                # in-use counts of both tiers: a leak in either shows from outside as a count that never returns
                "kv": {"device_blocks_free": st.device_blocks_free, "device_blocks_used": st.device_blocks_used,
                       "device_blocks_total": self.facts.device_blocks, "host_blocks_free": st.host_blocks_free,
                       "host_blocks_used": st.host_blocks_used,
                       "host_blocks_total": st.host_blocks_free + st.host_blocks_used},
                # the engine's forwards by kind since it started (pure decode, decode beside a prompt chunk,
                # prompt only): counts, decode rows, wall seconds; a client diffs two snapshots
                "steps": dict(st.steps)}

    async def health(self, request: web.Request) -> web.Response:
        snap = self.snapshot()
        return web.json_response(snap, status=200 if self.client.healthy else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        snap = self.snapshot()
        lines = []
        for key, value in snap["requests"].items():
            lines += [f"# TYPE kvharness_requests_{key}_total counter", f"kvharness_requests_{key}_total {value}"]
        for key in ("running", "waiting"):
            lines += [f"# TYPE kvharness_requests_{key} gauge", f"kvharness_requests_{key} {snap[key]}"]
        for key, value in snap["kv"].items():
            lines += [f"# TYPE kvharness_kv_{key} gauge", f"kvharness_kv_{key} {value}"]
        for key, value in snap["steps"].items():
            name = f"kvharness_engine_{key[:-2] + '_seconds' if key.endswith('_s') else key}_total"
            lines += [f"# TYPE {name} counter", f"{name} {value}"]
        lines.append("# TYPE kvharness_http_responses_total counter")
        lines += [f'kvharness_http_responses_total{{code="{c}"}} {n}' for c, n in sorted(self.http_status.items())]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    # --- generation routes -------------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        """One generation request; whatever happens, exactly one outcome counter moves."""
        arrival = time.perf_counter()
        self.counts["received"] += 1
        outcome = ["aborted"]        # set by _serve as it goes; stays "aborted" if the client leaves (cancelled)
        try:
            return await self._serve(request, chat, arrival, outcome)
        except ConnectionError:      # the client went away mid-write
            outcome[0] = "aborted"
            return web.Response(status=499)
        except Exception:  # noqa: BLE001 - logged; this request alone gets a JSON 500
            log.exception("request failed")
            outcome[0] = "failed"
            return ApiError("internal server error; see the server log", status=500,
                            kind="internal_error").response()
        finally:
            self.counts[outcome[0]] += 1

    def _parse(self, raw: bytes, chat: bool) -> Params:
        return parse_body(api.load_json(raw), chat, self.tokenizer, self.facts, self.model_name, self.max_chars)

    async def _serve(self, request: web.Request, chat: bool, arrival: float, outcome: list[str]
                     ) -> web.StreamResponse:
        try:
            raw = await api.read_body(request, self.max_body_bytes)
            params = await asyncio.get_running_loop().run_in_executor(self.workers, self._parse, raw, chat)
        except ApiError as err:
            outcome[0] = "too_large" if err.status == 413 else "invalid"
            resp = err.response()
            if err.status == 413:
                resp.force_close()      # the rest of the body is never read: the connection cannot be reused
            return resp
        if self.in_flight >= self.capacity:
            outcome[0] = "rejected"
            return ApiError(f"server overloaded: {self.max_queue} requests already wait; retry later",
                            status=503, kind="server_overloaded").response(
                headers={"Retry-After": str(self.retry_after_s)})
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        live = Live(params.request(rid, arrival), top_logprobs=params.logprobs or 0)
        self.in_flight += 1
        self.client.submit(live)
        outcome[0] = "aborted"          # unless the response is written to the end (or the engine fails it)
        try:
            result: tuple[web.StreamResponse, str] = await (
                self._stream(request, live, params, chat) if params.stream else self._collect(live, params, chat))
            outcome[0] = result[1]
            return result[0]
        finally:
            self.in_flight -= 1
            self.client.release(live)

    async def _events(self, live: Live, detok: Detokenizer, choice: ChoiceText | None = None
                      ) -> AsyncIterator[tuple[str, dict[str, list] | None, str | None]]:
        """(text, logprobs or None, finish_reason or None) per engine step; raises ApiError on an engine failure."""
        while True:
            event = await live.events.get()
            if event[0] == "invalid":         # refused by the engine's own checks: it never joined a batch
                live.done = True
                raise ApiError(event[1], param=event[2])
            if event[0] == "error":           # this request's sequence failed; the others went on
                live.done = True
                raise ApiError(f"generation failed: {event[1]}", status=500, kind="internal_error")
            _, ids, engine_finish, entries, prompt = event
            delta = detok.push(ids, final=engine_finish is not None)
            finish = "stop" if detok.stopped else engine_finish
            text, logprobs = (delta, None) if choice is None else await asyncio.get_running_loop().run_in_executor(
                self.workers, choice.chunk, delta, ids, entries, prompt)   # echo + logprobs decode every token
            yield text, logprobs, finish
            if finish is not None:
                live.done = True
                if engine_finish is None:      # a stop string the engine has not acted on yet
                    self.client.abort(live)
                return

    def _usage(self, live: Live, detok: Detokenizer, params: Params) -> dict:
        return api.usage(len(live.request.prompt_token_ids), len(detok.ids) if params.max_tokens else 0)

    def _chunk(self, live: Live, chat: bool, choices: list, use: dict | None = None) -> bytes:
        return api.sse_chunk(live.request.request_id, self.model_name, chat, choices, use)

    async def _stream(self, request: web.Request, live: Live, params: Params, chat: bool
                      ) -> tuple[web.StreamResponse, str]:
        detok = Detokenizer(self.tokenizer, params.stop)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        first = True
        try:
            async for delta, logprobs, finish in self._events(live, detok, params.choice_text(self.tokenizer)):
                if chat:
                    message = {"role": "assistant", "content": delta} if first else {"content": delta}
                    choice = {"index": 0, "delta": message, "logprobs": None, "finish_reason": finish}
                else:
                    choice = {"index": 0, "text": delta, "logprobs": logprobs, "finish_reason": finish}
                first = False
                await resp.write(self._chunk(live, chat, [choice]))
        except ApiError as err:
            await resp.write(b"data: " + json.dumps(err.body()).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            return resp, "invalid" if err.status < 500 else "failed"
        if params.include_usage:
            await resp.write(self._chunk(live, chat, [], self._usage(live, detok, params)))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp, "completed"

    async def _collect(self, live: Live, params: Params, chat: bool) -> tuple[web.Response, str]:
        detok = Detokenizer(self.tokenizer, params.stop)
        parts, scores, finish = [], [], None
        try:
            async for delta, logprobs, reason in self._events(live, detok, params.choice_text(self.tokenizer)):
                parts.append(delta)
                scores += [logprobs] if logprobs is not None else []
                finish = reason       # the last event's reason is the request's
        except ApiError as err:
            return err.response(), "invalid" if err.status < 500 else "failed"
        text = "".join(parts)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                   "finish_reason": finish} if chat else
                  {"index": 0, "text": text, "logprobs": merge_logprobs(scores) if scores else None,
                   "finish_reason": finish})
        return web.json_response({
            "id": live.request.request_id, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": self.model_name, "choices": [choice],
            "usage": self._usage(live, detok, params)}), "completed"


# --- running it ----------------------------------------------------------------------------------------------------
@dataclass
class RunningServer:
    """A server on its own event-loop thread inside this process (tests, notebooks); `close()` stops it."""

    url: str
    server: OpenAIServer
    engine_loop: EngineLoop
    runner: web.AppRunner
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    engine_thread: threading.Thread | None

    def close(self) -> None:
        """End the engine loop after its current step, then HTTP."""
        self.engine_loop.stop_soon()
        if self.engine_thread is not None:
            self.engine_thread.join(timeout=30)
        if not self.thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_in_thread(system: Any, model_name: str, host: str = "127.0.0.1", port: int = 0, max_queue: int = 64,
                    retry_after_s: int = 1, max_body_bytes: int | None = None,
                    engine_thread: bool = True) -> RunningServer:
    """Serve `system` (an EngineSystem) on host:port (0 = a free port) from a background thread; the engine loop gets
    a thread of its own too unless `engine_thread=False` (then the caller runs `running.engine_loop.run()`)."""
    engine_port, facts = QueuePort(), facts_of(system)
    server = OpenAIServer(QueueClient(engine_port, facts.idle), facts, system.tokenizer, model_name,
                          max_queue=max_queue, retry_after_s=retry_after_s, max_body_bytes=max_body_bytes)
    engine_loop = EngineLoop(system.engine, engine_port)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, host, port).start())
    bound_host, bound_port = runner.addresses[0][:2]
    thread = threading.Thread(target=loop.run_forever, name="http-loop", daemon=True)
    thread.start()
    stepper = None
    if engine_thread:
        stepper = threading.Thread(target=engine_loop.run, name="engine-loop", daemon=True)
        stepper.start()
        deadline = time.monotonic() + 30          # healthy once returned: the loop's first send has landed
        while not server.client.healthy and time.monotonic() < deadline:
            time.sleep(0.005)
    return RunningServer(f"http://{bound_host}:{bound_port}", server, engine_loop, runner, loop, thread, stepper)

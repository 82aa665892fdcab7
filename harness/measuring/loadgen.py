"""Arrival processes (Poisson, gamma with burstiness, constant) and a streaming OpenAI-API client that replays them.

Arrivals follow `vllm bench serve`: gaps ~ Gamma(shape=b, scale=1/(rate*b)) drawn from numpy's legacy
RandomState seeded with `seed` (b = 1 is Poisson; b < 1 burstier; constant = 1/rate), cumulated, then rescaled
so the last arrival lands at exactly N/rate (removes the 1-2% seed-to-seed spread of the total). rate = inf
sends everything at t = 0.

The client measures what vLLM's `async_request_openai_completions` measures: `st` just before the POST, TTFT at
the first SSE message carrying `choices`, one ITL gap per later token-carrying message, E2EL at the last one;
the trailing usage message only supplies `completion_tokens` / `prompt_tokens`.
"""
from __future__ import annotations

import asyncio
import codecs
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import aiohttp

from harness.measuring.serving_stats import RequestOutput

PROCESSES = ("poisson", "gamma", "constant")

# uvicorn (vLLM's server) closes a connection idle for 5 s; a request sent on it just then fails with "Server
# disconnected" (seen once at 1 req/s). The client drops a connection idle this long itself, well before any
# server does, so a request's fate never depends on its gap to the previous one.
IDLE_CONNECTION_S = 2.0


def arrival_times(num_requests: int, rate: float, process: str = "poisson", burstiness: float = 1.0,
                  seed: int = 0) -> np.ndarray:
    """Send offsets in seconds from the start of the run, one per request, non-decreasing."""
    if num_requests <= 0:
        raise ValueError(f"num_requests={num_requests} must be positive")
    if not rate > 0:
        raise ValueError(f"request rate {rate} must be positive (req/s; inf = all at once)")
    if process not in PROCESSES:
        raise ValueError(f"arrival process {process!r} unknown; use one of {list(PROCESSES)}")
    if process == "poisson" and burstiness != 1.0:
        raise ValueError(f"process=poisson has burstiness 1, got {burstiness}; use process=gamma for other values")
    if not burstiness > 0:
        raise ValueError(f"burstiness={burstiness} must be positive (1 = Poisson, <1 burstier, >1 more regular)")
    if math.isinf(rate):
        return np.zeros(num_requests)
    if process == "constant" or math.isinf(burstiness):
        gaps = np.full(num_requests, 1.0 / rate)
    else:
        gaps = np.random.RandomState(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness),
                                                 size=num_requests)
    delays = np.cumsum(gaps)
    if delays[-1] > 0:
        delays *= (num_requests / rate) / delays[-1]
    return delays


@dataclass
class Prompt:
    """One request's prompt: token ids (exact length, no re-tokenization drift) or text."""

    prompt: list[int] | str
    prompt_len: int


def _sse_messages(buffer: str) -> tuple[list[str], str]:
    """Complete `data: ...` messages in `buffer` and the unfinished rest."""
    messages = []
    while "\n\n" in buffer:
        message, buffer = buffer.split("\n\n", 1)
        message = message.strip()
        if message:
            messages.append(message)
    return messages, buffer


def _token_text(chunk: dict, chat: bool) -> str:
    choice = chunk["choices"][0]
    if chat:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def stream_request(session: aiohttp.ClientSession, url: str, payload: dict[str, Any], prompt_len: int,
                         chat: bool = False) -> RequestOutput:
    """POST one streamed completion and time it the way vLLM's bench client does."""
    out = RequestOutput(prompt_len=prompt_len)
    decoder = codecs.getincrementaldecoder("utf-8")()
    buffer, text, first = "", [], True
    st = time.perf_counter()
    out.start_time = last = st
    try:
        async with session.post(url, json=payload) as resp:
            out.status = resp.status
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return out
            async for raw in resp.content.iter_any():
                messages, buffer = _sse_messages(buffer + decoder.decode(raw))
                for message in messages:
                    if message.startswith(":"):
                        continue
                    data = message.removeprefix("data: ")
                    if data == "[DONE]":
                        continue
                    chunk = json.loads(data)
                    if chunk.get("choices"):
                        now = time.perf_counter()
                        if first:
                            out.ttft, first = now - st, False
                        else:
                            out.itl.append(now - last)
                        last = now
                        text.append(_token_text(chunk, chat))
                    elif chunk.get("usage"):
                        out.output_tokens = chunk["usage"].get("completion_tokens") or 0
                        if chunk["usage"].get("prompt_tokens") is not None:
                            out.prompt_len = chunk["usage"]["prompt_tokens"]
                    elif chunk.get("error"):
                        out.error = str(chunk["error"])
        out.generated_text = "".join(text)
        out.latency = last - st
        out.success = not first and not out.error
        if first and not out.error:
            out.error = "never received a token-carrying chunk"
    except asyncio.CancelledError:
        out.error = "cancelled at the cell's time limit"
        out.success = False
    except Exception as exc:  # noqa: BLE001 - any transport failure is a failed request, as in vLLM's client
        out.error = f"{type(exc).__name__}: {exc}"
        out.success = False
    return out


def request_payload(model: str, prompt: Prompt, max_tokens: int, chat: bool, temperature: float = 0.0,
                    ignore_eos: bool = True, extra: dict | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": temperature,
                            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    if chat:
        if not isinstance(prompt.prompt, str):
            raise ValueError("the chat endpoint takes text prompts; use endpoint=completions for token ids")
        body["messages"] = [{"role": "user", "content": prompt.prompt}]
    else:
        body["prompt"] = prompt.prompt
    body.update(extra or {})
    return body


async def run_load(base_url: str, model: str, prompts: Sequence[Prompt], arrivals: Sequence[float], *,
                   max_tokens: int, endpoint: str = "completions", temperature: float = 0.0,
                   ignore_eos: bool = True, max_concurrency: int | None = None, max_seconds: float | None = None,
                   extra_body: dict | None = None) -> tuple[list[RequestOutput], float]:
    """Send each prompt at its arrival offset; returns the outputs of the requests sent and the run's duration.

    Past `max_seconds` no new request is sent and those still in flight are cancelled (counted failed).
    """
    import aiohttp

    if len(prompts) != len(arrivals):
        raise ValueError(f"{len(prompts)} prompts but {len(arrivals)} arrival times")
    if endpoint not in ("completions", "chat"):
        raise ValueError(f"endpoint {endpoint!r} unknown; use completions or chat")
    chat = endpoint == "chat"
    url = base_url.rstrip("/") + ("/v1/chat/completions" if chat else "/v1/completions")
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    timeout = aiohttp.ClientTimeout(total=None, sock_read=max_seconds)
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, force_close=False,
                                     keepalive_timeout=IDLE_CONNECTION_S)

    async def one(session: aiohttp.ClientSession, p: Prompt) -> RequestOutput:
        payload = request_payload(model, p, max_tokens, chat, temperature, ignore_eos, extra_body)
        if limit is None:
            return await stream_request(session, url, payload, p.prompt_len, chat)
        async with limit:
            return await stream_request(session, url, payload, p.prompt_len, chat)

    tasks: list[asyncio.Task] = []
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, trust_env=False) as session:
        start = time.perf_counter()
        deadline = start + max_seconds if max_seconds else math.inf
        for p, offset in zip(prompts, arrivals):
            wait = start + offset - time.perf_counter()
            if start + offset > deadline:
                break
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(session, p)))
        remaining = deadline - time.perf_counter()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=None if math.isinf(remaining) else max(remaining, 0))
            for t in pending:
                t.cancel()
        outputs = []
        for t, p in zip(tasks, prompts):
            try:
                outputs.append(await t)
            except asyncio.CancelledError:   # cancelled before it ever ran
                outputs.append(RequestOutput(prompt_len=p.prompt_len, error="cancelled at the cell's time limit"))
        duration = time.perf_counter() - start
    return outputs, duration

"""OpenAI API pieces for systems/openai_server.py: request bodies -> validated parameters, JSON errors, streamed text.

Accepted as in vLLM's server: `prompt` as text, token ids, or a one-element list of either; `max_tokens`
(chat: also `max_completion_tokens`) defaulting to the context left after the prompt; `ignore_eos`;
`stream_options.include_usage`; on completions `logprobs` and `echo` (systems/openai_logprobs.py says what they
return and what prompt log-probabilities mean under a KV policy). Fields a client may send at their neutral value
(n=1, chat's logprobs=false, penalties 0, repetition_penalty 1) are accepted; other values are refused with 400
rather than silently ignored, so a benchmark never measures something other than what it asked for.

Every sampling value is checked before the engine sees it (finite, in range, integers where sizes are meant; `seed`
within int64), so one client's value can never reach a batch it shares with others. `load_json` bounds nesting
(a deep body is a 400, not a RecursionError), and a text prompt longer than the context could hold even at the
vocabulary's longest token is refused by its length alone, before any tokenizing.
"""
from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from systems.base import GenerationRequest
from systems.engine.sampler import SEED_MAX, SEED_MIN
from systems.engine_link import EngineFacts
from systems.openai_logprobs import ChoiceText, LogprobsError, parse_logprobs

MAX_JSON_DEPTH = 32        # the deepest body the API needs is 5 levels (messages -> content parts)
MAX_STOP = 16              # stop strings per request: each is searched for after every token
ROLES = ("system", "user", "assistant", "tool", "developer")
NEUTRAL: dict[str, tuple[Any, ...]] = {
           "n": (1, None), "best_of": (1, None), "echo": (False, None), "logprobs": (None, False, 0),
           "top_logprobs": (None, 0), "presence_penalty": (0, 0.0, None), "frequency_penalty": (0, 0.0, None),
           "repetition_penalty": (1, 1.0, None), "suffix": (None, ""), "tools": (None, []),
           "response_format": (None, {"type": "text"}),
           "prompt_logprobs": (None,)}       # vLLM's own field: echo + logprobs returns the prompt's here
COMPLETIONS_FIELDS = ("echo", "logprobs")    # meaningful on /v1/completions (openai_logprobs), neutral-only on chat


class ApiError(Exception):
    """A request the server refuses; `response()` renders OpenAI's error object."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error",
                 param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.kind, self.param = message, status, kind, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}

    def response(self, headers: dict | None = None) -> web.Response:
        return web.Response(text=json.dumps(self.body()), status=self.status, headers=headers,
                            content_type="application/json")


@dataclass
class Params:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: tuple[str, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    logprobs: int | None = None         # completions: top-N log-probabilities per returned token
    echo: bool = False                  # completions: the prompt comes back in front of the completion
    prompt_text: str = ""               # what echo returns as the prompt's text

    def request(self, request_id: str, arrival: float) -> GenerationRequest:
        """The engine request: echo with max_tokens 0 still makes one token (not returned); `logprobs` keeps each
        generated token's log-probabilities, and with echo the prompt's too."""
        steps = max(self.max_tokens, 1)
        scored = self.logprobs is not None
        return GenerationRequest(
            request_id=request_id, prompt_token_ids=self.prompt_ids, max_new_tokens=steps,
            temperature=self.temperature, top_p=self.top_p, seed=self.seed, ignore_eos=self.ignore_eos,
            stop=self.stop, arrival_time=arrival, logprob_steps=steps if scored and self.max_tokens else 0,
            prompt_logprobs=self.logprobs if scored and self.echo else None)

    def choice_text(self, tokenizer: Any) -> ChoiceText | None:
        """Completions' text and logprobs per chunk when echo or logprobs is asked for (never on chat)."""
        if self.logprobs is None and not self.echo:
            return None
        return ChoiceText(tokenizer, self.logprobs, self.echo, self.max_tokens > 0, self.prompt_ids, self.prompt_text)


def _number(body: dict, key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(f"{key} must be a number, got {value!r}", param=key)
    if not math.isfinite(value):
        raise ApiError(f"{key} must be a finite number, got {value!r}", param=key)
    if value > hi or value < lo or (lo_open and value == lo):
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise ApiError(f"{key}={value} is outside {interval}", param=key)
    return float(value)


def _flag(body: dict, key: str, default: bool = False) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(f"{key} must be true or false, got {value!r}", param=key)
    return value


def _token_ids(value: Any, vocab: int) -> list[int] | None:
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        bad = [t for t in value if not 0 <= t < vocab]
        if bad:
            raise ApiError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="prompt")
        return list(value)
    return None


async def read_body(request: web.Request, max_body_bytes: int) -> bytes:
    """The body, refused with 413 from its Content-Length or as soon as a chunked body passes the limit."""
    declared = request.content_length
    if declared is not None and declared > max_body_bytes:
        raise ApiError(f"the request body has {declared} bytes, more than this server's limit of "
                       f"{max_body_bytes}; shorten the prompt", status=413)
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(f"the request body passed this server's limit of {max_body_bytes} bytes; "
                       "shorten the prompt", status=413) from None


def load_json(raw: bytes) -> Any:
    """The parsed body; ApiError (400) for bad UTF-8, bad JSON, or nesting deeper than MAX_JSON_DEPTH."""
    deep = ApiError(f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels; send a flat OpenAI request")
    try:
        body = json.loads(raw)
    except RecursionError:
        raise deep from None
    except (ValueError, UnicodeDecodeError):
        raise ApiError("the request body is not valid JSON; send a JSON object") from None
    stack = [(body, 1)]
    while stack:       # iterative: the check itself must not recurse
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        if children and depth >= MAX_JSON_DEPTH:
            raise deep
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return body


def _check_chars(n: int, max_chars: int | None, param: str) -> None:
    if max_chars is not None and n > max_chars:
        raise ApiError(f"the prompt has {n} characters, more than this model's context can hold even at its longest "
                       "tokens; shorten the prompt", param=param)


def completion_prompt(body: dict, tokenizer: Any, vocab: int, max_chars: int | None = None) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    ids = _token_ids(prompt, vocab)
    if ids is not None:
        return ids
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError("batched prompts are not supported; send one prompt per request", param="prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ApiError("prompt must be a non-empty string or a list of token ids", param="prompt")
    _check_chars(len(prompt), max_chars, "prompt")
    return tokenizer.encode(prompt, add_special_tokens=True)


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise ApiError(f"messages[{i}].content must be a string or a list of text parts", param="messages")


def chat_prompt(body: dict, tokenizer: Any, max_chars: int | None = None) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list of {role, content} objects", param="messages")
    rendered = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(f"messages[{i}] needs a role in {list(ROLES)}", param="messages")
        rendered.append({"role": m["role"], "content": _content(m, i)})
    _check_chars(sum(len(m["content"]) for m in rendered), max_chars, "messages")
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError("this model's tokenizer has no chat template; use /v1/completions", param="messages")
    # Qwen3's template reads enable_thinking: off, the reply starts with the answer, as the harness's own prompts
    template = tokenizer.chat_template
    thinks = any(isinstance(t, str) and "enable_thinking" in t
                 for t in (template.values() if isinstance(template, dict) else [template]))
    text = tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True,
                                         **({"enable_thinking": False} if thinks else {}))
    return tokenizer.encode(text, add_special_tokens=False)


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ApiError("stop must be a string or a list of strings", param="stop")
    if len(stop) > MAX_STOP:
        raise ApiError(f"stop holds {len(stop)} strings; send at most {MAX_STOP}", param="stop")
    return tuple(s for s in stop if s)


def parse_body(body: Any, chat: bool, tokenizer: Any, facts: EngineFacts, model_name: str,
               max_chars: int | None = None) -> Params:
    """Everything checkable before the engine sees the request; raises ApiError naming the field and the fix. (Whether
    the request alone fits the device tier takes the policy's own rule, so the engine loop checks that.)
    `max_chars`: the longest text prompt worth tokenizing (see max_prompt_chars); None tokenizes any."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_name:
        raise ApiError(f"the model `{model}` does not exist; this server serves `{model_name}`", status=404,
                       kind="NotFoundError", param="model")
    for key, allowed in NEUTRAL.items():
        if key in body and body[key] not in allowed and (chat or key not in COMPLETIONS_FIELDS):
            raise ApiError(f"{key}={body[key]!r} is not supported by this server; drop it", param=key)
    try:
        logprobs = None if chat else parse_logprobs(body)
    except LogprobsError as exc:
        raise ApiError(str(exc), param=exc.param) from None
    echo = not chat and _flag(body, "echo")
    # the cheap checks first: a bad value costs no tokenizing
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not SEED_MIN <= seed <= SEED_MAX):
        raise ApiError(f"seed must be an integer in [-2**63, 2**63 - 1], got {seed!r}", param="seed")
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise ApiError("stream_options needs stream=true and must be an object", param="stream_options")
    include_usage = _flag(options or {}, "include_usage")
    stop, ignore_eos = _stop(body), _flag(body, "ignore_eos")
    vocab = facts.vocab_size
    ids = chat_prompt(body, tokenizer, max_chars) if chat else completion_prompt(body, tokenizer, vocab, max_chars)
    limit = facts.max_model_len
    if len(ids) >= limit:
        raise ApiError(f"the prompt has {len(ids)} tokens; this model's maximum context length is {limit} "
                       "tokens: shorten the prompt", param="messages" if chat else "prompt")
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(key)
    if max_tokens is None:
        max_tokens = limit - len(ids)
    elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < (0 if echo else 1):
        raise ApiError(f"{key} must be an integer >= 1 (0 only with echo=true, to score the prompt), got "
                       f"{max_tokens!r}", param=key)
    if len(ids) + max(max_tokens, 1) > limit:
        raise ApiError(f"this model's maximum context length is {limit} tokens, but {len(ids)} prompt + "
                       f"{max_tokens} completion tokens were requested; lower {key} or shorten the prompt",
                       param=key)
    return Params(prompt_ids=ids, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                  seed=random.getrandbits(31) if seed is None else seed, stop=stop,
                  ignore_eos=ignore_eos, stream=stream, include_usage=include_usage, logprobs=logprobs, echo=echo,
                  prompt_text=_prompt_text(body, ids, tokenizer) if echo else "")


def _prompt_text(body: dict, ids: list[int], tokenizer: Any) -> str:
    """The prompt as echo returns it: the text the client sent, or its token ids decoded."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else tokenizer.decode(ids)


def default_max_body_bytes(max_model_len: int) -> int:
    """A full context as JSON: 128 bytes per token covers escaped text and token-id lists; at least 1 MiB."""
    return max(1 << 20, 128 * max_model_len)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse_chunk(request_id: str, model: str, chat: bool, choices: list, usage: dict | None = None) -> bytes:
    """One server-sent event of a streamed completion (chat or text)."""
    body: dict[str, Any] = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                            "created": int(time.time()), "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"


def max_prompt_chars(tokenizer: Any, max_model_len: int) -> int:
    """Characters beyond which a text prompt cannot fit max_model_len tokens: no token's text is longer than its
    vocabulary string (byte-level BPE: one character per byte; SentencePiece: one per character), doubled for
    normalizers that shorten text."""
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    return 2 * max_model_len * max(longest, 1)


class Detokenizer:
    """Incremental text for streamed token ids (vLLM's prefix/read-offset scheme), cut before stop strings."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...]):
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.prefix = self.read = 0
        self.text = ""            # decoded so far
        self.emitted = 0          # characters already sent
        self.hold = max((len(s) for s in stop), default=1) - 1   # a stop string may still be forming
        self.stopped = False

    def push(self, ids: list[int], final: bool) -> str:
        decode = lambda a, b=None: self.tokenizer.decode(self.ids[a:b], skip_special_tokens=True)  # noqa: E731
        for tok in ids:
            self.ids.append(tok)
            before, after = decode(self.prefix, self.read), decode(self.prefix)
            if len(after) > len(before) and not after.endswith("\ufffd"):
                self.text += after[len(before):]
                self.prefix, self.read = self.read, len(self.ids)
        if final and self.read < len(self.ids):
            self.text += decode(self.prefix)[len(decode(self.prefix, self.read)):]
            self.read = len(self.ids)
        end = len(self.text)
        if self.stop:
            cut = min((i for i in (self.text.find(s) for s in self.stop) if i >= 0), default=-1)
            if cut >= 0:
                end, self.stopped = cut, True
            elif not final:
                end = max(self.emitted, end - self.hold)
        delta = self.text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return delta

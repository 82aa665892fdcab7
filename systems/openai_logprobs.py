"""`logprobs` and `echo` on /v1/completions, shaped as vLLM's server returns them (for lm-eval's local-completions).

- `logprobs: N` (an integer 0..MAX_LOGPROBS, vLLM's default --max-logprobs) returns `choices[0].logprobs` =
  {tokens, token_logprobs, top_logprobs, text_offset}: per token its text, its log-probability, a map of up to N + 1
  token texts to log-probabilities (the token itself and the N most likely ones), and its character offset.
  Log-probabilities are the model's raw ones (log-softmax of the logits, before temperature and top_p), as vLLM's
  default `logprobs_mode`; -inf is sent as -9999.0, as OpenAI does.
- `echo: true` puts the prompt in front of the completion: its text before the generated text and, with `logprobs`,
  its tokens before the generated ones, the first prompt token with a null log-probability and null top map.
  `max_tokens: 0` is allowed with echo (only the prompt comes back, finish_reason "length"): lm-eval scores a
  continuation this way, or with `max_tokens: 1`, dropping the last token.
- Streaming: each chunk carries the log-probabilities of its own tokens; with echo the first chunk also carries the
  prompt's; text_offset counts from the start of everything streamed so far.

What the numbers mean under a KV policy: prompt tokens are scored by the prefill forward, which attends to the whole
prompt before the policy evicts, offloads or selects anything (the engine's prefill is dense for every policy); only
generated tokens are decoded under the policy. So an echo-scored continuation is the dense model's log-likelihood
whatever the policy; to score a continuation under the policy, teacher-force it (the lm-eval adapter,
harness/integrations/lmeval.py, does).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

MAX_LOGPROBS = 20            # vLLM's default --max-logprobs
FLOOR = -9999.0              # what OpenAI and vLLM send for a log-probability of -inf (JSON has no infinity)
# (log p of the token, ids of the N most likely tokens, their log p); None for the first prompt token
Entry = tuple[float, list[int], list[float]] | None


class LogprobsError(ValueError):
    """A bad `logprobs` / `echo` / `max_tokens` combination; `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def parse_logprobs(body: dict) -> int | None:
    """`logprobs` of a completions body: None (absent, null or false) or an integer 0..MAX_LOGPROBS."""
    value = body.get("logprobs")
    if value is None or value is False:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
        raise LogprobsError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (the most likely tokens returned "
                            f"beside each token), got {value!r}", "logprobs")
    return value


def output_entries(rows: list[torch.Tensor], token_logprobs: list[float], top: int) -> list[Entry]:
    """Entries of generated tokens from the engine's full log-probability rows (one row per token, in order)."""
    out: list[Entry] = []
    for row, own in zip(rows, token_logprobs):
        vals, ids = row.topk(top)
        out.append((own, ids.tolist(), vals.tolist()))
    return out


def _floor(value: float) -> float:
    return max(value, FLOOR)


def logprobs_object(tokenizer: Any, ids: list[int], entries: list[Entry], offset: int = 0) -> dict[str, list]:
    """OpenAI's completions `logprobs` object for these tokens; `offset`: characters streamed before them."""
    unique = sorted({*ids, *(t for e in entries if e is not None for t in e[1])})
    text_of = dict(zip(unique, tokenizer.batch_decode([[t] for t in unique])))     # each token decoded once
    texts = [text_of[t] for t in ids]
    tokens: list[str] = []
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    for text, entry in zip(texts, entries):
        tokens.append(text)
        text_offset.append(offset)
        offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        own, top_ids, top_vals = entry
        token_logprobs.append(_floor(own))
        top = {text: _floor(own)}
        for t, lp in zip(top_ids, top_vals):
            top.setdefault(text_of[t], _floor(lp))
        top_logprobs.append(top)
    return {"text_offset": text_offset, "token_logprobs": token_logprobs, "tokens": tokens,
            "top_logprobs": top_logprobs}


def merge(parts: list[dict[str, list]]) -> dict[str, list]:
    """One `logprobs` object from the per-chunk ones (a non-streamed response is the chunks joined)."""
    return {key: [x for part in parts for x in part[key]] for key in
            ("text_offset", "token_logprobs", "tokens", "top_logprobs")}


@dataclass
class ChoiceText:
    """Text and log-probabilities of a completions choice, chunk by chunk, with the echoed prompt in front."""

    tokenizer: Any
    logprobs: int | None
    echo: bool
    generate: bool              # False for echo with max_tokens 0: the one token the engine made is not returned
    prompt_ids: list[int]
    prompt_text: str
    offset: int = 0             # characters sent so far (text_offset of the next token)
    echoed: bool = False

    def chunk(self, delta: str, ids: list[int], entries: list[Entry] | None, prompt: list[Entry] | None
              ) -> tuple[str, dict[str, list] | None]:
        """(text, logprobs object or None) for one engine event: its new tokens, their entries, the prompt's."""
        text, tok_ids, tok_entries = (delta, list(ids), list(entries or [])) if self.generate else ("", [], [])
        if self.echo and not self.echoed:
            self.echoed = True
            text = self.prompt_text + text
            tok_ids = self.prompt_ids + tok_ids
            tok_entries = [None, *(prompt or [])] + tok_entries
        if self.logprobs is None:
            return text, None
        obj = logprobs_object(self.tokenizer, tok_ids, tok_entries, self.offset)
        self.offset += sum(len(t) for t in obj["tokens"])
        return text, obj

"""Next-token choice: greedy, or temperature + top-p with each request's own seeded generator.

Sampling is per row and a row's failure is returned, not raised, so one sequence's bad state (a NaN row, a broken
generator) fails that sequence alone and never the batch it shares a step with. `check_sampling` is the engine's
own gate on the values that could make a row fail, whatever entry point a request came through.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from systems.engine.sequence import Sequence

SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 63 - 1      # int64, as OpenAI's and vLLM's `seed`


def check_sampling(temperature: Any, top_p: Any, seed: Any) -> None:
    """Raise ValueError naming the field when a sampling value could not drive the sampler."""
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name}={value!r} must be a finite number")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 = greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")
    if isinstance(seed, bool) or not isinstance(seed, int) or not SEED_MIN <= seed <= SEED_MAX:
        raise ValueError(f"seed={seed!r} must be an integer in [-2**63, 2**63 - 1]")


def _draw(row: torch.Tensor, seq: Sequence) -> int:
    req = seq.request
    probs = torch.softmax(row.float().cpu() / req.temperature, dim=-1)
    if req.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (the top token always stays)
        drop = sorted_p.cumsum(0) - sorted_p >= req.top_p
        sorted_p[drop] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=seq.generator))


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int | Exception]:
    """logits: [B, V], one row per sequence; a row whose draw failed holds the exception instead of a token."""
    out: list[int | Exception] = list(logits.argmax(dim=-1).tolist())
    for i, seq in enumerate(seqs):
        if seq.request.temperature <= 0:          # greedy (a NaN is not, and fails its own draw)
            continue
        try:
            out[i] = _draw(logits[i], seq)
        except Exception as exc:  # noqa: BLE001 - the row's failure belongs to its sequence alone
            out[i] = exc
    return out

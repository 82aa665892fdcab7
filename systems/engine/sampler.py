"""Next-token choice: greedy, or temperature + top-p with each request's own seeded generator."""
from __future__ import annotations

import torch

from systems.engine.sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """logits: [B, V] fp32, one row per sequence."""
    out = logits.argmax(dim=-1).tolist()
    for i, seq in enumerate(seqs):
        req = seq.request
        if req.temperature <= 0:
            continue
        probs = torch.softmax(logits[i].cpu() / req.temperature, dim=-1)
        if req.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            # keep the smallest prefix whose mass reaches top_p (the top token always stays)
            drop = sorted_p.cumsum(0) - sorted_p >= req.top_p
            sorted_p[drop] = 0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        out[i] = int(torch.multinomial(probs, 1, generator=seq.generator))
    return out

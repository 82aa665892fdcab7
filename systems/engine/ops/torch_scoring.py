"""Quest-style page scores from the MinMax key cache (torch reference, CPU path)."""
from __future__ import annotations

import torch


def page_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, num_pages: torch.Tensor) -> torch.Tensor:
    """Upper bound of q.k over each page, per KV head.

    q: [B, Hq, D]; kmin, kmax: [B, Hkv, M, D]; num_pages: [B, Hkv] int (pages >= num_pages score -inf).
    score[b, g, m] = max over the group's query heads h (h // (Hq//Hkv) == g) of sum_d max(q_d*kmin_d, q_d*kmax_d).
    Returns [B, Hkv, M] fp32. Choosing the always-kept last page is the caller's job.
    """
    B, Hq, D = q.shape
    _, Hkv, M, _ = kmin.shape
    G = Hq // Hkv
    qg = q.float().view(B, Hkv, G, 1, D)
    lo = qg * kmin.float().unsqueeze(2)                                  # [B, Hkv, G, M, D]
    hi = qg * kmax.float().unsqueeze(2)
    scores = torch.maximum(lo, hi).sum(-1).amax(dim=2)                  # [B, Hkv, M]
    beyond = torch.arange(M, device=q.device).view(1, 1, M) >= num_pages.view(B, Hkv, 1)
    return scores.masked_fill(beyond, float("-inf"))

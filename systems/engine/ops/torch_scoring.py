"""Quest-style page scores from the MinMax key cache (torch reference, CPU path)."""
from __future__ import annotations

import torch


def page_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, num_pages: torch.Tensor,
                rows: torch.Tensor | None = None, heads: torch.Tensor | None = None) -> torch.Tensor:
    """Upper bound of q.k over each page, per KV head.

    kmin, kmax: [S, Hkv', M, D] (any strides; typically one layer's MinMax cache, kv.kmin[:, layer, :, :M]);
    rows [B] / heads [H]: which S-rows and KV heads to score (None: all, in order); q: [B, H*G, D], the queries of
    those heads' groups; num_pages: [B, H] int (pages >= num_pages score -inf).
    score[b, h, m] = max over head h's G query rows of sum_d max(q_d*kmin_d, q_d*kmax_d).
    Returns [B, H, M] fp32. Choosing the always-kept last page is the caller's job.
    """
    if rows is not None:
        kmin, kmax = kmin[rows], kmax[rows]
    if heads is not None:
        kmin, kmax = kmin[:, heads], kmax[:, heads]
    B, Hq, D = q.shape
    _, Hkv, M, _ = kmin.shape
    G = Hq // Hkv
    qg = q.float().view(B, Hkv, G, 1, D)
    lo = qg * kmin.float().unsqueeze(2)                                  # [B, Hkv, G, M, D]
    hi = qg * kmax.float().unsqueeze(2)
    scores = torch.maximum(lo, hi).sum(-1).amax(dim=2)                  # [B, Hkv, M]
    beyond = torch.arange(M, device=q.device).view(1, 1, M) >= num_pages.view(B, Hkv, 1)
    return scores.masked_fill(beyond, float("-inf"))

"""Quest-style page scores and top-K page sets from the MinMax key cache (torch reference, every device)."""
from __future__ import annotations

from collections.abc import Callable

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


PAD = -1


def topk_pages(scores: torch.Tensor, num_pages: torch.Tensor, k: int, keep_last: bool) -> torch.Tensor:
    """Each row's page set from its scores [B, H, M] (-inf beyond num_pages [B, H] >= 1).

    keep_last: the last page (num_pages - 1) plus the k - 1 best others, all pages when num_pages <= k; otherwise the
    k best among every page but the last (FlexiCache's candidates). Returns [B, H, min(k, M)] int64 in any order,
    padded with PAD.
    """
    M = scores.shape[-1]
    last = (num_pages.long() - 1).clamp(min=0).unsqueeze(-1)
    forced = scores.scatter(-1, last, float("inf") if keep_last else float("-inf"))
    top = forced.topk(min(k, M), dim=-1, sorted=False)
    return torch.where(torch.isneginf(top.values), PAD, top.indices)


def ranked_pages(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, num_pages: torch.Tensor,
                 rows: torch.Tensor | None, heads: torch.Tensor | None, k: torch.Tensor,
                 scorer: Callable[..., torch.Tensor] = page_scores) -> torch.Tensor:
    """The k[b] best pages of every listed head of row b by page_scores (`scorer`), the last page competing like
    any other: [B, H, min(max k, M)] int64, best first, ties to the lower page (a stable sort, so a row's pages
    never depend on the rest of its batch), PAD past k[b] and past a head's pages."""
    return rank_scores(scorer(q, kmin, kmax, num_pages, rows, heads), k)


def rank_scores(scores: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """ranked_pages' choice from scores [B, H, M] (-inf beyond a head's pages) and k [B] >= 1."""
    width = min(int(k.max()), scores.shape[-1])
    values, index = scores.sort(dim=-1, descending=True, stable=True)
    values, index = values[..., :width], index[..., :width]
    beyond = torch.arange(width, device=scores.device).view(1, 1, width) >= k.view(-1, 1, 1).to(scores.device)
    return torch.where(beyond | torch.isneginf(values), PAD, index)


def top_pages(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, num_tokens: torch.Tensor, page_size: int,
              k: int, keep_last: bool, rows: torch.Tensor | None = None, heads: torch.Tensor | None = None,
              scorer: Callable[..., torch.Tensor] = page_scores) -> torch.Tensor:
    """page_scores (by `scorer`, the device's kernel) then topk_pages: [B, H, min(k, M)] int64, PAD-padded.

    num_tokens: [S, Hkv'] tokens each head holds, indexed by rows and heads like kmin/kmax (one layer's slice of the
    cache's token counts); a head's pages are ceil(tokens / page_size), at most M.
    """
    n = num_tokens if rows is None else num_tokens[rows]
    n = n if heads is None else n[:, heads]
    num_pages = ((n.long() + page_size - 1) // page_size).clamp(max=kmin.shape[2])
    return topk_pages(scorer(q, kmin, kmax, num_pages, rows, heads), num_pages, k, keep_last)


def resident_pages(table: torch.Tensor, num_pages: torch.Tensor) -> torch.Tensor:
    """The device-resident logical pages of each row: table [B, H, W] block ids (0 = not resident), num_pages
    [B, H] (pages from num_pages on are ignored). Returns [B, H, max(1, longest list)] int64, ascending, PAD-padded."""
    W = table.shape[-1]
    mask = (table != 0) & (torch.arange(W, device=table.device) < num_pages.unsqueeze(-1))
    rank = mask.long().cumsum(-1)                         # a resident page's 1-based place in its row
    width = max(int(rank[..., -1].max()) if mask.numel() else 0, 1)
    out = torch.full((*mask.shape[:-1], width + 1), PAD, dtype=torch.long, device=table.device)
    # each resident page to its place, every other page to the spare last column (no sort: O(W) per row)
    out.scatter_(-1, torch.where(mask, rank - 1, width), torch.arange(W, device=table.device).expand_as(mask))
    return out[..., :width]

"""Shared kernels of the retrieval policies: MinMax page scores, top-K page sets, swap maps, RCO / temporal stability.

Torch on every device (the selection work is a few small matmuls per layer; the engine's attention ops are the heavy
part). Page sets travel as padded index tensors [..., K] with entries < 0 as padding, the engine's `select_pages`
format.
"""
from __future__ import annotations

import random

import numpy as np
import torch

PAD = -1


def page_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, num_pages: torch.Tensor) -> torch.Tensor:
    """Quest's upper bound of q.k over each page, max over each KV head's query group.

    q [B, Hq, D]; kmin, kmax [B, Hkv, M, D]; num_pages [B, Hkv] (pages >= num_pages score -inf). Returns [B, Hkv, M]
    fp32. sum_d max(q_d kmin_d, q_d kmax_d) = q+ . kmax + q- . kmin (q+ / q- the positive / negative parts), so the
    bound is two batched matmuls and never materializes [B, Hkv, G, M, D].
    """
    B, Hq, D = q.shape
    Hkv, M = kmin.shape[1], kmin.shape[2]
    qg = q.float().view(B, Hkv, Hq // Hkv, D)
    pos, neg = qg.clamp(min=0), qg.clamp(max=0)
    scores = (pos @ kmax.float().transpose(-1, -2) + neg @ kmin.float().transpose(-1, -2)).amax(dim=2)
    beyond = torch.arange(M, device=q.device).view(1, 1, M) >= num_pages.view(B, Hkv, 1)
    return scores.masked_fill(beyond, float("-inf"))


def group_queries(q: torch.Tensor, num_kv_heads: int, heads: torch.Tensor) -> torch.Tensor:
    """The query rows of the given KV heads' groups: q [B, Hq, D] -> [B, len(heads) * G, D]."""
    B, Hq, D = q.shape
    return q.view(B, num_kv_heads, Hq // num_kv_heads, D)[:, heads].reshape(B, -1, D)


def pages_of(num_tokens: torch.Tensor, page_size: int) -> torch.Tensor:
    """Pages a head's tokens span (the last may be partial)."""
    return (num_tokens.long() + page_size - 1) // page_size


def topk_with_last(scores: torch.Tensor, num_pages: torch.Tensor, k: int) -> torch.Tensor:
    """Per row, the last page (num_pages - 1) plus the k - 1 best-scoring other pages; all pages when num_pages <= k.

    For scores a policy computed itself (LServe's physical pages); MinMax bounds go through kv.top_pages, the
    engine's fused op with this contract. scores [B, H, M] (-inf beyond num_pages), num_pages [B, H] >= 1. Returns
    [B, H, min(k, M)] int64 in any order, rows with fewer pages padded with PAD.
    """
    last = (num_pages.long() - 1).clamp(min=0).unsqueeze(-1)
    top = scores.scatter(-1, last, float("inf")).topk(min(k, scores.shape[-1]), dim=-1, sorted=False)
    return torch.where(torch.isneginf(top.values), PAD, top.indices)


def compact(mask: torch.Tensor) -> torch.Tensor:
    """Indices of the True entries of each row of mask [..., M], ascending, padded with PAD to the longest row."""
    M = mask.shape[-1]
    rank = mask.long().cumsum(-1)                         # a True entry's 1-based place in its row
    width = max(int(rank[..., -1].max()) if mask.numel() else 0, 1)
    out = torch.full((*mask.shape[:-1], width + 1), PAD, dtype=torch.long, device=mask.device)
    idx = torch.arange(M, device=mask.device).expand_as(mask)
    # scatter each True entry to its place, every False one to the spare last column (no sort: O(M) per row)
    out.scatter_(-1, torch.where(mask, rank - 1, width), idx)
    return out[..., :width]


def as_mask(pages: torch.Tensor, M: int) -> torch.Tensor:
    """Padded page sets [..., K] -> membership masks [..., M]."""
    mask = torch.zeros((*pages.shape[:-1], M + 1), dtype=torch.bool, device=pages.device)
    mask.scatter_(-1, torch.where(pages < 0, M, pages.long()), True)
    return mask[..., :M]


def merge(a: torch.Tensor, b: torch.Tensor, M: int) -> torch.Tensor:
    """Union of two padded page-set tensors with the same leading dims, ascending and padded."""
    return compact(as_mask(a, M) | as_mask(b, M))


def swap_map(resident: torch.Tensor, selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FlexiCache's rerank swap map over membership masks [..., M]: incoming = selected - resident (to promote),
    evicted = resident - selected (their device blocks are recycled for the incoming pages or freed)."""
    return selected & ~resident, resident & ~selected


def pair_for_recycling(incoming: torch.Tensor, evicted: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Match each incoming page with an evicted page of the same row (block recycling).

    incoming, evicted: masks [R, M] with incoming.sum(-1) <= evicted.sum(-1) per row. Returns (row, page, recycle)
    of the matched pairs and (row, page) of the evicted pages left over (to free).
    """
    n_in = incoming.sum(-1, keepdim=True)
    rank_ev = evicted.long().cumsum(-1) - 1
    if bool((n_in.squeeze(-1) > evicted.sum(-1)).any()):
        raise ValueError("pair_for_recycling: a row has more incoming pages than evicted ones")
    in_row, in_page = incoming.nonzero(as_tuple=True)
    ev_take = evicted & (rank_ev < n_in)
    ev_row, ev_page = ev_take.nonzero(as_tuple=True)
    # nonzero lists row-major, and both sides keep page order within a row, so the k-th incoming of a row meets the
    # k-th evicted of that row
    left = evicted & (rank_ev >= n_in)
    left_row, left_page = left.nonzero(as_tuple=True)
    return in_row, in_page, ev_page, left_row, left_page


# ---- stability statistics (FlexiCache §12.1) -------------------------------------------------------------------

def overlap(a: torch.Tensor, b: torch.Tensor, M: int) -> torch.Tensor:
    """|A ∩ B| of padded page sets [..., K] over pages < M."""
    return (as_mask(a, M) & as_mask(b, M)).sum(-1)


def rco(inter: torch.Tensor, k: int, num_pages: torch.Tensor) -> torch.Tensor:
    """Random-corrected overlap max(0, (|S_s ∩ S_t|/K - K/N_t) / (1 - K/N_t)); NaN where N_t <= K (undefined)."""
    chance = k / num_pages.double()
    value = ((inter.double() / k - chance) / (1 - chance)).clamp(min=0)
    return torch.where(num_pages > k, value, torch.nan)


def temporal_stability(trace: torch.Tensor, num_pages: torch.Tensor, k: int, window: int = 16) -> torch.Tensor:
    """TS of each head in each non-overlapping window: mean of RCO(S_s, S_{s+d}) for d = 1 .. W-1.

    trace [T, H, K] page sets per decode step and head (padded), num_pages [T] (N_t at each step). Returns
    [T // W, H] fp32; a window with any step where N_t <= K is NaN. The arithmetic is FlexiCache's analysis step for
    step (fp32, a [H, W-1] RCO row per window, mean over the row), so 1 - TS is bit for bit its instability score and
    ties between heads fall as they fall there.
    """
    T, H, _ = trace.shape
    C = T // window
    if C == 0:
        return torch.empty((0, H), dtype=torch.float32)
    M = int(num_pages.max())
    sets = as_mask(trace[:C * window], M).view(C, window, H, M)
    inter = (sets[:, :1] & sets[:, 1:]).sum(-1, dtype=torch.int32).to(torch.float32)        # [C, W-1, H]
    inter = inter.transpose(1, 2).contiguous()                                               # [C, H, W-1]
    n = num_pages[:C * window].view(C, window)
    chance = float(k) / n[:, 1:].to(torch.float32).unsqueeze(1)                              # [C, 1, W-1]
    ts = ((inter / float(k) - chance) / (1.0 - chance)).clamp(min=0.0).mean(-1)
    return torch.where((n > k).all(-1, keepdim=True), ts, torch.nan)


def bottom_sets(ts: torch.Tensor, count: int) -> torch.Tensor:
    """Per window, membership [C, H] of the `count` least stable heads: torch.topk of the instability 1 - TS, as the
    official analysis takes them (so ties resolve as there)."""
    chosen = torch.topk(1.0 - ts, k=count, dim=1, largest=True, sorted=False).indices
    return torch.zeros_like(ts, dtype=torch.bool).scatter_(1, chosen, True)


def _complete(ts: torch.Tensor) -> torch.Tensor:
    return ts[~torch.isnan(ts).any(-1)]


def unstable_by_frequency(ts: torch.Tensor, count: int) -> tuple[list[int], torch.Tensor]:
    """The `count` heads most often among a window's `count` least stable, ranked by np.argsort of the negated
    frequencies (the official ranking, ties included). Windows with NaN are skipped. Returns (the heads ascending by
    index, the per-head frequency [H])."""
    valid = _complete(ts)
    if valid.shape[0] == 0:
        raise ValueError("no complete stability window: decode longer (>= W steps) with more pages than K")
    freq = bottom_sets(valid, count).sum(0)
    ranking = np.argsort(-freq.numpy().astype(np.int64))
    return sorted(int(h) for h in ranking[:count]), freq


def consensus_split(ts: torch.Tensor, count: int, seed: int = 43) -> tuple[list[int], float, float]:
    """FlexiCache's final unstable set (TopK-Analysis/analyze_head_stability.py): shuffle the windows with Python's
    `random` seeded 43, take the `count` heads most often in a window's bottom set on the first half, and measure
    their recall of each window's bottom set on the second half. The shuffle is the official one for a profile made
    from this task alone (the first shuffle after seeding). Returns (heads ascending, recall, random baseline
    count / heads)."""
    valid = _complete(ts)
    baseline = count / ts.shape[1]
    if valid.shape[0] < 2:
        raise ValueError("need at least two complete stability windows: decode longer (>= 2 W steps) or profile "
                         "more samples")
    order = list(range(valid.shape[0]))
    random.Random(seed).shuffle(order)
    half = len(order) // 2
    chosen, _ = unstable_by_frequency(valid[order[:half]], count)
    held_out = bottom_sets(valid[order[half:]], count)
    recalls = [int(row[chosen].sum()) / count for row in held_out]
    return chosen, float(np.mean(recalls)), baseline

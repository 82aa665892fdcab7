"""Triton twin of torch_scoring.page_scores: Quest upper bounds from the MinMax cache, max over the GQA group.

One program per (sequence, KV head, block of pages) loads the group's queries once and streams the pages' min/max
key vectors. The output is [B, Hkv, M] fp32, contiguous in pages, with -inf past num_pages: the layout
torch.topk(scores, K, dim=-1) consumes directly (padding pages can never be chosen over real ones).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from systems.engine.ops.triton_common import available, pow2

__all__ = ["available", "page_scores"]

_PAGES_PER_PROGRAM = 32


@triton.jit
def _page_scores_kernel(q, kmin, kmax, num_pages, rows, heads, out, M,
                        s_qb, s_qh, s_qd, s_lb, s_lh, s_lm, s_ld, s_hb, s_hh, s_hm, s_hd, s_nb, s_nh,
                        s_ob, s_oh, s_om,
                        G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                        BLOCK_M: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    m_ok = m < M
    r = tl.load(rows + b).to(tl.int64)                                  # the MinMax row and head this program reads
    kh = tl.load(heads + h).to(tl.int64)
    qg = tl.load(q + b * s_qb + (h * G + g)[:, None] * s_qh + d[None, :] * s_qd,
                 mask=(g < G)[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    tile = m_ok[:, None] & d_ok[None, :]
    lo = tl.load(kmin + r * s_lb + kh * s_lh + m[:, None] * s_lm + d[None, :] * s_ld, mask=tile, other=0.0)
    hi = tl.load(kmax + r * s_hb + kh * s_hh + m[:, None] * s_hm + d[None, :] * s_hd, mask=tile, other=0.0)
    q3 = qg[:, None, :]
    bound = tl.maximum(q3 * lo.to(tl.float32)[None, :, :], q3 * hi.to(tl.float32)[None, :, :])
    per_head = tl.sum(bound, axis=2)                                     # [G_PAD, BLOCK_M]
    per_head = tl.where((g < G)[:, None], per_head, float("-inf"))
    score = tl.max(per_head, axis=0)
    n_pages = tl.load(num_pages + b * s_nb + h * s_nh)
    score = tl.where(m < n_pages, score, float("-inf"))
    tl.store(out + b * s_ob + h * s_oh + m * s_om, score, mask=m_ok)


def page_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, num_pages: torch.Tensor,
                rows: torch.Tensor | None = None, heads: torch.Tensor | None = None) -> torch.Tensor:
    """Upper bound of q.k over each page, per KV head (see torch_scoring.page_scores: kmin/kmax [S, Hkv', M, D]
    read in place through rows [B] and heads [H]). Returns [B, H, M] fp32, -inf past num_pages.
    """
    B, Hq, D = q.shape
    M = kmin.shape[2]
    rows = torch.arange(kmin.shape[0], device=q.device) if rows is None else rows.to(q.device)
    heads = torch.arange(kmin.shape[1], device=q.device) if heads is None else heads.to(q.device)
    Hkv = heads.numel()
    if Hq % Hkv:
        raise ValueError(f"query heads {Hq} must be a multiple of KV heads {Hkv}")
    out = torch.empty(B, Hkv, M, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    block_m = min(_PAGES_PER_PROGRAM, pow2(M, 2))
    _page_scores_kernel[(B, Hkv, triton.cdiv(M, block_m))](
        q, kmin, kmax, num_pages, rows, heads, out, M, *q.stride(), *kmin.stride(), *kmax.stride(), *num_pages.stride(),
        *out.stride(), G=Hq // Hkv, G_PAD=pow2(Hq // Hkv, 2), D=D, D_PAD=pow2(D), BLOCK_M=block_m)
    return out

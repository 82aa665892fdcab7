"""Triton paged decode attention (split-K flash-decoding), dense over a block table and sparse over selected pages.

One program per (sequence, KV head, split): it loads the whole GQA group's queries, walks its share of the head's
pages a few at a time (K/V read once per group, never expanded), keeps an online softmax in fp32 (q.k and p.v on
tensor cores in the cache dtype with fp32 accumulation, as the reference's matmuls), and either writes the output
(one split) or a partial (max, sum, accumulator) that a second kernel merges across splits.

Two entry points:
- `paged_decode_attention`: the twin of torch_attention.paged_decode_attention (same signature, same semantics);
  with the table from torch_attention.gather_selected it is the reference sparse path.
- `sparse_decode_attention`: takes the policy's selected logical pages [B, Hkv, K] (padding < 0, any order) and
  the head's full block table directly, so no gathered table is built (no sort, no gather): each program reads
  block_table[b, h, page] for its selected pages only and masks the partial last page by the head's num_tokens.
  Online softmax makes the page order irrelevant. Its reference is gather_selected + paged_decode_attention.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from systems.engine.ops.triton_common import available, device_index, interpreting, num_programs_target, pow2

__all__ = ["available", "paged_decode_attention", "sparse_decode_attention"]

_TOKENS_PER_ITER = 64       # keys each loop step loads: several pages at once keeps the loads wide


@triton.jit
def _split_kernel(q, k_pool, v_pool, table, ntok, sel, out, part_acc, part_ml,
                  s_qb, s_qh, s_qd, s_kb, s_kp, s_kd, s_vb, s_vp, s_vd, s_tb, s_th, s_tm, s_nb, s_nh,
                  s_sb, s_sh, s_sk, s_ob, s_oh, s_od, s_ab, s_ah, s_as, s_mb, s_mh, s_ms,
                  n_list, pages_per_split, scale_log2, window,
                  G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, P: tl.constexpr,
                  PAGES_PER_ITER: tl.constexpr, SPARSE: tl.constexpr, ONE_SPLIT: tl.constexpr,
                  DOT_F32: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    n_tok = tl.load(ntok + b * s_nb + h * s_nh)
    first_tok = tl.where(window > 0, tl.maximum(n_tok - window, 0), 0)     # sliding window: earlier keys masked
    if SPARSE:
        list_len = n_list
    else:
        list_len = tl.minimum(tl.cdiv(n_tok, P), n_list)
    start = split * pages_per_split
    end = tl.minimum(start + pages_per_split, list_len)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    heads = h * G + g
    q_mask = (g < G)[:, None] & d_ok[None, :]
    qg = tl.load(q + b * s_qb + heads[:, None] * s_qh + d[None, :] * s_qd, mask=q_mask, other=0.0)
    if DOT_F32:
        qg = qg.to(tl.float32)
    else:
        qg = qg.to(k_pool.dtype.element_ty)                     # as the reference: q in the cache dtype

    tok = tl.arange(0, PAGES_PER_ITER * P)
    in_page = tok % P
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for first in range(start, end, PAGES_PER_ITER):
        idx = first + tok // P                                   # position in the page list
        listed = idx < end
        if SPARSE:
            page = tl.load(sel + b * s_sb + h * s_sh + idx * s_sk, mask=listed, other=-1).to(tl.int32)
            listed = listed & (page >= 0)
            page = tl.where(listed, page, 0)
        else:
            page = idx
        blk = tl.load(table + b * s_tb + h * s_th + page * s_tm, mask=listed, other=0).to(tl.int64)
        valid = listed & (page * P + in_page < n_tok) & (page * P + in_page >= first_tok)
        kv_mask = valid[:, None] & d_ok[None, :]
        keys = tl.load(k_pool + blk[:, None] * s_kb + in_page[:, None] * s_kp + d[None, :] * s_kd,
                       mask=kv_mask, other=0.0)
        vals = tl.load(v_pool + blk[:, None] * s_vb + in_page[:, None] * s_vp + d[None, :] * s_vd,
                       mask=kv_mask, other=0.0)
        if DOT_F32:
            logits = tl.dot(qg, tl.trans(keys.to(tl.float32)), input_precision="ieee")
        else:
            logits = tl.dot(qg, tl.trans(keys))                  # tensor cores, fp32 accumulation
        logits = logits * scale_log2                             # [G_PAD, N], log2 domain
        logits = tl.where(valid[None, :], logits, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)   # a step with no valid key must not make NaNs
        alpha = tl.exp2(m_i - m_ref)
        probs = tl.exp2(logits - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(probs, axis=1)
        if DOT_F32:
            pv = tl.dot(probs, vals.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(probs.to(v_pool.dtype.element_ty), vals)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if ONE_SPLIT:
        res = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out + b * s_ob + heads[:, None] * s_oh + d[None, :] * s_od, res.to(out.dtype.element_ty),
                 mask=q_mask)
    else:
        tl.store(part_acc + b * s_ab + heads[:, None] * s_ah + split * s_as + d[None, :], acc, mask=q_mask)
        ml = part_ml + b * s_mb + heads * s_mh + split * s_ms
        tl.store(ml, m_i, mask=g < G)
        tl.store(ml + 1, l_i, mask=g < G)


@triton.jit
def _merge_kernel(out, part_acc, part_ml, num_splits, s_ob, s_oh, s_od, s_ab, s_ah, s_as, s_mb, s_mh, s_ms,
                  D: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr):
    b = tl.program_id(0)
    hq = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    s_ok = s < num_splits
    ml = part_ml + b * s_mb + hq * s_mh + s * s_ms
    m = tl.load(ml, mask=s_ok, other=float("-inf"))
    denom = tl.load(ml + 1, mask=s_ok, other=0.0)
    m_all = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_all))
    acc = tl.load(part_acc + b * s_ab + hq * s_ah + s[:, None] * s_as + d[None, :],
                  mask=s_ok[:, None] & (d < D)[None, :], other=0.0)
    total = tl.sum(denom * w, axis=0)
    res = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)   # a head with no key reads zeros
    tl.store(out + b * s_ob + hq * s_oh + d * s_od, res.to(out.dtype.element_ty), mask=d < D)


def _dot_in_fp32(dtype: torch.dtype) -> bool:
    """fp32 pools multiply in IEEE fp32; bf16/fp16 pools on tensor cores with fp32 accumulation, like the reference's
    matmuls in the cache dtype. The interpreter cannot multiply bf16 (it sees raw bits), so there bf16 goes fp32; the
    fp16 tests run the tensor-core branch."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting())


def _pages_per_split(n_list: int, programs: int, pages_per_iter: int, device: int) -> int:
    """Split the page list so B*Hkv*splits programs fill the GPU; each split a whole number of loop steps."""
    steps = triton.cdiv(n_list, pages_per_iter)
    splits = max(1, min(steps, triton.cdiv(num_programs_target(device), programs)))
    return triton.cdiv(steps, splits) * pages_per_iter


def _decode(q, k_pool, v_pool, table, num_tokens, selected, scale, window=None, pages_per_split=None):
    """Both entry points; `selected` None = dense over the table. pages_per_split (tests) overrides the heuristic."""
    B, Hq, D = q.shape
    _, Hkv, _ = table.shape
    P = k_pool.shape[1]
    if Hq % Hkv:
        raise ValueError(f"query heads {Hq} must be a multiple of KV heads {Hkv}")
    sparse = selected is not None
    lst = selected if sparse else table
    n_list = lst.shape[-1]
    pages_per_iter = max(1, _TOKENS_PER_ITER // P)
    if pages_per_split is None:
        pages_per_split = _pages_per_split(n_list, B * Hkv, pages_per_iter, device_index(q))
    num_splits = max(1, triton.cdiv(n_list, pages_per_split))
    out = torch.empty_like(q)
    if num_splits == 1:
        part_acc = part_ml = out                                  # unused by the one-split kernel
        acc_strides: tuple[int, ...] = (0, 0, 0)
        ml_strides: tuple[int, ...] = (0, 0, 0)
    else:
        part_acc = torch.empty(B, Hq, num_splits, D, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(B, Hq, num_splits, 2, dtype=torch.float32, device=q.device)
        acc_strides, ml_strides = part_acc.stride()[:3], part_ml.stride()[:3]
    sel_strides = selected.stride() if sparse else (0, 0, 0)
    _split_kernel[(B, Hkv, num_splits)](
        q, k_pool, v_pool, table, num_tokens, selected if sparse else table, out, part_acc, part_ml,
        *q.stride(), *k_pool.stride(), *v_pool.stride(), *table.stride(), *num_tokens.stride(), *sel_strides,
        *out.stride(), *acc_strides, *ml_strides, n_list, pages_per_split, scale * math.log2(math.e), window or 0,
        G=Hq // Hkv, G_PAD=pow2(Hq // Hkv, 16), D=D, D_PAD=pow2(D, 16), P=P, PAGES_PER_ITER=pages_per_iter,
        SPARSE=sparse, ONE_SPLIT=num_splits == 1, DOT_F32=_dot_in_fp32(k_pool.dtype))
    if num_splits > 1:
        _merge_kernel[(B, Hq)](out, part_acc, part_ml, num_splits, *out.stride(), *acc_strides, *ml_strides,
                               D=D, D_PAD=pow2(D), S_PAD=pow2(num_splits, 2))
    return out


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
                           num_tokens: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
    """One decode query per sequence over the pages listed for each KV head (see torch_attention).

    q: [B, Hq, D]; pools [num_blocks, P, D]; block_table [B, Hkv, M] int; num_tokens [B, Hkv] int (>= 1).
    Returns [B, Hq, D] in q's dtype; logits, softmax and accumulation in fp32. `window`: see torch_attention.
    """
    return _decode(q, k_pool, v_pool, block_table, num_tokens, None, scale, window)


def sparse_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
                            num_tokens: torch.Tensor, selected_pages: torch.Tensor, scale: float,
                            window: int | None = None) -> torch.Tensor:
    """Decode attention over only the selected logical pages of each KV head, reading no other page.

    block_table [B, Hkv, M] (logical page -> device block, every selected page resident); num_tokens [B, Hkv] the
    tokens each head holds (masks its partial last page); selected_pages [B, Hkv, K] int logical pages, < 0 is
    padding, no duplicates, >= 1 real page per row, any order. Equals
    paged_decode_attention(q, k_pool, v_pool, *gather_selected(block_table, num_tokens, selected_pages, P), scale).
    """
    return _decode(q, k_pool, v_pool, block_table, num_tokens, selected_pages, scale, window)

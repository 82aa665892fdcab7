"""Triton twins of torch_kv: KV store into head-pages, the incremental MinMax update, and per-page min/max keys.

Same signatures and semantics as systems/engine/ops/torch_kv.py (the reference); the engine picks these on CUDA.
Comparisons run in fp32 (exact for bf16/fp16 inputs) so the result is bit-identical to the reference's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from systems.engine.ops.triton_common import available, pow2

__all__ = ["available", "store_kv", "update_minmax", "page_minmax"]

_ROWS = 16          # tokens (or MinMax rows) per program


@triton.jit
def _store_kv_kernel(k_pool, v_pool, k, v, block_ids, offsets, T,
                     s_kpb, s_kpp, s_kpd, s_vpb, s_vpp, s_vpd, s_kt, s_kd, s_vt, s_vd,
                     D: tl.constexpr, D_PAD: tl.constexpr, ROWS: tl.constexpr):
    t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, D_PAD)
    row_ok = t < T
    mask = row_ok[:, None] & (d < D)[None, :]
    blk = tl.load(block_ids + t, mask=row_ok, other=0).to(tl.int64)
    off = tl.load(offsets + t, mask=row_ok, other=0).to(tl.int64)
    kk = tl.load(k + t[:, None] * s_kt + d[None, :] * s_kd, mask=mask)
    vv = tl.load(v + t[:, None] * s_vt + d[None, :] * s_vd, mask=mask)
    tl.store(k_pool + blk[:, None] * s_kpb + off[:, None] * s_kpp + d[None, :] * s_kpd,
             kk.to(k_pool.dtype.element_ty), mask=mask)
    tl.store(v_pool + blk[:, None] * s_vpb + off[:, None] * s_vpp + d[None, :] * s_vpd,
             vv.to(v_pool.dtype.element_ty), mask=mask)


def store_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             block_ids: torch.Tensor, offsets: torch.Tensor) -> None:
    """In place: k_pool[block_ids[i], offsets[i]] = k[i] and the same for v (see torch_kv.store_kv)."""
    T, D = k.shape
    if T == 0:
        return
    _store_kv_kernel[(triton.cdiv(T, _ROWS),)](
        k_pool, v_pool, k, v, block_ids.contiguous(), offsets.contiguous(), T,
        *k_pool.stride(), *v_pool.stride(), *k.stride(), *v.stride(),
        D=D, D_PAD=pow2(D), ROWS=_ROWS)


@triton.jit
def _update_minmax_kernel(kmin, kmax, k, rows, first, N, s_mr, s_md, s_xr, s_xd, s_kt, s_kd,
                          D: tl.constexpr, D_PAD: tl.constexpr, ROWS: tl.constexpr):
    i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, D_PAD)
    ok = i < N
    mask = ok[:, None] & (d < D)[None, :]
    r = tl.load(rows + i, mask=ok, other=0).to(tl.int64)
    fresh = tl.load(first + i, mask=ok, other=0) != 0
    # cast the key to the cache dtype first (as the reference does), then compare exactly in fp32
    key = tl.load(k + i[:, None] * s_kt + d[None, :] * s_kd, mask=mask, other=0.0)
    key = key.to(kmin.dtype.element_ty).to(tl.float32)
    lo_ptr = kmin + r[:, None] * s_mr + d[None, :] * s_md
    hi_ptr = kmax + r[:, None] * s_xr + d[None, :] * s_xd
    lo = tl.load(lo_ptr, mask=mask, other=0.0).to(tl.float32)
    hi = tl.load(hi_ptr, mask=mask, other=0.0).to(tl.float32)
    lo = tl.where(fresh[:, None], key, tl.minimum(lo, key))
    hi = tl.where(fresh[:, None], key, tl.maximum(hi, key))
    tl.store(lo_ptr, lo.to(kmin.dtype.element_ty), mask=mask)
    tl.store(hi_ptr, hi.to(kmax.dtype.element_ty), mask=mask)


def update_minmax(kmin: torch.Tensor, kmax: torch.Tensor, k: torch.Tensor, rows: torch.Tensor,
                  first: torch.Tensor) -> None:
    """In place, one appended key per row: MinMax of rows[i] absorbs k[i], or restarts at k[i] when first[i]."""
    N, D = k.shape
    if N == 0:
        return
    _update_minmax_kernel[(triton.cdiv(N, _ROWS),)](
        kmin, kmax, k, rows.contiguous(), first.contiguous().to(torch.uint8), N,
        *kmin.stride(), *kmax.stride(), *k.stride(), D=D, D_PAD=pow2(D), ROWS=_ROWS)


@triton.jit
def _page_minmax_kernel(k_pool, block_ids, n_tokens, out_min, out_max, s_kb, s_kp, s_kd, s_on, s_od,
                        D: tl.constexpr, D_PAD: tl.constexpr, P: tl.constexpr, P_PAD: tl.constexpr):
    i = tl.program_id(0)
    blk = tl.load(block_ids + i).to(tl.int64)
    n = tl.load(n_tokens + i)
    p = tl.arange(0, P_PAD)
    d = tl.arange(0, D_PAD)
    valid = (p < n)[:, None] & (d < D)[None, :]
    keys = tl.load(k_pool + blk * s_kb + p[:, None] * s_kp + d[None, :] * s_kd, mask=valid, other=0.0)
    keys = keys.to(tl.float32)
    lo = tl.min(tl.where(valid, keys, float("inf")), axis=0)
    hi = tl.max(tl.where(valid, keys, float("-inf")), axis=0)
    tl.store(out_min + i * s_on + d * s_od, lo.to(out_min.dtype.element_ty), mask=d < D)
    tl.store(out_max + i * s_on + d * s_od, hi.to(out_max.dtype.element_ty), mask=d < D)


def page_minmax(k_pool: torch.Tensor, block_ids: torch.Tensor, n_tokens: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Elementwise min and max key of each listed page over its first n_tokens[i] (>= 1) slots, in the pool dtype."""
    N = block_ids.numel()
    _, P, D = k_pool.shape
    lo = torch.empty(N, D, dtype=k_pool.dtype, device=k_pool.device)
    hi = torch.empty_like(lo)
    if N:
        _page_minmax_kernel[(N,)](k_pool, block_ids.contiguous(), n_tokens.contiguous(), lo, hi,
                                  *k_pool.stride(), *lo.stride(), D=D, D_PAD=pow2(D), P=P, P_PAD=pow2(P))
    return lo, hi

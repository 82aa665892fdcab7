"""Writing keys/values into head-pages and keeping the per-page MinMax key bounds (torch reference, CPU path).

Storage layout shared by every op: a pool is a tensor [num_blocks, page_size, head_dim]; one block holds one page
of one (layer, KV head) of one sequence. Block 0 is the null block (never written with live data).
"""
from __future__ import annotations

import torch


def store_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             block_ids: torch.Tensor, offsets: torch.Tensor) -> None:
    """In place: k_pool[block_ids[i], offsets[i]] = k[i] and the same for v.

    k_pool, v_pool: [num_blocks, P, D]; k, v: [T, D] (any float dtype, cast to the pool's);
    block_ids, offsets: [T] integer tensors, (block, offset) pairs unique within one call.
    """
    P, D = k_pool.shape[1], k_pool.shape[2]
    flat = block_ids.long() * P + offsets.long()     # index_copy_ on the flat slot view is far faster than index_put
    k_pool.view(-1, D).index_copy_(0, flat, k.to(k_pool.dtype))
    v_pool.view(-1, D).index_copy_(0, flat, v.to(v_pool.dtype))


def update_minmax(kmin: torch.Tensor, kmax: torch.Tensor, k: torch.Tensor, rows: torch.Tensor,
                  first: torch.Tensor) -> None:
    """In place, one appended key per row: kmin[rows[i]] = min(kmin[rows[i]], k[i]) (max likewise), or = k[i] when
    first[i] (the key is the first token of a fresh page, so the old bounds are stale).

    kmin, kmax: [R, D] (a flattened view of the MinMax cache, one row per logical page of one (seq, layer, KV head));
    k: [N, D]; rows: [N] int, unique within one call; first: [N] bool.
    """
    r = rows.long()
    kk = k.to(kmin.dtype)
    f = first.view(-1, 1)
    kmin.index_copy_(0, r, torch.where(f, kk, torch.minimum(kmin.index_select(0, r), kk)))
    kmax.index_copy_(0, r, torch.where(f, kk, torch.maximum(kmax.index_select(0, r), kk)))


def page_minmax(k_pool: torch.Tensor, block_ids: torch.Tensor, n_tokens: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Elementwise min and max key of each listed page over its first n_tokens[i] (>= 1) slots.

    k_pool: [num_blocks, P, D]; block_ids, n_tokens: [N] int. Returns (kmin, kmax), each [N, D] in the pool dtype.
    """
    pages = k_pool.index_select(0, block_ids.reshape(-1).long())        # [N, P, D]
    valid = (torch.arange(pages.shape[1], device=pages.device)[None, :] < n_tokens.view(-1, 1))[..., None]
    big = torch.finfo(pages.dtype).max
    kmin = torch.where(valid, pages, big).amin(dim=1)
    kmax = torch.where(valid, pages, -big).amax(dim=1)
    return kmin, kmax


def store_prompt(k_pool: torch.Tensor, v_pool: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor,
                 table: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
    """In place: a prompt chunk's k, v [n, H, D] (positions start .. start+n-1 of one (sequence, layer)) written
    into its heads' pages, and the MinMax bounds kmin, kmax [H, M, D] of every page the chunk touched recomputed
    over the tokens each now holds. table: [H, >= pages through the chunk's end] device blocks, all resident."""
    n, H, D = k.shape
    P = k_pool.shape[1]
    ids = table.long()
    tok = torch.arange(start, start + n, device=k.device)
    store_kv(k_pool, v_pool, k.transpose(0, 1).reshape(H * n, D), v.transpose(0, 1).reshape(H * n, D),
             ids[:, tok // P].reshape(-1), (tok % P).repeat(H))
    first, end = start // P, -(-(start + n) // P)
    pages = torch.arange(first, end, device=k.device)
    fill = (start + n - pages * P).clamp(max=P).repeat(H)
    lo, hi = page_minmax(k_pool, ids[:, first:end].reshape(-1), fill)
    kmin[:, first:end] = lo.view(H, end - first, D)
    kmax[:, first:end] = hi.view(H, end - first, D)


def append_decode(k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor, num_tokens: torch.Tensor,
                  kmin: torch.Tensor, kmax: torch.Tensor, slots: torch.Tensor, layer: int, k: torch.Tensor,
                  v: torch.Tensor) -> None:
    """In place: one decode token's k, v [B, Hkv, D] per sequence appended to each head's last page of `layer`
    (block_table [S, L, Hkv, M], its next page already holding a block), MinMax kept exact, num_tokens [S, L, Hkv]
    counted; kmin, kmax [S, L, Hkv, M, D]."""
    B, H, D = k.shape
    P, M, L = k_pool.shape[1], block_table.shape[3], block_table.shape[1]
    cnt = num_tokens[slots, layer].long()                                   # [B, H]
    page, off = cnt // P, cnt % P
    blk = block_table[slots, layer].gather(-1, page.unsqueeze(-1)).squeeze(-1)
    kf = k.reshape(B * H, D)
    store_kv(k_pool, v_pool, kf, v.reshape(B * H, D), blk.reshape(-1), off.reshape(-1))
    heads = torch.arange(H, device=k.device).view(1, H)
    rows = (((slots.view(B, 1) * L + layer) * H + heads) * M + page).reshape(-1)
    update_minmax(kmin.view(-1, D), kmax.view(-1, D), kf, rows, (off == 0).reshape(-1))
    num_tokens[slots, layer] += 1

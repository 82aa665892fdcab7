"""Attention (torch reference): causal prompt attention, and paged decode attention over per-(sequence, KV head)
block tables, dense and sparse top-K; each optionally restricted to a sliding window.

`window` = W (None: unbounded) lets a query see the W most recent keys, itself included, as HF's sliding-window
layers do: the prompt query at position i reads keys i-W+1 .. i, a decode query over n tokens reads n-W .. n-1.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     window: int | None = None) -> torch.Tensor:
    """Causal attention of a prompt chunk's queries to the prompt so far.

    q: [T, Hq, D], the queries of positions S-T .. S-1; k, v: [S, Hkv, D], positions 0 .. S-1. Query head h reads KV
    head h // (Hq // Hkv). Returns [T, Hq, D] in q's dtype.
    """
    T, S = q.shape[0], k.shape[0]
    mask, causal = None, True
    if S != T or (window is not None and window < S):   # a later chunk (the diagonal sits S - T to the right) or a
        pos = torch.arange(S, device=q.device)             # window that hides early keys: an explicit mask
        rows = pos[S - T:].view(-1, 1)
        mask, causal = pos.view(1, -1) <= rows, False
        if window is not None:
            mask &= pos.view(1, -1) > rows - window
    group = q.shape[1] // k.shape[1]
    if mask is not None and q.is_cuda and group > 1:
        # CUDA's masked SDPA kernels take no GQA broadcast (it would fall back to the math kernel)
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    qi, ki, vi = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    # enable_gqa lets SDPA broadcast KV heads over their query group without a stored copy
    return F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, is_causal=causal, scale=scale,
                                          enable_gqa=k.shape[1] != q.shape[1])[0].transpose(0, 1)


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
                           num_tokens: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
    """One decode query per sequence attending to the pages listed for each of its KV heads.

    q: [B, Hq, D]; k_pool, v_pool: [num_blocks, P, D]; block_table: [B, Hkv, M] int32 device block ids, the tokens
    laid out in order through the listed pages, only the last listed page may be partial; num_tokens: [B, Hkv] int32,
    how many tokens of the listed pages are valid (page j holds min(P, num_tokens - j*P)), >= 1 for every row.
    Query head h reads KV head h // (Hq // Hkv) (GQA stays grouped: K/V are never expanded in storage).
    Returns [B, Hq, D] in q's dtype; logits and softmax in fp32.
    """
    skip = None if window is None else (num_tokens.long() - window).clamp(min=0)
    return _listed_attention(q, k_pool, v_pool, block_table, num_tokens, scale, skip)


def _listed_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
                      num_tokens: torch.Tensor, scale: float, skip: torch.Tensor | None) -> torch.Tensor:
    """paged_decode_attention's body; `skip` [B, Hkv] (or None) masks that many leading listed tokens per row."""
    B, Hq, D = q.shape
    _, Hkv, M = block_table.shape
    P = k_pool.shape[1]
    G = Hq // Hkv
    ids = block_table.reshape(-1).long()
    k = k_pool.index_select(0, ids).view(B, Hkv, M * P, D)             # reads only the listed pages
    v = v_pool.index_select(0, ids).view(B, Hkv, M * P, D)
    qg = q.view(B, Hkv, G, D).to(k.dtype)
    logits = torch.matmul(qg, k.transpose(-1, -2)).float() * scale      # [B, Hkv, G, M*P]
    slot = torch.arange(M * P, device=q.device).view(1, 1, 1, -1)
    invalid = slot >= num_tokens.view(B, Hkv, 1, 1)
    if skip is not None:
        invalid |= slot < skip.view(B, Hkv, 1, 1)
    logits.masked_fill_(invalid, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    out = torch.matmul(probs.to(v.dtype), v)                            # [B, Hkv, G, D]
    return out.reshape(B, Hq, D).to(q.dtype)


def gather_selected(block_table: torch.Tensor, num_tokens: torch.Tensor, selected_pages: torch.Tensor,
                    page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block table and token counts that list only the selected pages, ready for paged_decode_attention.

    block_table: [B, Hkv, M] int32 (logical page -> device block); num_tokens: [B, Hkv] tokens the head holds;
    selected_pages: [B, Hkv, K] integer logical page indices, entries < 0 are padding; no duplicates in a row.
    The head's partial last page (index (num_tokens - 1) // P when num_tokens % P != 0) may be among the selected;
    pages are reordered ascending so it is listed last. Every row must select at least one page.
    Returns (table [B, Hkv, K] int32 with padding slots = 0, counts [B, Hkv] int32 valid tokens in that listing).
    """
    sel = selected_pages.long()
    pad = sel < 0
    order_key = torch.where(pad, torch.iinfo(torch.int64).max, sel)
    sel_sorted, _ = torch.sort(order_key, dim=-1)
    pad_sorted = sel_sorted == torch.iinfo(torch.int64).max
    idx = torch.where(pad_sorted, 0, sel_sorted)
    table = torch.gather(block_table.long(), -1, idx)
    table = torch.where(pad_sorted, 0, table).to(torch.int32)
    n_sel = (~pad_sorted).sum(-1)                                        # [B, Hkv]
    last_page = (num_tokens.long() - 1) // page_size
    last_fill = num_tokens.long() - last_page * page_size                # tokens in the head's last page
    last_listed = torch.gather(sel_sorted, -1, (n_sel - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1)
    counts = n_sel * page_size - torch.where(last_listed == last_page, page_size - last_fill, 0)
    return table, counts.to(torch.int32)


def sparse_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
                            num_tokens: torch.Tensor, selected_pages: torch.Tensor, scale: float,
                            window: int | None = None) -> torch.Tensor:
    """Decode attention over only the selected logical pages [B, Hkv, K] of each KV head (padding < 0, any order):
    gather_selected then paged_decode_attention, so unselected pages are never read. With a window, pages wholly
    before it are dropped and the tokens before it on the page it starts in are masked (at least one selected page
    must reach into the window)."""
    P = k_pool.shape[1]
    skip = None
    if window is not None:
        first = (num_tokens.long() - window).clamp(min=0)                       # [B, Hkv] first visible token
        sel = selected_pages.long()
        selected_pages = torch.where((sel >= 0) & ((sel + 1) * P <= first.unsqueeze(-1)), -1, sel)
        lowest = torch.where(selected_pages >= 0, selected_pages, torch.iinfo(torch.int64).max).min(-1).values
        skip = torch.where(lowest == first // P, first % P, 0)                  # listed first after the sort
    table, counts = gather_selected(block_table, num_tokens, selected_pages, P)
    return _listed_attention(q, k_pool, v_pool, table, counts, scale, skip)


def token_probs(q: torch.Tensor, k_pool: torch.Tensor, tables: torch.Tensor, counts: torch.Tensor, scale: float,
                width: int) -> torch.Tensor:
    """Each row's decode query's attention over every token its KV heads hold, in storage order (the scores of a
    decode-time eviction): q [R, Hq, D]; tables [R, Hkv, M] int32 blocks, every listed page resident; counts
    [R, Hkv] -> fp32 [R, Hq, width], 0 past a head's count. Query head h reads KV head h // (Hq // Hkv)."""
    r, hq, d = q.shape
    hkv, m = tables.shape[1], tables.shape[2]
    P = k_pool.shape[1]
    k = k_pool.index_select(0, tables.reshape(-1).long()).view(r, hkv, m * P, d)
    out = q.new_zeros(r, hq, width, dtype=torch.float32)
    # one row at a time, each over its own stored length: a batched matmul and softmax over the batch's padded
    # width round differently as the batch changes, and a near-tie between eviction candidates would then be
    # decided by which other requests share the step (decoding must not depend on batch composition)
    for i in range(r):
        n = int(counts[i].max())
        if n == 0:
            continue
        logits = q[i].float().view(hkv, hq // hkv, d) @ k[i, :, :n].float().transpose(-1, -2) * scale  # [Hkv, G, n]
        pad = torch.arange(n, device=k.device).view(1, 1, n) >= counts[i].view(hkv, 1, 1)
        out[i, :, :n] = logits.masked_fill(pad, float("-inf")).softmax(-1).view(hq, n)
    return out


def pooled_victims(probs: torch.Tensor, counts: torch.Tensor, key: torch.Tensor, window: int, kernel: int,
                   pooling: str, new_keys: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A decode-time eviction by attention pooled along an order (CAKE's): per (row, KV head), its tokens ranked by
    `key` ascending (stable; padding last), its query group's `probs` [R, Hq, N] taken in that rank order, the last
    `window` ranks and the padding zeroed, pooled along the ranks (stride 1, padding kernel // 2: `avgpool` counting
    the zeros, `maxpool`, or `none`) and averaged over the group. The victim is the first lowest score among the
    ranks below count - window (each row needs at least one). counts [R, Hkv] int, key [R, Hkv, N] fp32. Returns
    the victims' storage indices [R, Hkv] int64 and, with new_keys, each token's next key [R, Hkv, N]: its place in
    a stable descending order of the pooled scores, the window keeping its rank (padding slots get their rank in the
    stable key order; a caller reads none of them)."""
    b, hkv = counts.shape
    n, g = probs.shape[-1], probs.shape[1] // hkv
    counts = counts.long()
    if window < 0 or bool((counts - window < 1).any()):
        raise ValueError("pooled_victims: every head needs a token outside its window (window >= 0)")
    ranks = torch.arange(n, device=probs.device)
    valid = ranks.view(1, 1, n) < counts.view(b, hkv, 1)
    order = key.masked_fill(~valid, float("inf")).argsort(dim=-1, stable=True)   # storage index of each rank
    ranked = probs.view(b, hkv, g, n).gather(-1, order.unsqueeze(2).expand(b, hkv, g, n))
    outside = ranks.view(1, 1, n) >= (counts - window).view(b, hkv, 1)
    ranked = ranked.masked_fill(outside.unsqueeze(2), 0.0)               # window and padding stay out of the pool
    if pooling != "none" and kernel > 1:
        flat = ranked.reshape(-1, 1, n)
        pool = torch.nn.functional.avg_pool1d if pooling == "avgpool" else torch.nn.functional.max_pool1d
        ranked = pool(flat, kernel_size=kernel, padding=kernel // 2, stride=1)[..., :n].reshape(b, hkv, g, n)
    score = ranked.mean(2)
    victim = score.masked_fill(outside, float("inf")).argmin(-1)            # [R, Hkv], a rank
    index = order.gather(-1, victim.unsqueeze(-1)).squeeze(-1)
    if not new_keys:
        return index, None
    desc = score.masked_fill(outside, float("-inf")).argsort(dim=-1, descending=True, stable=True)
    every = ranks.expand(b, hkv, n)
    rank_key = torch.where(outside, every, torch.empty_like(desc).scatter_(-1, desc, every))
    return index, torch.empty_like(key).scatter_(-1, order, rank_key.to(key.dtype))


def layer_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
                           num_tokens: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, slots: torch.Tensor,
                           layer: int, selected: torch.Tensor | None, scale: float,
                           window: int | None = None) -> torch.Tensor:
    """A decode step's attention at one layer read from the engine's storage: q [B, Hq, D] of the sequences in
    `slots` over every page each head holds (block_table [S, L, Hkv, M], num_tokens [S, L, Hkv]), or only the
    `selected` pages [B, Hkv or Hq, K] (per query head: each reads its KV head's pages). kmin, kmax (the MinMax
    cache) are not read here; the fused op's storage carries them. Returns [B, Hq, D] in q's dtype."""
    counts = num_tokens[slots, layer]
    if selected is None:
        table = block_table[slots, layer, :, :-(-int(counts.max()) // k_pool.shape[1])]
        return paged_decode_attention(q, k_pool, v_pool, table, counts, scale, window=window)
    table = block_table[slots, layer]
    if selected.shape[1] != table.shape[1]:
        # per-query-head page sets: each query head gets its KV head's table row and reads only its own pages
        # (a group of one), from the same grouped K/V pools
        group = selected.shape[1] // table.shape[1]
        table, counts = table.repeat_interleave(group, 1), counts.repeat_interleave(group, 1)
    return sparse_decode_attention(q, k_pool, v_pool, table, counts, selected, scale, window=window)

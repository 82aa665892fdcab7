"""Attention of tokens appended to a compressed cache: a query-agnostic question (or a reader's tokens after a
shared prefix) prefilled in one chunk onto what each KV head still holds.

After compression the heads of one layer hold different numbers of tokens, some of their pages may sit on the host
only (released from the device), and the kept tokens' positions are no longer contiguous. So the chunk's rows cannot
use the prompt kernel: each row attends, per KV head, to every token the head holds on the device (storage order)
up to and including its own appended key — kvpress's question pass over the pruned cache. Pages not resident are
not read (a policy that offloaded them decided what the question sees, exactly as a decode step would). A sliding
window counts storage rows, as the decode kernels do. GQA stays grouped: a query group reads its KV head's pages
once, K/V are never expanded per query head.
"""
from __future__ import annotations

import torch

from systems.engine.kv_cache import TieredKVCache


def appended_attention(q: torch.Tensor, kv: TieredKVCache, slot: int, layer: int,
                       window: int | None = None) -> torch.Tensor:
    """q: [n, Hq, D], the queries of the last n tokens stored in (slot, layer) (already appended to every head).
    Returns [n, Hq, D] in q's dtype; logits and softmax in fp32."""
    n, hq, d = q.shape
    P = kv.page_size
    counts = kv.num_tokens[slot, layer].long()                              # [H], the appended rows included
    heads = counts.numel()
    pages = -(-int(counts.max()) // P)
    table = kv.block_table[slot, layer, :, :pages]                          # [H, M]
    ids = table.reshape(-1).long()
    k = kv.k_pool.index_select(0, ids).view(heads, pages * P, d)
    v = kv.v_pool.index_select(0, ids).view(heads, pages * P, d)
    group = hq // heads
    qg = q.view(n, heads, group, d).permute(1, 2, 0, 3).reshape(heads, group * n, d).to(k.dtype)
    logits = torch.matmul(qg, k.transpose(1, 2)).float() * kv.scale          # [H, G*n, M*P]
    row = (torch.arange(group * n, device=q.device) % n).view(1, -1, 1)       # the query's place in the chunk
    key = torch.arange(pages * P, device=q.device).view(1, 1, -1)
    own = (counts - n).view(-1, 1, 1) + row                                   # storage index of the query's key
    visible = (key <= own) & (table != 0).repeat_interleave(P, dim=1).unsqueeze(1)
    if window is not None:
        visible &= key > own - window
    probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
    out = torch.matmul(probs.to(v.dtype), v)                                  # [H, G*n, D]
    return out.view(heads, group, n, d).permute(2, 0, 1, 3).reshape(n, hq, d).to(q.dtype)

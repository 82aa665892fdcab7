"""Token eviction scores (SnapKV, CAKE and variants, H2O, TOVA) and the ledger of per-token state beside the cache.

GQA group aggregation lives here too; the ledger keeps original positions and running scores in step with the KV
view's keep/drop moves.

Scores are computed in fp32 from post-RoPE q [n, Hq, D] and k [n, Hkv, D]; K is never expanded to query heads: the
query heads are viewed as [Hkv, G] and each group attends to its own KV head. Per-query-head scores are pooled (as the
official codes pool per head) and then reduced over the GQA group with a named aggregation (mean | max | sum).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

AGGREGATIONS = ("mean", "max", "sum")
POOLINGS = ("avgpool", "maxpool", "none")
# CAKE's indicator (mean + gamma * var) and its T3 ablation variants, plus SnapKV's window sum
WINDOW_INDICATORS = ("mean_plus_var", "mean", "var", "mean_times_var", "sum")


def check_choice(name: str, value: str, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ValueError(f"{name}={value!r} is not supported; use one of {list(options)}")


def group_reduce(x: torch.Tensor, num_kv_heads: int, how: str) -> torch.Tensor:
    """[Hq, ...] per query head -> [Hkv, ...] per KV head (query head h belongs to KV head h // G)."""
    g = x.reshape(num_kv_heads, x.shape[0] // num_kv_heads, *x.shape[1:])
    if how == "mean":
        return g.mean(1)
    if how == "max":
        return g.amax(1)
    if how == "sum":
        return g.sum(1)
    raise ValueError(f"aggregation={how!r} is not supported; use one of {list(AGGREGATIONS)}")


def pool1d(x: torch.Tensor, kernel: int, kind: str) -> torch.Tensor:
    """1-D pooling over the last (key) axis, stride 1, padding kernel // 2 (zeros counted for avg, as F.avg_pool1d)."""
    if kind == "none" or kernel <= 1:
        return x
    shape = x.shape
    flat = x.reshape(-1, 1, shape[-1])
    if kind == "avgpool":
        out = F.avg_pool1d(flat, kernel_size=kernel, padding=kernel // 2, stride=1)
    elif kind == "maxpool":
        out = F.max_pool1d(flat, kernel_size=kernel, padding=kernel // 2, stride=1)
    else:
        raise ValueError(f"pooling={kind!r} is not supported; use one of {list(POOLINGS)}")
    return out[..., :shape[-1]].reshape(shape)


def _grouped_logits(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """q [m, Hq, D], k [n, Hkv, D] -> logits [Hq, m, n] with each query group against its own KV head."""
    m, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.float().permute(1, 0, 2).reshape(hkv, hq // hkv * m, d)
    logits = qg @ k.float().permute(1, 2, 0) * scale                    # [Hkv, G*m, n]
    return logits.reshape(hq, m, -1)


def window_attention(q: torch.Tensor, k: torch.Tensor, window: int, scale: float) -> torch.Tensor:
    """Softmax attention of the last `window` queries over all n keys, causal inside the window: [Hq, window, n]."""
    n = k.shape[0]
    window = min(window, n)
    logits = _grouped_logits(q[n - window:], k, scale)
    qpos = torch.arange(n - window, n, device=k.device).view(-1, 1)
    logits = logits.masked_fill(torch.arange(n, device=k.device).view(1, -1) > qpos, float("-inf"))
    return logits.softmax(-1)


GQA_POOLS = ("pool_then_group", "group_then_pool")


def window_indicator(attn: torch.Tensor, num_kv_heads: int, kind: str = "mean_plus_var", gamma: float = 200.0,
                     kernel: int = 5, pooling: str = "avgpool", aggregation: str = "mean",
                     gqa_pool: str = "pool_then_group") -> torch.Tensor:
    """Per-KV-head scores [Hkv, n - S_w] of the prefix keys from window attention [Hq, S_w, n]: reduce over the window
    queries (`kind`), drop the window's own columns, then pool per query head and aggregate over the GQA group
    (`pool_then_group`, the order of codes that pool each query head), or aggregate first and pool the KV head's
    scores (`group_then_pool`, KVCache-Factory's per-KV-head mode); with max pooling the two differ.

    kinds: mean_plus_var = mean + gamma * var (CAKE, gamma 200); mean; var; mean_times_var = mean * var (CAKE T3);
    sum (SnapKV: the window queries' attention summed). Variance is unbiased across the window queries, as torch.var.
    """
    w = attn.shape[1]
    if kind == "sum":
        s = attn.sum(1)
    else:
        mean = attn.mean(1)
        var = attn.var(1) if w > 1 else torch.zeros_like(mean)
        if kind == "mean_plus_var":
            s = mean + gamma * var
        elif kind == "mean":
            s = mean
        elif kind == "var":
            s = var
        elif kind == "mean_times_var":
            s = mean * var
        else:
            raise ValueError(f"indicator={kind!r} is not supported; use one of {list(WINDOW_INDICATORS)}")
    s = s[:, :attn.shape[2] - w]
    if gqa_pool == "group_then_pool":
        return pool1d(group_reduce(s, num_kv_heads, aggregation), kernel, pooling)
    check_choice("gqa_pool", gqa_pool, GQA_POOLS)
    return group_reduce(pool1d(s, kernel, pooling), num_kv_heads, aggregation)


def accumulated_attention(q: torch.Tensor, k: torch.Tensor, scale: float, aggregation: str = "mean",
                          chunk: int = 256) -> torch.Tensor:
    """H2O's score: attention each key receives summed over all (causal) prompt queries, per KV head [Hkv, n].
    Queries run in chunks so the [Hq, chunk, n] probabilities bound the memory."""
    n, hkv = k.shape[0], k.shape[1]
    total = torch.zeros(q.shape[1], n, dtype=torch.float32, device=k.device)
    keys = torch.arange(n, device=k.device).view(1, -1)
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        logits = _grouped_logits(q[start:stop], k, scale)
        mask = keys > torch.arange(start, stop, device=k.device).view(-1, 1)
        total += logits.masked_fill(mask, float("-inf")).softmax(-1).sum(1)
    return group_reduce(total, hkv, aggregation)


def last_query_attention(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """TOVA's score: the last query's attention over all n keys, averaged over every query head: [n]."""
    return _grouped_logits(q[-1:], k, scale)[:, 0].softmax(-1).mean(0)


def stored_keys(kv: Any, slots: torch.Tensor, layer: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, counts) exactly as kv.gather_tokens returns them (k [B, Hkv, N, D] in storage order, padding past counts
    [B, Hkv] zeroed), without gathering the values: a decode-time eviction score reads keys only, and it runs per
    layer per step. `layer` may give each row its own layer ([B], a deferred eviction's rows)."""
    counts = kv.num_tokens[slots, layer]
    n = int(counts.max())
    pages = -(-n // kv.page_size)
    ids = kv.block_table[slots, layer, :, :pages].reshape(-1).long()
    b, hkv = counts.shape
    k = kv.k_pool.index_select(0, ids).view(b, hkv, pages * kv.page_size, kv.head_dim)[:, :, :n]
    pad = torch.arange(n, device=k.device).view(1, 1, n) >= counts.view(b, hkv, 1)
    return k.masked_fill(pad.unsqueeze(-1), 0), counts.long()


def appended_attention(q: torch.Tensor, k: torch.Tensor, counts: torch.Tensor, scale: float) -> torch.Tensor:
    """The attention of n tokens appended last to every head (a query-agnostic question, see
    Policy.after_extend_layer) over the head's stored tokens, causal among themselves: q [n, Hq, D], k [Hkv, N, D]
    (storage order, the appended rows last, padded past counts [Hkv]) -> probabilities [Hq, n, N], 0 on padding."""
    n, hq, d = q.shape
    hkv, width = k.shape[0], k.shape[1]
    logits = (q.float().view(n, hkv, hq // hkv, d).permute(1, 2, 0, 3) @ k.float().transpose(-1, -2)) * scale
    own = counts.long().view(hkv, 1, 1, 1) - n + torch.arange(n, device=q.device).view(1, 1, n, 1)
    hidden = torch.arange(width, device=q.device).view(1, 1, 1, width) > own                # [Hkv, G, n, N]
    return logits.masked_fill(hidden, float("-inf")).softmax(-1).reshape(hq, n, width)


def top_keep(scores: torch.Tensor, budget: int, window: int, n: int) -> list[torch.Tensor]:
    """Per head: the `budget` best of the prefix scores [H, n - window] plus the last `window` positions, ascending."""
    budget = max(0, min(budget, n - window))
    top = scores.topk(budget, dim=-1).indices if budget > 0 else scores.new_zeros(scores.shape[0], 0).long()
    recent = torch.arange(n - window, n, device=scores.device).expand(scores.shape[0], window)
    return list(torch.cat([top, recent], dim=-1).sort(dim=-1).values.unbind(0))


class TokenLedger:
    """Original position (and optionally a running score) of every stored token, per (slot, layer, KV head), in the
    KV view's storage order, for decode-time eviction: policies `set` a layer once its prefill eviction is done, then
    `append` each decode token and evict through `drop`, which calls the view and mirrors its move. The token axis
    grows on demand (doubling), so the ledger is sized by the most tokens any head holds after prefill eviction, not
    by the prompt or the model's context."""

    def __init__(self, max_seqs: int, num_layers: int, num_kv_heads: int, device: torch.device,
                 with_scores: bool = False, capacity: int = 256):
        shape = (max_seqs, num_layers, num_kv_heads, capacity)
        self.pos = torch.zeros(shape, dtype=torch.int32, device=device)
        self.score = torch.zeros(shape, dtype=torch.float32, device=device) if with_scores else None
        self.count = torch.zeros(shape[:3], dtype=torch.int64, device=device)

    def _ensure(self, tokens: int) -> None:
        cap = self.pos.shape[-1]
        if tokens <= cap:
            return
        grow = max(tokens, 2 * cap) - cap
        self.pos = torch.nn.functional.pad(self.pos, (0, grow))
        if self.score is not None:
            self.score = torch.nn.functional.pad(self.score, (0, grow))

    @property
    def scores(self) -> torch.Tensor:
        """The running scores [slots, layers, Hkv, capacity] of a ledger made with_scores."""
        if self.score is None:
            raise RuntimeError("this ledger was made without scores (with_scores=False)")
        return self.score

    def reset(self, slot: int) -> None:
        self.count[slot] = 0

    def set(self, slot: int, layer: int, pos: torch.Tensor, score: torch.Tensor | None = None) -> None:
        """The layer's tokens after prefill (and its eviction): positions [Hkv, m] in storage order, score [Hkv, m]."""
        m = pos.shape[-1]
        self._ensure(m)
        self.pos[slot, layer, :, :m] = pos.to(self.pos)
        if self.score is not None:
            assert score is not None, "a scored ledger needs the tokens' scores"
            self.score[slot, layer, :, :m] = score.float()
        self.count[slot, layer] = m

    def append(self, slots: torch.Tensor, layer: int | torch.Tensor, positions: torch.Tensor,
               score: torch.Tensor | None = None) -> None:
        """One decode token appended to every head of each slot (positions [B]; score [B, Hkv]); `layer` one for
        all or one per slot entry ([B], every (slot, layer) listed once)."""
        rows = self._rows(slots, layer)                                     # [B, Hkv]
        cnt = self.count.view(-1)[rows]
        self._ensure(int(cnt.max()) + 1)
        at = rows * self.pos.shape[-1] + cnt
        self.pos.view(-1)[at] = positions.to(self.pos).view(-1, 1).expand_as(cnt)
        if self.score is not None:
            assert score is not None, "a scored ledger needs the tokens' scores"
            self.score.view(-1)[at] = score.float().expand_as(cnt)
        self.count.view(-1)[rows] = cnt + 1

    def _rows(self, slots: torch.Tensor, layer: int | torch.Tensor, heads: torch.Tensor | None = None) -> torch.Tensor:
        """Flat (slot, layer, head) rows: [B, Hkv] for every head of each slot, or [E] for listed heads. The decode
        hooks index through these so each read and write is one single-index op (they run per layer per step)."""
        _, num_layers, hkv = self.count.shape
        base = slots.long() * num_layers + layer
        if heads is None:
            return base.view(-1, 1) * hkv + torch.arange(hkv, device=base.device)
        return base * hkv + heads.long()

    def extend(self, slot: int, layer: int, positions: torch.Tensor, score: torch.Tensor | None = None) -> None:
        """n tokens appended after every head's tokens of one slot (a query-agnostic question): positions [n],
        score [Hkv, n]."""
        n = positions.numel()
        cnt = self.count[slot, layer]                                       # [Hkv]
        self._ensure(int(cnt.max()) + n)
        idx = cnt.view(-1, 1) + torch.arange(n, device=cnt.device).view(1, -1)            # [Hkv, n]
        heads = torch.arange(cnt.shape[0], device=cnt.device).view(-1, 1).expand_as(idx)
        self.pos[slot, layer, heads, idx] = positions.to(self.pos).view(1, -1).expand_as(idx)
        if self.score is not None:
            assert score is not None, "a scored ledger needs the tokens' scores"
            self.score[slot, layer, heads, idx] = score.float()
        self.count[slot, layer] += n

    def copy(self, src: int, dst: int) -> None:
        """Slot dst's entries become a copy of slot src's (a forked cache)."""
        self.pos[dst] = self.pos[src]
        if self.score is not None:
            self.score[dst] = self.score[src]
        self.count[dst] = self.count[src]

    def view(self, slots: torch.Tensor, layer: int | torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions [B, Hkv, n], counts [B, Hkv]) of the listed slots (at `layer`, or at each one's), in storage
        order."""
        s = slots.long()
        return self.pos[s, layer, :, :n].long(), self.count[s, layer]

    def drop(self, kv: Any, slots: torch.Tensor, layer: int | torch.Tensor, heads: torch.Tensor,
             index: torch.Tensor) -> None:
        """kv.drop_tokens (the head's last token moves into the hole), mirrored here; `layer` one for all entries or
        one per entry (sorted by layer)."""
        if slots.numel() == 0:
            return
        kv.drop_tokens(slots, layer, heads, index)
        rows = self._rows(slots, layer, heads)
        last = self.count.view(-1)[rows] - 1
        cap = self.pos.shape[-1]
        hole, moved = rows * cap + index.long(), rows * cap + last
        self.pos.view(-1)[hole] = self.pos.view(-1)[moved]
        if self.score is not None:
            self.score.view(-1)[hole] = self.score.view(-1)[moved]
        self.count.view(-1)[rows] = last

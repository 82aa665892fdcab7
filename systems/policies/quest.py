"""Quest: each decode step every query head reads its top-K pages by the MinMax upper bound of q.k; nothing is evicted.

Follows mit-han-lab/Quest: pages of 16 tokens, K = budget // page_size pages (at least 3) counting the last
(partial) page, which is always read; the first two layers and the prefill are dense; the full KV stays on the
device, so Quest saves reads, not memory. Granularity `query_head` (default) is the official accuracy path: after
repeat_kv every query head scores the pages with its own query and attends to its own K pages; the engine reads the
union of a KV head's group selections once from the grouped cache (K/V are never copied per query head), and the
pages-read counter counts that union. `kv_head` is the cheaper variant (one set per KV head, the bound maxed over
its query group), as Quest's efficiency kernels do for grouped models.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from systems.policies.base import DecodeStep, KVDims, KVView, Policy, SeqInfo
from systems.policy_support import selection


@dataclass
class Quest(Policy):
    budget: int = 1024        # tokens read per step and KV head (= pages x engine.page_size, Quest's 16-token chunks)
    skip_layers: int = 2      # `_quest_skip_layer = 2`: the first layers attend densely
    min_pages: int = 3        # `max(3, token_budget // 16)`
    granularity: str = "query_head"   # query_head (official accuracy path) | kv_head (one set per KV head)

    name = "quest"

    def __post_init__(self) -> None:
        if self.granularity not in ("query_head", "kv_head"):
            raise ValueError(f"quest: granularity must be query_head or kv_head, got {self.granularity!r}")
        if self.budget <= 0 or self.min_pages < 1 or self.skip_layers < 0:
            raise ValueError(f"quest: budget and min_pages must be positive and skip_layers >= 0, got "
                             f"budget={self.budget} min_pages={self.min_pages} skip_layers={self.skip_layers}")

    @property
    def pages_per_step(self) -> int:
        return max(self.min_pages, self.budget // self.page_size)

    def configure(self, dims: KVDims) -> None:
        super().configure(dims)
        if self.budget % dims.page_size:
            raise ValueError(f"quest: budget={self.budget} is not a whole number of engine.page_size={dims.page_size}"
                             f" pages; use e.g. {self.budget - self.budget % dims.page_size or dims.page_size}")

    def bind(self, kv: KVView) -> None:
        super().bind(kv)
        slots = kv.block_table.shape[0]
        # pages read per slot: host ints for dense steps and KV-head sets (no device op), a device tensor for the
        # union of per-query-head sets
        self._pages_read = [0] * slots
        self._union_read = torch.zeros(slots, dtype=torch.long, device=kv.device)
        self._head_steps = [0] * slots
        self._group = kv.num_q_heads // kv.num_kv_heads
        self._query_heads = torch.arange(kv.num_kv_heads, device=kv.device).repeat_interleave(self._group)

    def reset(self, slot: int) -> None:
        if hasattr(self, "_pages_read"):
            self._pages_read[slot] = 0
            self._union_read[slot] = 0
            self._head_steps[slot] = 0

    def select_pages(self, kv: KVView, step: DecodeStep) -> torch.Tensor | None:
        # nothing is dropped, so every head of a sequence holds its seq_len tokens (no device sync to know it)
        P, k, H = kv.page_size, self.pages_per_step, kv.num_kv_heads
        pages = [-(-seq.seq_len // P) for seq in step.seqs]
        dense = step.layer < self.skip_layers or max(pages) <= k
        per_query = not dense and self.granularity == "query_head" and self._group > 1
        for seq, n in zip(step.seqs, pages):                       # a head reads min(K, its pages) pages
            if not per_query:
                self._pages_read[seq.slot] += H * (n if dense else min(n, k))
            self._head_steps[seq.slot] += H
        if dense:
            return None
        if not per_query:
            return kv.top_pages(step.slots, step.layer, step.q, k, keep_last=True, width=max(pages))
        # each query head scores with its own query: list its KV head once per query head (a group of one)
        chosen = kv.top_pages(step.slots, step.layer, step.q, k, keep_last=True, heads=self._query_heads,
                              width=max(pages))                                   # [B, Hq, K]
        union = selection.as_mask(chosen.view(len(pages), H, -1), max(pages))    # [B, H*G*K] -> per KV head
        self._union_read.index_add_(0, step.slots, union.view(len(pages), H, -1).sum((1, 2)))
        return chosen

    def kv_stats(self, kv: KVView, seq: SeqInfo) -> dict[str, Any]:
        stats = super().kv_stats(kv, seq)
        steps = self._head_steps[seq.slot]
        read = self._pages_read[seq.slot] + int(self._union_read[seq.slot])
        stats.update(budget_tokens=self.budget, pages_per_step=self.pages_per_step, granularity=self.granularity,
                     mean_pages_read=read / steps if steps else None)
        return stats


POLICY = Quest

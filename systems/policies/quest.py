"""Quest: each decode step every KV head reads its top-K pages by the MinMax upper bound of q.k; nothing is evicted.

Follows the efficiency path of mit-han-lab/Quest (methods.md §10): pages of 16 tokens, K = budget // page_size
pages (at least 3) counting the last (partial) page, which is always read; the first two layers and the prefill are
dense; the full KV stays on the device, so Quest saves reads, not memory. Selection is per KV head with the group
aggregated by max over its query heads (methods.md §14.1: the accuracy path's per-query-head selection after
repeat_kv would store G x the cache).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from systems.policies.base import DecodeStep, KVView, Policy, SeqInfo


@dataclass
class Quest(Policy):
    budget: int = 1024        # tokens read per step and KV head (= pages x page_size); scripts sweep 512..4096
    page_size: int = 16       # Quest's chunk size; must equal engine.page_size (the MinMax granularity)
    skip_layers: int = 2      # `_quest_skip_layer = 2`: the first layers attend densely
    min_pages: int = 3        # `max(3, token_budget // 16)`

    name = "quest"

    def __post_init__(self) -> None:
        if self.budget <= 0 or self.page_size <= 0 or self.min_pages < 1 or self.skip_layers < 0:
            raise ValueError(f"quest: budget, page_size, min_pages must be positive and skip_layers >= 0, got "
                             f"budget={self.budget} page_size={self.page_size} min_pages={self.min_pages} "
                             f"skip_layers={self.skip_layers}")

    @property
    def pages_per_step(self) -> int:
        return max(self.min_pages, self.budget // self.page_size)

    def bind(self, kv: KVView) -> None:
        if kv.page_size != self.page_size:
            raise ValueError(f"quest: params.page_size={self.page_size} but engine.page_size={kv.page_size}; "
                             f"set both to the same value")
        super().bind(kv)
        slots = kv.block_table.shape[0]
        # host-side counters: the step's lengths are host ints, so counting costs no device op
        self._pages_read = [0] * slots
        self._head_steps = [0] * slots

    def reset(self, slot: int) -> None:
        if hasattr(self, "_pages_read"):
            self._pages_read[slot] = 0
            self._head_steps[slot] = 0

    def select_pages(self, kv: KVView, step: DecodeStep) -> torch.Tensor | None:
        # nothing is dropped, so every head of a sequence holds its seq_len tokens (no device sync to know it)
        P, k, H = kv.page_size, self.pages_per_step, kv.num_kv_heads
        pages = [-(-seq.seq_len // P) for seq in step.seqs]
        dense = step.layer < self.skip_layers or max(pages) <= k
        for seq, n in zip(step.seqs, pages):                       # a head reads min(K, its pages) pages
            self._pages_read[seq.slot] += H * (n if dense else min(n, k))
            self._head_steps[seq.slot] += H
        if dense:
            return None
        return kv.top_pages(step.slots, step.layer, step.q, k, keep_last=True, width=max(pages))

    def kv_stats(self, kv: KVView, seq: SeqInfo) -> dict[str, Any]:
        stats = super().kv_stats(kv, seq)
        steps = self._head_steps[seq.slot]
        stats.update(budget_tokens=self.budget, pages_per_step=self.pages_per_step,
                     mean_pages_read=self._pages_read[seq.slot] / steps if steps else None)
        return stats


POLICY = Quest

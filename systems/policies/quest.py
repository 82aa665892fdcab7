"""Quest: each decode step every query head reads its top-K pages by the MinMax upper bound of q.k; nothing is evicted.

Follows mit-han-lab/Quest: pages of 16 tokens, the bound sum_d max(q_d kmin_d, q_d kmax_d), the first two layers and
the prefill dense, the full KV kept on the device (Quest saves reads, not memory). Quest has two code paths with
different page rules, and `selection_rule` picks one:
- `accuracy_path` (default): evaluation/quest_attention.py, the path Quest's accuracy numbers come from and the only
  one that runs grouped-query models. Each step takes the top k pages over all pages, k = min(max(3, min(kv_len,
  budget) // 16), pages): the last (partial) page competes like any other, and a sequence shorter than the budget
  still reads k of its pages (kv_len // 16, one less than it holds when its last page is partial), not all of them.
- `efficiency_kernels`: quest/models/llama.py with its controller and kernels, which assume one KV head per query
  head (no grouped-query models) and batch 1. The last page is always read plus the top K - 1 of the others
  (K = budget // 16, at least `min_pages`), and a head with at most K pages attends densely.
Granularity `query_head` (default) is the accuracy path's: after repeat_kv every query head scores the pages with
its own query and attends to its own pages; the engine reads the union of a KV head's group selections once from
the grouped cache (K/V are never copied per query head), and the pages-read counter counts that union. `kv_head` is
the project's cheaper variant, in neither official path: one set per KV head, the bound maxed over its query group.
Either rule is also stated as data (`decode_page_rule`), so the CPU's fused decode step runs it inside its one call
per step, with no Python between layers, and chooses exactly what `select_pages` would.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from systems.policies.base import DecodeLayers, DecodeStep, KVDims, KVView, PageRule, Policy, SeqInfo
from systems.policy_support import selection

RULES = ("accuracy_path", "efficiency_kernels")


@dataclass
class Quest(Policy):
    budget: int = 1024        # tokens read per step and KV head (= pages x engine.page_size, Quest's 16-token chunks)
    skip_layers: int = 2      # `layer_id < 2` / `_quest_skip_layer = 2`: the first layers attend densely
    min_pages: int = 3        # `max(3, token_budget // 16)`
    granularity: str = "query_head"   # query_head (official accuracy path) | kv_head (one set per KV head)
    selection_rule: str = "accuracy_path"   # accuracy_path | efficiency_kernels (see the module docstring)

    name = "quest"

    @classmethod
    def budget_granularity(cls, params: dict[str, Any], page_size: int) -> int:
        return page_size                  # it reads whole pages: budget // page_size of them

    def __post_init__(self) -> None:
        if self.granularity not in ("query_head", "kv_head"):
            raise ValueError(f"quest: granularity must be query_head or kv_head, got {self.granularity!r}")
        if self.selection_rule not in RULES:
            raise ValueError(f"quest: selection_rule must be one of {', '.join(RULES)}, got {self.selection_rule!r}")
        if self.budget <= 0 or self.min_pages < 1 or self.skip_layers < 0:
            raise ValueError(f"quest: budget and min_pages must be positive and skip_layers >= 0, got "
                             f"budget={self.budget} min_pages={self.min_pages} skip_layers={self.skip_layers}")

    @property
    def pages_per_step(self) -> int:
        """K once the context holds the budget (both rules)."""
        return max(self.min_pages, self.budget // self.page_size)

    def pages_for(self, seq_len: int) -> int:
        """The pages a head of a sequence of seq_len tokens reads at a sparse layer under the chosen rule."""
        held = -(-seq_len // self.page_size)
        if self.selection_rule == "efficiency_kernels":
            return min(held, self.pages_per_step)
        return min(max(self.min_pages, min(seq_len, self.budget) // self.page_size), held)

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
        # per-query-head selections of the current step not yet counted into _union_read: counting them once per
        # step over all layers instead of once per layer keeps the bookkeeping out of the per-layer hot path
        self._uncounted: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        self._head_steps = [0] * slots
        self._group = kv.num_q_heads // kv.num_kv_heads
        self._kv_heads = torch.arange(kv.num_kv_heads, device=kv.device)
        self._query_heads = self._kv_heads.repeat_interleave(self._group)

    def reset(self, slot: int) -> None:
        if hasattr(self, "_pages_read"):
            self._count_unions()
            self._pages_read[slot] = 0
            self._union_read[slot] = 0
            self._head_steps[slot] = 0

    def fork(self, kv: KVView, src: int, dst: int) -> None:
        self._count_unions()
        self._pages_read[dst] = self._pages_read[src]
        self._union_read[dst] = self._union_read[src]
        self._head_steps[dst] = self._head_steps[src]

    def _step_reads(self, seqs: list[SeqInfo]) -> tuple[list[int], list[int]]:
        """Pages each sequence's heads hold (nothing is dropped: known without a device sync) and read at a sparse
        layer under the chosen rule."""
        return [seq.pages(self.page_size) for seq in seqs], [self.pages_for(seq.seq_len) for seq in seqs]

    def _dense_at(self, layer: int, held: list[int], reads: list[int]) -> bool:
        # the first managed layers attend densely; reading every page a sequence holds is dense attention too,
        # whichever rule chose it
        return self.layer_rank(layer) < self.skip_layers or reads == held

    def _count_layer(self, seqs: list[SeqInfo], held: list[int], reads: list[int], dense: bool) -> bool:
        """Count one layer's head steps and pages read; returns whether its sets are per query head (their reads
        are counted later, as the unions of each KV head's sets)."""
        per_query = not dense and self.granularity == "query_head" and self._group > 1
        H = self.num_kv_heads
        for seq, n, k in zip(seqs, held, reads):
            if not per_query:
                self._pages_read[seq.slot] += H * (n if dense else k)
            self._head_steps[seq.slot] += H
        return per_query

    def select_pages(self, kv: KVView, step: DecodeStep) -> torch.Tensor | None:
        held, reads = self._step_reads(step.seqs)
        dense = self._dense_at(step.layer, held, reads)
        per_query = self._count_layer(step.seqs, held, reads, dense)
        if dense:
            return None
        width = max(held)
        # each query head scores with its own query: list its KV head once per query head (a group of one)
        heads = self._query_heads if per_query else None
        if self.selection_rule == "efficiency_kernels":
            chosen = kv.top_pages(step.slots, step.layer, step.q, self.pages_per_step, keep_last=True, heads=heads,
                                  width=width)
        else:
            chosen = kv.ranked_pages(step.slots, step.layer, step.q, reads, heads=heads, width=width)
        if per_query:                                                             # [B, Hq, K] -> union per KV head
            self._defer_union(step.slots, chosen, width)
        return chosen

    def decode_page_rule(self, kv: KVView, step: DecodeLayers) -> PageRule:
        held, reads = self._step_reads(step.seqs)
        layers, per_query = [], False
        for layer in self.managed_layers:                 # select_pages' bookkeeping, every managed layer at once
            dense = self._dense_at(layer, held, reads)
            per_query = self._count_layer(step.seqs, held, reads, dense) or per_query
            if not dense:
                layers.append(layer)
        efficiency = self.selection_rule == "efficiency_kernels"
        return PageRule(layers=tuple(layers), k=[self.pages_per_step] * len(reads) if efficiency else reads,
                        heads=self._query_heads if per_query else self._kv_heads, width=max(held),
                        ranked=not efficiency, keep_last=True)

    def pages_chosen(self, kv: KVView, step: DecodeLayers, rule: PageRule, chosen: torch.Tensor) -> None:
        if rule.layers and rule.heads.numel() > self.num_kv_heads:       # per-query-head sets: count their unions
            self._count_unions()
            self._add_unions(step.slots, chosen[list(rule.layers)], rule.width)

    def _defer_union(self, slots: torch.Tensor, chosen: torch.Tensor, width: int) -> None:
        """Queue one layer's per-query-head sets [B, Hq, K] over `width` pages for _count_unions."""
        last = self._uncounted[-1] if self._uncounted else None
        if last is not None and (last[0] is not slots or last[1].shape != chosen.shape or last[2] != width
                                 or len(self._uncounted) >= self.num_layers):
            self._count_unions()
        self._uncounted.append((slots, chosen, width))

    def _count_unions(self) -> None:
        """Add the pending selections' per-KV-head unions to _union_read: they share one batch and width (a new
        step's slots, another width or a full list flush them first), so one mask over all their layers counts them."""
        if not self._uncounted:
            return
        slots, _, width = self._uncounted[0]
        stacked = torch.stack([c for _, c, _ in self._uncounted])                     # [L, B, Hq, K]
        self._uncounted = []
        self._add_unions(slots, stacked, width)

    def _add_unions(self, slots: torch.Tensor, stacked: torch.Tensor, width: int) -> None:
        """Add the per-KV-head unions of per-query-head sets [L, B, Hq, K] over `width` pages to _union_read."""
        n_layers, b = stacked.shape[:2]
        union = selection.as_mask(stacked.reshape(n_layers, b, self.num_kv_heads, -1), width)
        self._union_read.index_add_(0, slots, union.sum((0, 2, 3)))

    def kv_stats(self, kv: KVView, seq: SeqInfo) -> dict[str, Any]:
        stats = super().kv_stats(kv, seq)
        self._count_unions()
        steps = self._head_steps[seq.slot]
        read = self._pages_read[seq.slot] + int(self._union_read[seq.slot])
        stats.update(budget_tokens=self.budget, pages_per_step=self.pages_per_step, granularity=self.granularity,
                     selection_rule=self.selection_rule, mean_pages_read=read / steps if steps else None)
        return stats


POLICY = Quest

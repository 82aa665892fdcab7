"""SnapKV: at prefill each KV head keeps the top C - S_w prefix tokens by pooled window attention, plus the window.

Follows FasterDecoding/SnapKV (`snapkv/monkeypatch/snapkv_utils.py`): attention of the last S_w prompt queries (causal
inside the window) summed over those queries for the prefix keys, 1-D pooling over keys (padding kernel // 2), top
C - S_w, window appended; no compression when n < C. Defaults are the official LongBench setting
(`ablation_c1024_w32_k7_maxpool.json`: S_w 32, kernel 7, max pooling, C 1024; the class defaults are 64 / 320 / 5 /
avg). Prefill only, as the official: decode tokens are appended without limit (report the realized count).
GQA: the official selects per query head after `repeat_kv` (G x the KV memory); here each KV head selects once from
its group's scores reduced with `aggregation` (mean, as kvpress), each query head pooled before the reduction
(`gqa_pool: pool_then_group`, the official's per-head pooling; `group_then_pool` is KVCache-Factory's order).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from systems.policies.base import KVView, Policy, SeqInfo
from systems.policy_support import allocation as alloc
from systems.policy_support import indicators as ind
from systems.policy_support.score_and_keep import ScoreAndKeep


@dataclass
class SnapKV(ScoreAndKeep):
    name = "snapkv"

    budget: int = 1024          # max_capacity_prompt C: tokens per layer and KV head after prefill, window included
    window: int = 32            # S_w, observation window (kept, counted in budget)
    kernel: int = 7
    pooling: str = "maxpool"    # maxpool | avgpool
    aggregation: str = "mean"   # over the GQA group: mean | max | sum
    gqa_pool: str = "pool_then_group"   # pool each query head, then aggregate (the official pools per query head)

    def __post_init__(self) -> None:
        if self.window < 1 or self.budget <= self.window:
            raise ValueError(f"{self.name} needs budget > window >= 1, got budget={self.budget} window={self.window}")
        if self.kernel < 1:
            raise ValueError(f"{self.name}: kernel must be >= 1, got {self.kernel}")
        ind.check_choice("pooling", self.pooling, ind.POOLINGS)
        ind.check_choice("aggregation", self.aggregation, ind.AGGREGATIONS)
        ind.check_choice("gqa_pool", self.gqa_pool, ind.GQA_POOLS)

    def layer_budgets(self, n: int) -> list[int] | None:
        """Non-window tokens each managed layer keeps for a prompt of n tokens (in layer order); None = no
        compression."""
        if n < self.budget:
            return None
        return alloc.uniform_budgets(self.budget - self.window, self.num_managed)

    def window_size(self) -> int:
        return self.window

    def prefill_budget(self, n: int, layer: int) -> int | None:
        budgets = self.layer_budgets(n)
        return None if budgets is None else budgets[self.layer_rank(layer)]

    def prefill_scores(self, kv: KVView, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        attn = ind.window_attention(q, k, self.window, kv.scale)
        return ind.window_indicator(attn, kv.num_kv_heads, "sum", kernel=self.kernel, pooling=self.pooling,
                                    aggregation=self.aggregation, gqa_pool=self.gqa_pool)

    def device_blocks_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        budgets = self.layer_budgets(prompt_len)
        if budgets is None:
            return Policy.device_blocks_needed(self, prompt_len, max_new_tokens)
        return alloc.prefill_blocks_bound(prompt_len, [b + self.window for b in budgets], self.page_size,
                                          self.num_kv_heads) + self.window_prefill_blocks(prompt_len)

    def kv_stats(self, kv: KVView, seq: SeqInfo) -> dict[str, Any]:
        budgets = self.layer_budgets(seq.prefill_len)
        return {**super().kv_stats(kv, seq), "budget_tokens_per_layer": self.budget, "window": self.window,
                "window_counted": True, "prefill_only": True, "aggregation": self.aggregation,
                "gqa_pool": self.gqa_pool,
                "layer_budgets": budgets if budgets is not None else []}


POLICY = SnapKV

"""H2O: heavy hitters by accumulated attention plus a recent window, at prefill and after every decode step.

Follows FMInference/H2O real-drop (`h2o_hf/utils_real_drop/modify_llama.py`, `H2OKVCache_LayerWise`): each forward
adds the attention every key receives (summed over the step's queries) to its running score; when a layer holds more
than heavy + recent keys it keeps the top `heavy` among the non-recent keys plus the last `recent_size`, compacting
the scores with them, so the cache stays at `budget`. Default split: half heavy hitters, half recent, as H2O's ratio
setting (heavy_ratio = recent_ratio = 0.1), so one shared `budget` sweeps it like the other policies; the real-drop
class default is heavy 4 + recent 512 (budget 516, recent_size 512). GQA: the official
assumes Hq == Hkv; scores are reduced over each KV head's query group with `aggregation` (sum, H2O's own reduction).
Scores live per (slot, layer, head) in the score-and-keep ledger, cleared on every reset (the official needs
`_clean_scores`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch

from systems.policies.base import DecodeStep, KVView, SeqInfo
from systems.policy_support import indicators as ind
from systems.policy_support.score_and_keep import ScoreAndKeep


@dataclass
class H2O(ScoreAndKeep):
    name = "h2o"
    accumulate: ClassVar[bool] = True   # the attention a token receives adds up over prefill and every decode step
    rows_scored_alone: ClassVar[bool] = True    # decode_scores: each row's own attention, reduced per row

    budget: int = 1024                  # heavy + recent tokens per layer and KV head, recent included
    recent_size: Optional[int] = None   # None = budget // 2 (H2O's heavy_ratio = recent_ratio); class default 512
    aggregation: str = "sum"            # over the GQA group: sum | mean | max

    @classmethod
    def with_budget(cls, params: dict[str, Any], budget: int) -> dict[str, Any]:
        """A shared budget splits into heavy and recent halves (the recent size follows the budget)."""
        return {**params, "budget": budget, "recent_size": None}

    def __post_init__(self) -> None:
        self.recent = self.budget // 2 if self.recent_size is None else self.recent_size
        if not 0 <= self.recent < self.budget:
            raise ValueError(f"h2o needs 0 <= recent_size < budget, got budget={self.budget} recent={self.recent}")
        ind.check_choice("aggregation", self.aggregation, ind.AGGREGATIONS)

    def window_size(self) -> int:
        return self.recent

    def prefill_scores(self, kv: KVView, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return ind.accumulated_attention(q, k, kv.scale, self.aggregation)

    def decode_scores(self, kv: KVView, step: DecodeStep, rows: torch.Tensor) -> torch.Tensor:
        probs = kv.attention_probs(step.slots[rows], step.rows_at(rows), step.q[rows])   # [R, Hq, N], 0 on padding
        return ind.group_reduce(probs.transpose(0, 1), kv.num_kv_heads, self.aggregation).transpose(0, 1)

    def extend_scores(self, kv: KVView, q: torch.Tensor, k: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        probs = ind.appended_attention(q, k, counts, kv.scale)                   # [Hq, n, N]
        return ind.group_reduce(probs.sum(1), kv.num_kv_heads, self.aggregation)

    def kv_stats(self, kv: KVView, seq: SeqInfo) -> dict[str, Any]:
        return {**super().kv_stats(kv, seq), "budget_tokens_per_layer": self.budget, "recent_size": self.recent,
                "heavy_size": self.budget - self.recent, "window_counted": True, "aggregation": self.aggregation}


POLICY = H2O

"""TOVA: keep the `budget` tokens the last query attends to most (mean over all query heads), one eviction per step.

Follows schwartz-lab-NLP/TOVA (`src/tova_cache.py`): after every attention call, prefill and decode, a layer holding
more than `cache_size` keys keeps the top ones by the last query's attention averaged over all query heads; the same
indices for every KV head, no forced sinks or recent window. The README example uses multi_state_size 512. At decode
the new token's own attention is the score, so exactly one token leaves per step once the layer is full.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from systems.policies.base import DecodeStep, KVView, SeqInfo
from systems.policy_support import indicators as ind
from systems.policy_support.score_and_keep import ScoreAndKeep


@dataclass
class TOVA(ScoreAndKeep):
    name = "tova"

    rows_scored_alone = True    # decode_scores: each row's own attention (kv.attention_probs scores rows alone)

    budget: int = 512           # cache_size: tokens per layer (every KV head the same), nothing forced

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise ValueError(f"tova: budget must be >= 1, got {self.budget}")

    def prefill_scores(self, kv: KVView, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return ind.last_query_attention(q, k, kv.scale)                        # [n]: the same for every KV head

    def decode_scores(self, kv: KVView, step: DecodeStep, rows: torch.Tensor) -> torch.Tensor:
        probs = kv.attention_probs(step.slots[rows], step.rows_at(rows), step.q[rows])     # [R, Hq, N]
        return probs.mean(1)                                                    # [R, N]; padding scores 0

    def kv_stats(self, kv: KVView, seq: SeqInfo) -> dict[str, Any]:
        return {**super().kv_stats(kv, seq), "budget_tokens_per_layer": self.budget, "window_counted": False}


POLICY = TOVA

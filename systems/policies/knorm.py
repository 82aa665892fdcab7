"""KNorm: at prefill each KV head keeps the `budget` keys of smallest L2 norm (kvpress's KnormPress).

Follows NVIDIA/kvpress `KnormPress` (after "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression",
Devoto et al. 2024): a key's score is minus its L2 norm, computed on the cached (post-RoPE) keys, no attention needed;
the press compresses the prompt once and appends decode tokens. kvpress sets a compression ratio; here `budget` is
the tokens each layer and KV head keep, as the other policies' shared budget. `window` (default 0, as kvpress) keeps
the last prompt tokens regardless of their norm, counted in the budget.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from systems.policies.base import KVView, SeqInfo
from systems.policy_support.score_and_keep import ScoreAndKeep


@dataclass
class KNorm(ScoreAndKeep):
    name = "knorm"

    budget: int = 1024          # tokens per layer and KV head after prefill, window included
    window: int = 0             # last prompt tokens kept whatever their norm (kvpress: none)

    def __post_init__(self) -> None:
        if self.window < 0 or self.budget <= self.window:
            raise ValueError(f"knorm needs budget > window >= 0, got budget={self.budget} window={self.window}")

    def window_size(self) -> int:
        return self.window

    def prefill_scores(self, kv: KVView, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return -k.float().norm(dim=-1).T                                     # [Hkv, n]: small norm = kept

    def kv_stats(self, kv: KVView, seq: SeqInfo) -> dict[str, Any]:
        return {**super().kv_stats(kv, seq), "budget_tokens_per_layer": self.budget, "window": self.window,
                "window_counted": True, "prefill_only": True}


POLICY = KNorm

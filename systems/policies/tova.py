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
from systems.policy_support.fixed_budget import FixedBudget


@dataclass
class TOVA(FixedBudget):
    name = "tova"

    budget: int = 512           # cache_size: tokens per layer (every KV head the same), nothing forced

    def __post_init__(self):
        if self.budget < 1:
            raise ValueError(f"tova: budget must be >= 1, got {self.budget}")

    def after_prefill_layer(self, kv: KVView, seq: SeqInfo, layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        n = k.shape[0]
        if n <= self.budget:
            return
        score = ind.last_query_attention(q, k, kv.scale)
        keep = score.topk(self.budget).indices.sort().values
        kv.keep_tokens(seq.slot, layer, [keep] * kv.num_kv_heads)

    def after_append(self, kv: KVView, step: DecodeStep) -> None:
        over = (kv.num_tokens[step.slots, step.layer, 0] > self.budget).nonzero().flatten()
        if over.numel() == 0:
            return
        sub = step.slots[over]
        k, _, counts = kv.gather_tokens(sub, step.layer)
        score = ind.decode_attention(step.q[over], k, counts, kv.scale).mean(1)      # [B, N]; padding scores 0
        valid = torch.arange(score.shape[1], device=score.device).view(1, -1) < counts[:, :1]
        victim = score.masked_fill(~valid, float("inf")).argmin(-1)                 # heads share storage order
        hkv = kv.num_kv_heads
        kv.drop_tokens(sub.repeat_interleave(hkv), step.layer, torch.arange(hkv, device=sub.device).repeat(len(sub)),
                       victim.repeat_interleave(hkv))

    def kv_stats(self, kv: KVView, seq: SeqInfo) -> dict[str, Any]:
        return {**super().kv_stats(kv, seq), "budget_tokens_per_layer": self.budget, "window_counted": False}


POLICY = TOVA

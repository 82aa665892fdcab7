"""H2O: heavy hitters by accumulated attention plus a recent window, at prefill and after every decode step.

Follows FMInference/H2O real-drop (`h2o_hf/utils_real_drop/modify_llama.py`, `H2OKVCache_LayerWise`): each forward
adds the attention every key receives (summed over the step's queries) to its running score; when a layer holds more
than heavy + recent keys it keeps the top `heavy` among the non-recent keys plus the last `recent_size`, compacting
the scores with them, so the cache stays at `budget`. Default split: half heavy hitters, half recent, as H2O's ratio
setting (heavy_ratio = recent_ratio = 0.1), so one shared `budget` sweeps it like the other policies; the real-drop
class default is heavy 4 + recent 512 (budget 516, recent_size 512). GQA: the official
assumes Hq == Hkv; scores are reduced over each KV head's query group with `aggregation` (sum, H2O's own reduction).
Scores live per (slot, layer, head) in a ledger cleared on every reset (the official needs `_clean_scores`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch

from systems.policies.base import DecodeStep, KVView, SeqInfo
from systems.policy_support import indicators as ind
from systems.policy_support.fixed_budget import LedgerBudget


@dataclass
class H2O(LedgerBudget):
    ledger_scores: ClassVar[bool] = True   # accumulated attention rides along with each token
    name = "h2o"

    budget: int = 1024                  # heavy + recent tokens per layer and KV head, recent included
    recent_size: Optional[int] = None   # None = budget // 2 (H2O's heavy_ratio = recent_ratio); class default 512
    aggregation: str = "sum"            # over the GQA group: sum | mean | max

    @classmethod
    def with_budget(cls, params: dict[str, Any], budget: int) -> dict[str, Any]:
        """A shared budget splits into heavy and recent halves (the recent size follows the budget)."""
        return {**params, "budget": budget, "recent_size": None}

    def __post_init__(self):
        self.recent = self.budget // 2 if self.recent_size is None else self.recent_size
        if not 0 <= self.recent < self.budget:
            raise ValueError(f"h2o needs 0 <= recent_size < budget, got budget={self.budget} recent={self.recent}")
        ind.check_choice("aggregation", self.aggregation, ind.AGGREGATIONS)

    def after_prefill_layer(self, kv: KVView, seq: SeqInfo, layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        n = k.shape[0]
        score = ind.accumulated_attention(q, k, kv.scale, self.aggregation)     # [Hkv, n]
        if n <= self.budget:
            self.ledger.set(seq.slot, layer, torch.arange(n, device=k.device).expand(k.shape[1], n), score)
            return
        keep = ind.top_keep(score[:, :n - self.recent], self.budget - self.recent, self.recent, n)
        kv.keep_tokens(seq.slot, layer, keep)
        kept = torch.stack(keep)                                                 # storage == position order here
        self.ledger.set(seq.slot, layer, kept, score.gather(-1, kept))

    def after_extend_layer(self, kv: KVView, seq: SeqInfo, layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        """A query-agnostic question is kept whole; its rows add their attention to every key's score, as prefill
        queries do, and its tokens join the ledger."""
        n, hkv = q.shape[0], kv.num_kv_heads
        self.ledger.extend(seq.slot, layer, torch.arange(seq.seq_len - n, seq.seq_len, device=q.device),
                           torch.zeros(hkv, n, device=q.device))
        keys, _, counts = kv.gather_tokens(torch.tensor([seq.slot], device=q.device), layer)
        probs = ind.appended_attention(q, keys[0], counts[0], kv.scale)       # [Hq, n, N]
        self.ledger.scores[seq.slot, layer, :, :probs.shape[-1]] += ind.group_reduce(probs.sum(1), hkv,
                                                                                      self.aggregation)

    def after_append(self, kv: KVView, step: DecodeStep) -> None:
        slots, layer, led = step.slots, step.layer, self.ledger
        hkv = kv.num_kv_heads
        led.append(slots, layer, torch.tensor([s.seq_len - 1 for s in step.seqs], device=slots.device),
                   torch.zeros(len(slots), hkv, device=slots.device))
        k, _, counts = kv.gather_tokens(slots, layer)
        probs = ind.decode_attention(step.q, k, counts, kv.scale)              # [B, Hq, N], 0 on padding
        n = probs.shape[-1]
        s = slots.long()
        led.scores[s, layer, :, :n] += ind.group_reduce(probs.transpose(0, 1), hkv, self.aggregation).transpose(0, 1)
        over = (counts[:, 0] > self.budget).nonzero().flatten()
        if over.numel() == 0:
            return
        sub = slots[over]
        pos, cnt = led.view(sub, layer, n)
        newest = torch.tensor([step.seqs[i].seq_len for i in over.tolist()], device=pos.device).view(-1, 1, 1)
        protected = (pos >= newest - self.recent) | (torch.arange(n, device=pos.device).view(1, 1, n) >=
                                                     cnt.unsqueeze(-1))
        victim = led.scores[sub.long(), layer, :, :n].masked_fill(protected, float("inf")).argmin(-1)
        heads = torch.arange(hkv, device=pos.device).expand(len(sub), hkv)
        led.drop(kv, sub.view(-1, 1).expand(len(sub), hkv).reshape(-1), layer, heads.reshape(-1), victim.reshape(-1))

    def kv_stats(self, kv: KVView, seq: SeqInfo) -> dict[str, Any]:
        return {**super().kv_stats(kv, seq), "budget_tokens_per_layer": self.budget, "recent_size": self.recent,
                "heavy_size": self.budget - self.recent, "window_counted": True, "aggregation": self.aggregation}


POLICY = H2O

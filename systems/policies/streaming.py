"""StreamingLLM: every layer and head keeps the first `sink_size` tokens (attention sinks) and the most recent rest.

Follows mit-han-lab/streaming-llm (`start_size` 4; `recent_size` 2000 in `examples/run_streaming_llama.py`): here
`budget` = start_size + recent_size tokens per layer. Prefill keeps sinks + the last budget - sink_size tokens; each
decode step then drops the oldest non-sink token, so the layer stays at `budget` after the step (the step itself
attends to budget + 1, as any post-attention hook). Positions: keys keep their original RoPE positions, as in
KVCache-Factory and kvpress; the official re-rotates cached keys to positions inside the cache, which a cache of
post-RoPE keys cannot do (a re-rotation would need the pre-RoPE keys).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from systems.policies.base import DecodeLayers, DecodeStep, KVView, SeqInfo
from systems.policy_support.fixed_budget import LedgerBudget


@dataclass
class StreamingLLM(LedgerBudget):
    name = "streaming"

    budget: int = 2004          # start_size + recent_size tokens per layer, sinks included
    sink_size: int = 4          # start_size

    def __post_init__(self) -> None:
        if self.sink_size < 0 or self.budget <= self.sink_size:
            raise ValueError(f"streaming needs budget > sink_size >= 0, got budget={self.budget} "
                             f"sink_size={self.sink_size}")

    def after_prefill_layer(self, kv: KVView, seq: SeqInfo, layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        n, hkv = k.shape[0], k.shape[1]
        if n <= self.budget:
            self.ledger.set(seq.slot, layer, torch.arange(n, device=k.device).expand(hkv, n))
            return
        keep = torch.cat([torch.arange(self.sink_size), torch.arange(n - self.budget + self.sink_size, n)]).to(k.device)
        kv.keep_tokens(seq.slot, layer, [keep] * hkv)
        self.ledger.set(seq.slot, layer, keep.expand(hkv, -1))

    def after_extend_layer(self, kv: KVView, seq: SeqInfo, layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        """A query-agnostic question is kept whole: its tokens join the ledger (decode steps then slide the window
        one token at a time, from the layer's size after the question)."""
        n = q.shape[0]
        self.ledger.extend(seq.slot, layer, torch.arange(seq.seq_len - n, seq.seq_len, device=q.device))

    def after_append(self, kv: KVView, step: DecodeStep) -> None:
        slots, layer = step.slots, step.at
        self.ledger.append(slots, layer, torch.tensor([s.seq_len - 1 for s in step.seqs], device=slots.device))
        over = (kv.num_tokens[slots, layer, 0] > self.budget).nonzero().flatten()
        if over.numel() == 0:
            return
        sub, at = slots[over], step.rows_at(over)
        pos, counts = self.ledger.view(sub, at, int(kv.num_tokens[sub, at].max()))
        n = pos.shape[-1]
        valid = torch.arange(n, device=pos.device).view(1, 1, n) < counts.unsqueeze(-1)
        oldest = pos.masked_fill(~valid | (pos < self.sink_size), torch.iinfo(torch.int64).max).argmin(-1)
        b, hkv = oldest.shape
        heads = torch.arange(hkv, device=pos.device).expand(b, hkv)
        self.ledger.drop(kv, sub.view(-1, 1).expand(b, hkv).reshape(-1), step.rows_at(over, hkv), heads.reshape(-1),
                         oldest.reshape(-1))

    def after_decode_step(self, kv: KVView, step: DecodeLayers) -> None:
        """after_append over every managed layer's rows at once: positions are unique per head, so the oldest token
        does not depend on which rows share the pass."""
        self.after_append(kv, step.rows(self.managed_layers))

    def kv_stats(self, kv: KVView, seq: SeqInfo) -> dict[str, Any]:
        return {**super().kv_stats(kv, seq), "budget_tokens_per_layer": self.budget, "sink_size": self.sink_size,
                "window_counted": True, "positions": "original"}


POLICY = StreamingLLM

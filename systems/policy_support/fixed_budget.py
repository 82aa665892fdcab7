"""Base of policies holding a fixed `budget` of tokens per (layer, KV head) from prefill on (H2O, TOVA, Streaming)."""
from __future__ import annotations

from typing import ClassVar

from systems.policies.base import KVView, Policy
from systems.policy_support import allocation as alloc
from systems.policy_support import indicators as ind


class FixedBudget(Policy):
    """Admission footprint: the whole prompt when it fits the budget, else the transient bound of one full layer
    plus `budget` tokens for every other layer (eviction runs layer by layer during prefill); the budget holds on the
    layers the policy manages, the others keep their window."""

    budget: int                 # tokens per (layer, KV head); a field of each subclass's dataclass

    def expected_device_blocks(self, prompt_len: int, output_tokens: int) -> int | None:
        """Evicting while decoding keeps every layer at `budget` tokens once it is reached."""
        tokens = prompt_len + output_tokens - 1
        held = min(tokens, self.budget)
        return self.num_managed * self.num_kv_heads * -(-held // self.page_size) + self.window_blocks(tokens)

    def expected_blocks_slack(self) -> int:
        return self.num_managed * self.num_kv_heads

    def device_blocks_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        if prompt_len <= self.budget:
            return super().device_blocks_needed(prompt_len, max_new_tokens)
        return alloc.prefill_blocks_bound(prompt_len, [self.budget] * self.num_managed, self.page_size,
                                          self.num_kv_heads) + self.window_prefill_blocks(prompt_len)


class LedgerBudget(FixedBudget):
    """Plus a TokenLedger (original positions, optionally running scores) for decode-time eviction."""

    ledger_scores: ClassVar[bool] = False

    def bind(self, kv: KVView) -> None:
        super().bind(kv)
        self.ledger = ind.TokenLedger(kv.block_table.shape[0], kv.num_layers, kv.num_kv_heads, kv.device,
                                      with_scores=self.ledger_scores)

    def reset(self, slot: int) -> None:
        if hasattr(self, "ledger"):
            self.ledger.reset(slot)

    def fork(self, kv: KVView, src: int, dst: int) -> None:
        self.ledger.copy(src, dst)

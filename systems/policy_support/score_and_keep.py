"""Score-and-keep eviction: a policy implements only its token scores; this base keeps the best within the budget.

As kvpress's ScorerPress: the policy says how much each stored token is worth (`prefill_scores`, and `decode_scores`
to evict while decoding); the base does the rest through the KV view.

- Prefill: when a layer holds more than its budget (`prefill_budget`; SnapKV-style policies give each layer its own),
  each KV head keeps its `prefill_budget` best-scoring tokens before the last `window_size()` plus that window. A
  score shared by every KV head ([n]) keeps the same tokens in each.
- Decode, with `accumulate = False` (TOVA): once a layer holds more than `budget`, the token the new query scores
  lowest leaves, one per step (no window is protected at decode).
- Decode, with `accumulate = True` (H2O): every step's scores add to each token's running score, kept in a ledger
  beside the cache and seeded with the prefill scores; once over budget, the token with the lowest running score
  outside the last `window_size()` positions leaves.
- Without `decode_scores` the policy evicts at prefill only and decode tokens are appended (SnapKV, KNorm).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from systems.policies.base import DecodeLayers, DecodeStep, KVView, SeqInfo
from systems.policy_support import indicators as ind
from systems.policy_support.fixed_budget import FixedBudget


def keep_best(scores: torch.Tensor, keep: int, window: int, n: int, heads: int) -> list[torch.Tensor]:
    """Per KV head the storage indices to keep, ascending: the `keep` best scores before the last `window` tokens,
    then the window. `scores` is [heads, >= n - window] per head, or [>= n - window] shared by every head."""
    if scores.dim() == 2:
        return ind.top_keep(scores[:, :n - window], keep, window, n)
    keep = max(0, min(keep, n - window))
    top = scores[:n - window].topk(keep).indices
    kept = torch.cat([top, torch.arange(n - window, n, device=scores.device)]).sort().values
    return [kept] * heads


@dataclass
class ScoreAndKeep(FixedBudget):
    """Base of eviction policies defined by their token scores (subclasses add `name` and their knobs)."""

    budget: int = 1024          # tokens per layer and KV head, window included

    accumulate: ClassVar[bool] = False     # decode scores add up per token (H2O) instead of standing alone (TOVA)
    step_queries: ClassVar[bool] = True    # decode scores read each layer's query
    # decode_scores reads nothing but step.q[rows] and its arguments and scores each row alone, so one call may
    # score the rows of every layer of a step (eviction is then deferred to the step's end; see after_decode_step)
    rows_scored_alone: ClassVar[bool] = False

    # ---- what a policy implements -------------------------------------------------------------------------------
    def prefill_scores(self, kv: KVView, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """How much each prompt token is worth to each KV head: [Hkv, n] (or [n], shared by every head); only the
        tokens before the window are compared. q [n, Hq, D], k [n, Hkv, D], post-RoPE."""
        raise NotImplementedError

    def decode_scores(self, kv: KVView, step: DecodeStep, rows: torch.Tensor) -> torch.Tensor:
        """Worth of each stored token for the batch rows `rows` of the step: [R, Hkv, N] (or [R, N], shared by every
        head), N = the most tokens a head of those rows holds (kv.num_tokens[step.slots[rows], step.rows_at(rows)]).
        The rows are (step.slots[rows], step.rows_at(rows)) with queries step.q[rows]; read their tokens through
        the view (kv.attention_probs: the new queries' attention; ind.stored_keys: the keys). Each row's scores must
        not depend on the other rows (nor on padding past its counts): a deferred eviction's step holds the rows of
        every layer (DecodeStep.layers). Not implemented: prefill-only."""
        raise NotImplementedError

    def extend_scores(self, kv: KVView, q: torch.Tensor, k: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """With `accumulate`: what n rows appended after a compressed context (a query-agnostic question) add to the
        running score of each stored token, [Hkv, N], given q [n, Hq, D] and one slot's stored keys k [Hkv, N, D]
        (the appended rows last) with counts [Hkv]."""
        raise NotImplementedError

    def window_size(self) -> int:
        """The most recent tokens always kept (counted in the budget)."""
        return 0

    def prefill_budget(self, n: int, layer: int) -> int | None:
        """Tokens before the window a layer keeps after a prefill of n; None keeps them all."""
        return None if n <= self.budget else self.budget - self.window_size()

    # ---- the base's work ----------------------------------------------------------------------------------------
    @classmethod
    def evicts_while_decoding(cls) -> bool:
        return cls.decode_scores is not ScoreAndKeep.decode_scores

    def expected_device_blocks(self, prompt_len: int, output_tokens: int) -> int | None:
        if self.evicts_while_decoding():
            return super().expected_device_blocks(prompt_len, output_tokens)
        held = min(prompt_len, self.budget) + output_tokens - 1     # prefill-only: decode tokens are appended
        return (self.num_managed * self.num_kv_heads * -(-held // self.page_size)
                + self.window_blocks(prompt_len + output_tokens - 1))

    def bind(self, kv: KVView) -> None:
        super().bind(kv)
        if self.accumulate:
            self.ledger = ind.TokenLedger(kv.block_table.shape[0], kv.num_layers, kv.num_kv_heads, kv.device,
                                          with_scores=True)

    def reset(self, slot: int) -> None:
        if hasattr(self, "ledger"):
            self.ledger.reset(slot)

    def fork(self, kv: KVView, src: int, dst: int) -> None:
        if hasattr(self, "ledger"):
            self.ledger.copy(src, dst)
        else:
            self.reset(dst)

    def after_extend_layer(self, kv: KVView, seq: SeqInfo, layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        """A query-agnostic question is kept whole; with a running score its tokens join the ledger and its rows
        add to every stored token's score, as prefill queries do."""
        if not self.accumulate:
            return
        n = q.shape[0]
        self.ledger.extend(seq.slot, layer, torch.arange(seq.seq_len - n, seq.seq_len, device=q.device),
                           torch.zeros(kv.num_kv_heads, n, device=q.device))
        keys, _, counts = kv.gather_tokens(torch.tensor([seq.slot], device=q.device), layer)
        score = self.extend_scores(kv, q, keys[0], counts[0])
        self.ledger.scores[seq.slot, layer, :, :score.shape[-1]] += score

    def after_prefill_layer(self, kv: KVView, seq: SeqInfo, layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        n, heads = k.shape[0], k.shape[1]
        keep = self.prefill_budget(n, layer)
        if keep is None and not self.accumulate:
            return
        scores = self.prefill_scores(kv, q, k)
        if keep is None:
            kept = torch.arange(n, device=k.device).expand(heads, n)
        else:
            kept_list = keep_best(scores, keep, self.window_size(), n, heads)
            kv.keep_tokens(seq.slot, layer, kept_list)
            kept = torch.stack(kept_list)                             # storage == position order here
        if self.accumulate:
            per_head = scores if scores.dim() == 2 else scores.expand(heads, -1)
            self.ledger.set(seq.slot, layer, kept, per_head.gather(-1, kept))

    def after_append(self, kv: KVView, step: DecodeStep) -> None:
        if not self.evicts_while_decoding():
            return
        if self.accumulate:
            self._evict_lowest_running(kv, step)
        else:
            self._evict_lowest_now(kv, step)

    def after_decode_step(self, kv: KVView, step: DecodeLayers) -> None:
        """after_append over every managed layer's rows at once, scored with each layer's own query: each row's
        scores are computed alone (kv.attention_probs scores each row by itself) and a victim is each row's first
        minimum, so neither depends on which rows share the pass."""
        if self.evicts_while_decoding():
            self.after_append(kv, step.rows(self.managed_layers))

    def defers_eviction(self) -> bool:
        return super().defers_eviction() and (self.rows_scored_alone or not self.evicts_while_decoding())

    def _evict_lowest_now(self, kv: KVView, step: DecodeStep) -> None:
        over = (kv.num_tokens[step.slots, step.at, 0] > self.budget).nonzero().flatten()
        if over.numel() == 0:
            return
        sub, hkv = step.slots[over], kv.num_kv_heads
        counts = kv.num_tokens[sub, step.rows_at(over)].long()
        score = self.decode_scores(kv, step, over)
        n = score.shape[-1]
        if score.dim() == 2:                                          # one score per token, heads share storage
            valid = torch.arange(n, device=score.device).view(1, -1) < counts[:, :1]
            victim = score.masked_fill(~valid, float("inf")).argmin(-1).repeat_interleave(hkv)
        else:
            valid = torch.arange(n, device=score.device).view(1, 1, -1) < counts.unsqueeze(-1)
            victim = score.masked_fill(~valid, float("inf")).argmin(-1).reshape(-1)
        kv.drop_tokens(sub.repeat_interleave(hkv), step.rows_at(over, hkv),
                       torch.arange(hkv, device=sub.device).repeat(len(sub)), victim)

    def _evict_lowest_running(self, kv: KVView, step: DecodeStep) -> None:
        slots, layer, led, hkv = step.slots, step.at, self.ledger, kv.num_kv_heads
        led.append(slots, layer, torch.tensor([s.seq_len - 1 for s in step.seqs], device=slots.device),
                   torch.zeros(len(slots), hkv, device=slots.device))
        counts = kv.num_tokens[slots, layer].long()
        score = self.decode_scores(kv, step, torch.arange(len(slots), device=slots.device))
        n = score.shape[-1]
        s = slots.long()
        led.scores[s, layer, :, :n] += score if score.dim() == 3 else score.unsqueeze(1)
        over = (counts[:, 0] > self.budget).nonzero().flatten()
        if over.numel() == 0:
            return
        sub, at = slots[over], step.rows_at(over)
        pos, cnt = led.view(sub, at, n)
        newest = torch.tensor([step.seqs[i].seq_len for i in over.tolist()], device=pos.device).view(-1, 1, 1)
        protected = (pos >= newest - self.window_size()) | (torch.arange(n, device=pos.device).view(1, 1, n) >=
                                                           cnt.unsqueeze(-1))
        victim = led.scores[sub.long(), at, :, :n].masked_fill(protected, float("inf")).argmin(-1)
        heads = torch.arange(hkv, device=pos.device).expand(len(sub), hkv)
        led.drop(kv, sub.view(-1, 1).expand(len(sub), hkv).reshape(-1), step.rows_at(over, hkv), heads.reshape(-1),
                 victim.reshape(-1))

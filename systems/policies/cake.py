"""CAKE (ICLR 2025): preference-prioritized per-layer budgets, cascading prefill eviction, mean + gamma*var indicator.

Follows antgroup/cakekv (`cake/model/modify_llama.py`, `cake/cake_cache.py`, `cake/utils.py`):
- per layer, from the window attention A_w (last S_w queries x prefix keys): preference H^(1/tau1) * V^(1/tau2) and
  token scores mean + gamma * var over the window queries, avg-pooled (kernel 5) per query head, averaged over the GQA
  group; the last S_w tokens are always kept;
- budgets B_l = P_l / sum P * (cache_size - S_w) * L, repaired by `allocation.adjust_budgets`, clamped to n - S_w;
- cascading: after each layer's prefill the budgets are recomputed over the layers seen so far and every seen layer is
  re-evicted (its stored scores are compacted with it, so re-eviction equals one-shot eviction); without cascading
  the full prefill KV is held until the last layer. No eviction while n <= cache_size + S_w. On a hybrid model L, the
  preferences, the cascade and its last layer are those of the layers the policy manages (the full-attention ones);
- decode: a layer holds B_l + S_w tokens; once over, the current query's attention (mean -> avg-pool 5 -> group mean,
  no variance) picks the token to drop among all but the last S_w, so about one token leaves per step.

Decode pooling order: the official gathers kept tokens in `topk` order, so its cache is stored by descending score
(prefill score after prefill, the pooled decode score after each decode eviction, new tokens appended, the window
last) and the avg-pool runs over neighbours in that order. Our storage is compacted in position order, so the ledger
carries that official order as a key per token and pools along it (`decode_pool_order: storage`, the default);
`position` pools over neighbours in position order instead. They differ in what they keep (on one SmolLM2 S-RT
sample at budget 128 only the official order still answers), so the official one is the default.

Deviations: scores stay fp32 (the official casts softmax to fp16/bf16); K/V are never expanded to query heads
(selection is per KV head after the group mean, as the official already does). Ablations (CAKE T2/T3/F8) are
fields: `allocation` (preference | uniform | pyramid | random) and `indicator` (mean_plus_var | mean | var |
mean_times_var | sum = SnapKV | h2o).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import torch

from systems.policies.base import DecodeLayers, DecodeStep, KVView, Policy, SeqInfo
from systems.policy_support import allocation as alloc
from systems.policy_support import indicators as ind

INDICATORS = ind.WINDOW_INDICATORS + ("h2o",)
POOL_ORDERS = ("storage", "position")
APPENDED = 1e7      # order key offset of decode tokens: after every token ranked so far (keys stay exact in fp32)


@dataclass
class _SlotState:
    """Prefill bookkeeping of one sequence; the per-layer lists cover the layers seen so far."""

    prefs: list[float] = field(default_factory=list)
    scores: list[torch.Tensor] = field(default_factory=list)    # [Hkv, kept prefix] indicator, storage order
    positions: list[torch.Tensor] = field(default_factory=list)  # [Hkv, kept prefix] original positions
    ranks: list[torch.Tensor] = field(default_factory=list)      # [Hkv, kept prefix] place in the official order
    budgets: list[int] = field(default_factory=list)             # realized non-window budget (decode's at the end)


@dataclass
class Cake(Policy):
    name = "cake"

    budget: int = 1024                  # cache_size: average tokens per layer and KV head, window included
    window: int = 32                    # S_w, observation window; always kept, counted in `budget`
    gamma: float = 200.0                # indicator mean + gamma * var
    cascading: bool = True              # official flag --cascading; False = evict once after the last layer
    tau1: Optional[float] = None        # None: CAKE's (model, budget) table via tau_model, else 1.0
    tau2: Optional[float] = None
    tau_model: Optional[str] = None     # key of CAKE's tau table, e.g. llama3.1-8b-128k
    kernel: int = 5
    pooling: str = "avgpool"
    aggregation: str = "mean"           # over the GQA group
    allocation: str = "preference"      # preference (CAKE) | uniform | pyramid | random
    indicator: str = "mean_plus_var"    # mean_plus_var (CAKE) | mean | var | mean_times_var | sum | h2o
    beta: int = 20                      # pyramid allocation only (PyramidKV's beta)
    seed: int = 0                       # random allocation only
    decode_evict: bool = True           # official: decode keeps each layer at B_l + S_w
    decode_pool_order: str = "storage"  # storage (official cache order, by score) | position

    step_queries: ClassVar[bool] = True     # decode eviction scores with each layer's query

    def __post_init__(self) -> None:
        if self.window < 1 or self.budget <= self.window:
            raise ValueError(f"cake needs budget > window >= 1, got budget={self.budget} window={self.window}")
        ind.check_choice("allocation", self.allocation, alloc.ALLOCATIONS)
        ind.check_choice("indicator", self.indicator, INDICATORS)
        ind.check_choice("pooling", self.pooling, ind.POOLINGS)
        ind.check_choice("aggregation", self.aggregation, ind.AGGREGATIONS)
        ind.check_choice("decode_pool_order", self.decode_pool_order, POOL_ORDERS)
        table = alloc.cake_tau(self.tau_model, self.budget)
        self.taus = (self.tau1 if self.tau1 is not None else table[0], self.tau2 if self.tau2 is not None else table[1])
        if min(self.taus) <= 0:
            raise ValueError(f"cake: tau1 and tau2 must be positive, got {self.taus}")
        self._state: dict[int, _SlotState] = {}

    def bind(self, kv: KVView) -> None:
        super().bind(kv)
        # the ledger's score slot holds each token's rank in the official cache order (see the module docstring)
        self.ledger = ind.TokenLedger(kv.block_table.shape[0], kv.num_layers, kv.num_kv_heads, kv.device,
                                      with_scores=True)

    # ---- budgets -------------------------------------------------------------------------------------------------
    @property
    def total(self) -> int:
        return (self.budget - self.window) * self.num_managed

    def compresses(self, n: int) -> bool:
        return n > self.budget + self.window

    def seen_budgets(self, prefs: list[float], n: int) -> list[int]:
        """Non-window budgets of the layers seen so far (len(prefs) of them), before the eviction-time clamp."""
        seen, cap, L = len(prefs), n - self.window, self.num_managed
        if self.allocation == "preference":
            return alloc.preference_budgets(prefs, self.total, cap)
        if self.allocation == "uniform":
            return alloc.uniform_budgets(self.budget - self.window, seen)
        if self.allocation == "pyramid":
            pyramid = alloc.pyramid_budgets(n, self.budget, self.window, L, self.beta)
            assert pyramid is not None                 # only called while compressing: n > budget
            return pyramid[:seen]
        return alloc.random_budgets(L, self.total, cap, self.seed)[:seen]

    def expected_device_blocks(self, prompt_len: int, output_tokens: int) -> int | None:
        """Decode holds each layer at its budget (B_l + S_w, `budget` on average); without decode eviction the
        decode tokens are appended to what prefill kept."""
        T = prompt_len + output_tokens - 1
        held = min(T, self.budget) if self.decode_evict else min(prompt_len, self.budget) + output_tokens - 1
        return self.num_managed * self.num_kv_heads * -(-held // self.page_size) + self.window_blocks(T)

    def expected_blocks_slack(self) -> int:
        return self.num_managed * self.num_kv_heads     # non-uniform per-layer budgets round up once per layer

    def prefill_peak_blocks(self, prompt_len: int) -> int | None:
        """With cascading the seen layers hold at most their budgets plus one whole layer; without it the whole
        prompt is held until the last layer."""
        return self.device_blocks_needed(prompt_len, 0)

    def device_blocks_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        if not (self.cascading and self.compresses(prompt_len)):
            return super().device_blocks_needed(prompt_len, max_new_tokens)
        if self.allocation == "preference":
            bound = alloc.cascading_blocks_bound(prompt_len, self.total, self.window, self.num_managed,
                                                 self.page_size, self.num_kv_heads)
            return bound + self.window_prefill_blocks(prompt_len)
        fixed = self.seen_budgets([1.0] * self.num_managed, prompt_len)
        return alloc.prefill_blocks_bound(prompt_len, [max(b, 0) + self.window for b in fixed], self.page_size,
                                          self.num_kv_heads) + self.window_prefill_blocks(prompt_len)

    # ---- prefill -------------------------------------------------------------------------------------------------
    def reset(self, slot: int) -> None:
        self._state.pop(slot, None)
        if hasattr(self, "ledger"):
            self.ledger.reset(slot)

    def _scores(self, q: torch.Tensor, k: torch.Tensor, attn: torch.Tensor, scale: float) -> torch.Tensor:
        n, hkv = k.shape[0], k.shape[1]
        if self.indicator == "h2o":
            return ind.accumulated_attention(q, k, scale, self.aggregation)[:, :n - self.window]
        return ind.window_indicator(attn, hkv, self.indicator, self.gamma, self.kernel, self.pooling, self.aggregation)

    def after_prefill_layer(self, kv: KVView, seq: SeqInfo, layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        n, hkv = k.shape[0], k.shape[1]
        st = self._state.setdefault(seq.slot, _SlotState())
        if not self.compresses(n):
            st.budgets.append(self.budget - self.window)    # official: decode hh_size = cache_size - S_w
            every = torch.arange(n, device=k.device).expand(hkv, n)
            self.ledger.set(seq.slot, layer, every, every)
            return
        attn = ind.window_attention(q, k, self.window, kv.scale)
        st.prefs.append(alloc.layer_preference(attn[:, :, :n - self.window], *self.taus)
                        if self.allocation == "preference" else 1.0)
        st.scores.append(self._scores(q, k, attn, kv.scale))
        prefix = torch.arange(n - self.window, device=k.device).expand(hkv, n - self.window)
        st.positions.append(prefix)
        st.ranks.append(prefix)                              # before any eviction the cache is in position order
        st.budgets.append(n - self.window)
        last = self.layer_rank(layer) == self.num_managed - 1
        if not self.cascading and not last:
            return
        for i, b in enumerate(self.seen_budgets(st.prefs, n)):
            self._evict(kv, seq.slot, i, st, min(max(b, 0), n - self.window))
        if last:                                             # hand the kept tokens to the decode-time ledger
            window = torch.arange(n - self.window, n, device=k.device).expand(hkv, self.window)
            for i, managed in enumerate(self.managed_layers):
                kept = st.positions[i].shape[-1]
                self.ledger.set(seq.slot, managed, torch.cat([st.positions[i], window], dim=-1),
                                torch.cat([st.ranks[i], window - (n - self.window) + kept], dim=-1))
            st.scores, st.positions, st.ranks = [], [], []

    def _evict(self, kv: KVView, slot: int, layer: int, st: _SlotState, budget: int) -> None:
        """Keep the `budget` best prefix tokens of the layer (plus its window); storage stays in position order.
        `layer` is the rank among the managed layers, as the slot state's lists are indexed."""
        scores = st.scores[layer]
        kept = scores.shape[-1]
        budget = min(budget, kept)                           # a grown budget cannot bring evicted tokens back
        desc = scores.topk(budget, dim=-1).indices if budget > 0 else scores[:, :0].long()   # official cache order
        if budget == kept:                                   # nothing to drop; the official still re-stores by score
            st.ranks[layer] = desc.argsort(dim=-1)
            return
        top, rank = desc.sort(dim=-1)                       # storage must ascend; rank = place in the official order
        st.scores[layer] = scores.gather(-1, top)
        st.positions[layer] = st.positions[layer].gather(-1, top)
        st.ranks[layer] = rank
        h, w = top.shape[0], self.window
        window = torch.arange(kept, kept + w, device=top.device).expand(h, w)
        kv.keep_tokens(slot, self.managed_layers[layer], list(torch.cat([top, window], dim=-1).unbind(0)))
        st.budgets[layer] = budget

    def fork(self, kv: KVView, src: int, dst: int) -> None:
        """A reader of a forked cache continues with the source's realized budgets and decode ledger."""
        st = self._state.get(src)
        if st is None:
            self._state.pop(dst, None)
        else:
            self._state[dst] = _SlotState(prefs=list(st.prefs), scores=list(st.scores), positions=list(st.positions),
                                          ranks=list(st.ranks), budgets=list(st.budgets))
        self.ledger.copy(src, dst)

    def after_extend_layer(self, kv: KVView, seq: SeqInfo, layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        """A query-agnostic question is kept whole: its tokens join the decode ledger after every ranked token, as
        decode tokens do (decode eviction then holds the layer at its size after the question)."""
        n = q.shape[0]
        pos = torch.arange(seq.seq_len - n, seq.seq_len, device=q.device)
        self.ledger.extend(seq.slot, layer, pos, (APPENDED + pos.float()).expand(kv.num_kv_heads, n))

    # ---- decode --------------------------------------------------------------------------------------------------
    def after_append(self, kv: KVView, step: DecodeStep) -> None:
        layer, slots = step.at, step.slots
        new_pos = torch.tensor([s.seq_len - 1 for s in step.seqs], device=slots.device)
        self.ledger.append(slots, layer, new_pos, (APPENDED + new_pos.float()).view(-1, 1).expand(-1, kv.num_kv_heads))
        if not self.decode_evict:
            return
        ranks_of = [self.layer_rank(step.layer)] * len(slots) if step.layers is None else \
            [self.layer_rank(int(x)) for x in step.layers.tolist()]
        limit = torch.tensor([self._state[s.slot].budgets[r] + self.window for s, r in zip(step.seqs, ranks_of)],
                             device=slots.device)
        over = (kv.num_tokens[slots, layer, 0].long() > limit).nonzero().flatten()
        if over.numel() == 0:
            return
        sub, at = slots[over], step.rows_at(over)
        probs = kv.attention_probs(sub, at, step.q[over])                   # [B, Hq, N]
        counts = kv.num_tokens[sub, at].long()
        (b, hkv), n = counts.shape, probs.shape[-1]
        rows = sub.long()
        storage = self.decode_pool_order == "storage"
        key = self.ledger.scores[rows, at, :, :n] if storage else self.ledger.view(sub, at, n)[0].float()
        # the official top-k re-stores the prefix by descending pooled score, the window after it: the new keys
        index, keys = kv.pooled_victims(probs, counts, key, self.window, self.kernel, self.pooling, new_keys=storage)
        if keys is not None:
            self.ledger.scores[rows, at, :, :n] = keys
        heads = torch.arange(hkv, device=slots.device).expand(b, hkv)
        self.ledger.drop(kv, sub.view(-1, 1).expand(b, hkv).reshape(-1), step.rows_at(over, hkv), heads.reshape(-1),
                         index.reshape(-1))

    def after_decode_step(self, kv: KVView, step: DecodeLayers) -> None:
        """after_append over every managed layer's rows at once, each scored with its layer's own query: each row's
        attention is computed alone and the rest works along each row's own tokens (padding ranked last and kept
        out of the pool, the victim each row's first minimum), so no row depends on which rows share the pass."""
        self.after_append(kv, step.rows(self.managed_layers))

    def kv_stats(self, kv: KVView, seq: SeqInfo) -> dict[str, Any]:
        st = self._state.get(seq.slot)
        return {**super().kv_stats(kv, seq), "budget_tokens_per_layer": self.budget, "window": self.window,
                "window_counted": True, "layer_budgets": list(st.budgets) if st else [],
                "cascading": self.cascading, "allocation": self.allocation, "indicator": self.indicator,
                "tau": list(self.taus), "aggregation": self.aggregation, "decode_pool_order": self.decode_pool_order}


POLICY = Cake

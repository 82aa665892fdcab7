"""Runs the model over a prefill or decode batch, storing K/V in pages and calling the policy hooks per layer."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from systems.engine.config import DECODE_TILE, PREFILL_TILE
from systems.engine.kv_cache import TieredKVCache
from systems.engine.models.llama import LlamaModel
from systems.engine.sequence import Sequence
from systems.policies.base import DecodeStep, Policy, SeqInfo


class ModelRunner:
    def __init__(self, model: LlamaModel | None, kv: TieredKVCache, policy: Policy, attention_ops,
                 batch_invariant: bool = False):
        """`model` may be None for a runner that only runs decode_layer (decode_microbench)."""
        self.model, self.kv, self.policy, self.ops = model, kv, policy, attention_ops
        self.device = model.device if model is not None else kv.device
        self.last_selected: torch.Tensor | None = None     # the last layer's page sets (microbenchmarks count them)
        # fixed matmul shapes per phase (see config.PREFILL_TILE): a row's numbers never depend on its batch
        self.prefill_tile = PREFILL_TILE if batch_invariant else None
        self.decode_tile = DECODE_TILE if batch_invariant else None

    def _model(self) -> LlamaModel:
        if self.model is None:
            raise RuntimeError("this runner was made without a model: it only runs decode_layer")
        return self.model

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """Whole-prompt prefill of each sequence (no cached prefix); returns last-position logits [B, V]."""
        lengths = [len(s.token_ids) for s in seqs]
        ids = torch.tensor([t for s in seqs for t in s.token_ids], device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lengths])
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        infos = [s.info() for s in seqs]
        kv, policy = self.kv, self.policy

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            outs = []
            for i in range(len(seqs)):
                a, b = bounds[i], bounds[i + 1]
                qi, ki, vi = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
                # enable_gqa lets SDPA broadcast KV heads over their query group without a stored copy
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=kv.scale, enable_gqa=True)
                outs.append(o[0].transpose(0, 1))
                kv.store_prefill(infos[i].slot, layer, k[a:b], v[a:b])
                policy.after_prefill_layer(kv, infos[i], layer, q[a:b], k[a:b])
            return torch.cat(outs) if len(outs) > 1 else outs[0]

        hidden = self._model().forward(ids, positions, attend, tile=self.prefill_tile)
        last = torch.tensor([b - 1 for b in bounds[1:]], device=self.device)
        return self._model().logits(hidden[last], tile=self.decode_tile)

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """One token per sequence, the whole batch in one forward per layer; returns logits [B, V]."""
        ids = torch.tensor([s.token_ids[-1] for s in seqs], device=self.device)
        positions = torch.tensor([len(s.token_ids) - 1 for s in seqs], device=self.device)
        slots = torch.tensor([s.slot for s in seqs], device=self.device)
        infos = [s.info() for s in seqs]

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return self.decode_layer(layer, q, k, v, slots, infos)

        hidden = self._model().forward(ids, positions, attend, tile=self.decode_tile)
        return self._model().logits(hidden, tile=self.decode_tile)

    def decode_layer(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                     infos: list[SeqInfo], clock: Callable[[str], None] | None = None) -> torch.Tensor:
        """One layer of a decode step, as the engine runs it: append the new K/V, ask the policy which pages each
        head reads, attend to exactly those (all pages when it answers None), let the policy evict or promote.
        `clock(phase)` is called after append, select, attention and after_append (decode_microbench times them)."""
        kv, policy, ops = self.kv, self.policy, self.ops
        kv.append_decode(slots, layer, k, v)
        if clock:
            clock("append")
        step = DecodeStep(layer=layer, slots=slots, seqs=infos, q=q)
        selected = policy.select_pages(kv, step)
        if clock:
            clock("select")
        if selected is None:
            table, counts = kv.decode_tables(slots, layer)
            out = ops.paged_decode_attention(q, kv.k_pool, kv.v_pool, table, counts, kv.scale)
        else:
            table, counts = kv.block_table[slots, layer], kv.num_tokens[slots, layer]
            if selected.shape[1] != table.shape[1]:
                # per-query-head page sets: each query head gets its KV head's table row and reads only its own
                # pages (a group of one), from the same grouped K/V pools
                group = selected.shape[1] // table.shape[1]
                table, counts = table.repeat_interleave(group, 1), counts.repeat_interleave(group, 1)
            out = ops.sparse_decode_attention(q, kv.k_pool, kv.v_pool, table, counts, selected, kv.scale)
        self.last_selected = selected
        if clock:
            clock("attention")
        policy.after_append(kv, step)
        if clock:
            clock("after_append")
        return out

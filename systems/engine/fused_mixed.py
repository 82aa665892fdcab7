"""Mixed and prefill steps as fused C++ calls over the layer stack (ops/cpu_mixed.cpp).

Under load most of an online server's steps are mixed: a few decode rows beside a prompt chunk. Layer by layer from
Python such a step is ~40 torch calls per layer, whose dispatch cost a quarter of the step on a small model; the call
makes the same kernel calls on the same tensors, so a step's numbers are the per-op path's bit for bit. The decode rows
run as the fused decode step runs them: every page, or the pages of the policy's page rule (then its pages_chosen),
and a deferred eviction after the call. A policy's after-prefill hook sees each layer's queries of the prompt, kept
from the call; a step whose chunk finishes a prompt under it runs one layer per call with the hook between, as the
per-op path orders them (each layer's pages reserved just before its call, so a hook's released pages are free for the
next layer, as the policy's footprint assumes). What stays per op: a policy that chooses pages or evicts inside a layer
without a rule (the fused decode step's per-layer policies), sliding-window layers, extensions of a compressed context,
a position probe, and GEMMs whose shapes are tiled (batch-invariant mode tiles them).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from systems.engine.fused_decode import FusedDecode, layer_span
from systems.engine.kv_cache import TieredKVCache
from systems.engine.models.linear import widens
from systems.engine.models.llama import LlamaModel
from systems.engine.ops import cpu_kernels
from systems.policies.base import DecodeLayers, Policy, SeqInfo

if TYPE_CHECKING:
    from systems.engine.sequence import Sequence


def unsupported(model: LlamaModel, kv: TieredKVCache, decode: FusedDecode) -> str | None:
    """Why mixed steps cannot run fused for this model, cache and the fused decode step's policy, or None when they
    can."""
    if decode.per_layer:
        hooks = [name for name in ("select_pages", "after_append")
                 if getattr(type(decode.policy), name) is not getattr(Policy, name)]
        return f"the policy's {', '.join(hooks)} runs between the pieces of a layer"
    if any(w is not None for w in model.spec.layer_windows):
        return "sliding-window layers"
    if not hasattr(torch.ops.kvharness_cpu, "mixed_layers"):
        return "the mixed-step kernel is not built"
    return None


class FusedMixed:
    """Mixed and prefill steps of one engine's model over its paged cache, under the fused decode step's policy."""

    def __init__(self, model: LlamaModel, kv: TieredKVCache, decode: FusedDecode, prompt_hook: bool):
        self.model, self.kv, self.decode = model, kv, decode
        self.rope_table = next(iter(model.rope_tables))
        self.steps = 0                  # steps run fused (tests and benchmarks check the path was taken)
        self.last_selected: torch.Tensor | None = None      # the decode rows' sets at the last layer (None: all)
        self._prompt_hook = prompt_hook      # the runner's Policy.hooks_prefill()
        # the operand list depends on a step's rows only through the widened GEMM's threshold: built once per side
        self._operands: dict[bool, tuple[int, list[torch.Tensor]] | None] = {}

    @property
    def policy(self) -> Policy:
        """The fused decode step's policy (Engine.set_policy swaps it there)."""
        return self.decode.policy

    def takes(self, chunks: list[tuple[Sequence, int, int]]) -> bool:
        """Whether this step can run fused: every chunk is prefill and no probe follows stored positions."""
        return self.kv.positions is None and all(a < seq.compress_end for seq, a, _ in chunks)

    def _weights(self, rows: int) -> tuple[int, list[torch.Tensor]] | None:
        """The GEMM kind every product takes at `rows` rows and each layer's 7 operands (ln1, qkv, qkv bias, o,
        ln2, gate_up, down), or None where the products do not all multiply the same way."""
        wide = widens(rows)
        if wide not in self._operands:
            self._operands[wide] = self._gather_weights(rows)
        return self._operands[wide]

    def _gather_weights(self, rows: int) -> tuple[int, list[torch.Tensor]] | None:
        empty = torch.empty(0, dtype=self.model.dtype)
        kinds: set[int] = set()
        flat: list[torch.Tensor] = []
        for lw in self.model.layers:
            qkv, o, gate_up, down = (m.gemm_operands(rows) for m in (lw.qkv, lw.o, lw.gate_up, lw.down))
            kinds.update(kind for kind, _, _ in (qkv, o, gate_up, down))
            flat += [lw.ln1, qkv[1], qkv[2] if qkv[2] is not None else empty, o[1], lw.ln2, gate_up[1], down[1]]
        return (kinds.pop(), flat) if len(kinds) == 1 else None

    def hidden(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, infos: list[SeqInfo],
               chunks: list[tuple[Sequence, SeqInfo, int, int]]) -> torch.Tensor | None:
        """The final-normed hidden states [T, hidden] of the decode rows (one per slot, `infos` theirs, K/V appended)
        then every chunk's rows (sequence, its info, start, end: K/V stored), as LlamaModel.forward with the runner's
        attend returns them; None (nothing changed) where the products would not all take one GEMM kind or the policy
        states no rule for this step's decode rows."""
        model, kv, policy, spec = self.model, self.kv, self.policy, self.model.spec
        weights = self._weights(len(ids))
        if weights is None or self.decode.per_layer:        # (a test may turn the decode step's rule off)
            return None
        kind, flat = weights
        nd, L = len(infos), spec.num_layers
        rule = policy.decode_page_rule(kv, DecodeLayers(slots=slots, seqs=infos, q=None)) \
            if nd and self.decode.page_rule else None
        if nd and self.decode.page_rule and rule is None:
            return None
        deferred = bool(nd) and self.decode.deferred
        step_queries = (rule is not None or deferred) and policy.step_queries
        keep_queries = step_queries or (self._prompt_hook and bool(chunks))
        shape = (len(ids), spec.num_q_heads, spec.head_dim)
        decode_q = torch.empty(L, nd, *shape[1:], dtype=model.dtype) if step_queries else None
        chosen, rule_args = self.decode.rule_args(rule, nd)
        rows = [nd]
        for _, _, a, b in chunks:
            rows.append(rows[-1] + b - a)
        # a chunk that finishes its prompt under an after-prefill hook: one layer per call, the hook between
        finishing = self._prompt_hook and any(b >= seq.compress_end for seq, _, _, b in chunks)
        spans = [(layer, layer + 1) for layer in range(L)] if finishing else [(0, L)]
        cos, sin = model.rope(positions, self.rope_table)
        h = torch.nn.functional.embedding(ids, model.embed)
        cut = [(info.slot, a, b) for _, info, a, b in chunks]
        chunk_slots, starts, ends = ([c[i] for c in cut] for i in range(3))
        decode_slots = slots.to(torch.int64).contiguous()
        delta = None
        for first, last in spans:
            # each layer's pages before its call, in the per-op path's order (layer, then chunk): the same blocks
            for layer in range(first, last):
                for slot, a, b in cut:
                    kv.reserve_prompt_pages(slot, layer, a, b - a)
            # the call's layers only: a whole prompt prefilled layer by layer never holds every layer's queries
            queries = torch.empty(last - first, *shape, dtype=model.dtype) if keep_queries else None
            delta = torch.ops.kvharness_cpu.mixed_layers(
                h, delta, flat, kind, cos, sin, kv.k_pool, kv.v_pool, kv.block_table, kv.num_tokens, kv.kmin,
                kv.kmax, decode_slots, chunk_slots, starts, ends, spec.num_q_heads, spec.intermediate_size,
                spec.rms_norm_eps, kv.scale, cpu_kernels.bf16_prompt_kernel(), first, last, queries,
                *layer_span(rule_args, first, last))
            if queries is not None and decode_q is not None:
                decode_q[first:last] = queries[:, :nd]
            if queries is not None and self._prompt_hook:
                for layer in range(first, last):
                    self._after_prompt_layer(layer, chunks, queries[layer - first], rows)
        self.steps += 1
        self.last_selected = chosen[-1] if rule is not None and L - 1 in rule.layers else None
        if rule is not None:
            policy.pages_chosen(kv, DecodeLayers(slots=slots, seqs=infos, q=decode_q), rule, chosen)
        if deferred:
            policy.after_decode_step(kv, DecodeLayers(slots=slots, seqs=infos, q=decode_q))
        return model.add_norm(h, delta, model.norm)[1]

    def _after_prompt_layer(self, layer: int, chunks: list[tuple[Sequence, SeqInfo, int, int]], q: torch.Tensor,
                            rows: list[int]) -> None:
        """The runner's after-prefill work at one layer the policy manages: a chunk's queries are kept until its
        prompt's last chunk, which hands the hook the whole prompt's queries and keys."""
        if not self.policy.manages(layer):
            return
        for i, (seq, info, _, b) in enumerate(chunks):
            rows_q = q[rows[i]:rows[i + 1]]
            if b < seq.compress_end:
                seq.prompt_q.setdefault(layer, []).append(rows_q.clone())
                continue
            parts = seq.prompt_q.pop(layer, [])
            q_all = torch.cat([*parts, rows_q]) if parts else rows_q
            self.policy.after_prefill_layer(self.kv, info, layer, q_all, self.kv.prompt_kv(info.slot, layer, b)[0])

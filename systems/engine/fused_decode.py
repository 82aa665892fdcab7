"""The CPU decode step as fused C++ layers (ops/cpu_decoder.cpp): one call per step, or two per layer around a policy.

A policy that reads every page and evicts nothing at decode time gets the whole layer stack in one call, and so do
one whose page choice is a rule stated as data (`decode_page_rule`: the call runs it between each layer's append and
attention, then hands the chosen sets to `pages_chosen`, which also does the after-attention work after_append would
have done: FlexiCache's reranks and tier copies) and one that evicts once per step (`after_decode_step`, run
after the call, with each layer's q kept by it when the policy scores with them): nothing reads a layer's cache
between its attention and the end of a fused step, so its eviction then sees and does exactly what its per-layer
`after_append` would have. A policy with other decode-time hooks gets, per layer, `decode_layer_in` (norm, QKV,
RoPE, KV append: returns q), its `select_pages`, `decode_layer_attend` (attention over exactly the pages it chose),
`decode_layer_mlp` (output projection and MLP) and its `after_append` — the hook order of the per-op path
(`after_append` runs after the MLP instead of before it, which nothing can observe: the MLP does not touch the KV
cache). Every product is the skinny GEMM of ops/cpu_gemm.cpp, whose rows never depend on the batch, so
batch-invariant mode needs no padded tiles here.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from systems.engine.kv_cache import TieredKVCache
from systems.engine.models.linear import Linear
from systems.engine.models.llama import LlamaModel
from systems.engine.ops import cpu_kernels
from systems.policies.base import DecodeLayers, DecodeStep, PageRule, Policy, SeqInfo

if TYPE_CHECKING:
    from systems.engine.probe import PositionProbe


def unsupported(model: LlamaModel, kv: TieredKVCache) -> str | None:
    """Why the fused step cannot run this model and cache here, or None when it can."""
    s = model.spec
    if model.device.type != "cpu":
        return "not a CPU device"
    if model.dtype not in (torch.bfloat16, torch.float32) or kv.dtype != model.dtype:
        return f"dtype {model.dtype} (bf16 or fp32 only)"
    fam = s.family
    if (fam.qk_norm or fam.unit_offset_norm or fam.sandwich_norms or fam.scaled_embedding or s.activation != "silu"
            or s.o_bias or s.final_logit_softcapping is not None or len(model.rope_tables) != 1):
        return f"model family {s.model_type!r} (the fused step runs the plain Llama decoder layer)"
    if getattr(model, "fused", None) is None:
        return "the fused elementwise kernels are not built"
    if not cpu_kernels.has_fused_decode():
        return "the CPU kernels are not built"
    if (s.head_dim not in cpu_kernels.HEAD_DIMS or kv.page_size > cpu_kernels.MAX_PAGE
            or s.num_q_heads // s.num_kv_heads > cpu_kernels.MAX_GROUP):
        return "head_dim, page size or query group outside the compiled kernels"
    return None


class FusedDecode:
    """Decode steps of one engine's model over its paged cache, under its policy."""

    def __init__(self, model: LlamaModel, kv: TieredKVCache, policy: Policy):
        self.model, self.kv, self.policy = model, kv, policy
        empty = torch.empty(0, dtype=model.dtype)
        def packed(linear: Linear) -> torch.Tensor:
            weight = linear.skinny_weight
            assert weight is not None          # unsupported() said the kernels are built
            return weight

        # the products' weights in the skinny GEMM's panel layout (packed once, kept by each Linear)
        self.layers = [(lw.ln1, packed(lw.qkv), lw.qkv.bias if lw.qkv.bias is not None else empty, packed(lw.o),
                        lw.ln2, packed(lw.gate_up), packed(lw.down)) for lw in model.layers]
        self.lm_head = packed(model.lm_head)
        self.flat_weights = [t for layer in self.layers for t in layer]
        # False: a policy that could evict once per step runs its per-layer hooks (what deferring must equal)
        self.defer = True
        # False: a policy with a page rule answers select_pages layer by layer (what running the rule must equal)
        self.rules = True
        self.windows = [w or 0 for w in model.spec.layer_windows]
        self.rope_table = next(iter(model.rope_tables))
        self.last_selected: torch.Tensor | None = None

    @property
    def deferred(self) -> bool:
        """Whether the policy's decode-time eviction runs once after the whole stack (after_decode_step)."""
        return self.defer and self.policy.defers_eviction() and not self.policy.overrides("select_pages")

    @property
    def page_rule(self) -> bool:
        """Whether the policy's page choice runs inside the fused call, as the rule decode_page_rule states."""
        return self.rules and self.policy.overrides("decode_page_rule")

    @property
    def per_layer(self) -> bool:
        """Whether a step runs layer by layer, with the policy's hooks between the calls (policies that keep
        Policy's no-op decode hooks, state a page rule, or evict once per step, run the whole stack in one call)."""
        chooses = self.policy.overrides("select_pages") and not self.page_rule
        # a rule's step runs no after_append: pages_chosen does that work after the step (Policy.decode_page_rule)
        evicts = self.policy.overrides("after_append") and not self.deferred and not self.page_rule
        return chooses or evicts

    def logits(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, infos: list[SeqInfo],
               clock: Callable[[str], None] | None = None, probe: PositionProbe | None = None) -> torch.Tensor:
        """One token per sequence: appends its K/V in every layer and returns fp32 logits [B, V] (computed in the
        model dtype, as the per-op path's). `clock(phase)` after each phase of each layer (append, select,
        attention, rest) forces the per-layer calls. `probe` sees each layer's page choice (engine/probe.py)."""
        ops, kv, model, spec = torch.ops.kvharness_cpu, self.kv, self.model, self.model.spec
        cos, sin = model.rope(positions, self.rope_table)
        h = F.embedding(ids, model.embed).contiguous()
        eps, nq, inter = spec.rms_norm_eps, spec.num_q_heads, spec.intermediate_size
        store = (kv.k_pool, kv.v_pool, kv.block_table, kv.num_tokens, kv.kmin, kv.kmax)
        slots = slots.to(torch.int64).contiguous()
        delta: torch.Tensor | None = None
        whole, rule = not self.per_layer and clock is None, None
        if whole and self.page_rule:
            rule = self.policy.decode_page_rule(kv, DecodeLayers(slots=slots, seqs=infos, q=None))
            whole = rule is not None
        if whole:
            deferred, queries = self.deferred, None
            if (deferred or rule is not None) and self.policy.step_queries:
                queries = torch.empty(len(self.layers), len(infos), nq, spec.head_dim, dtype=model.dtype)
            chosen, rule_args = self.rule_args(rule, len(infos))
            delta = ops.decode_layers(h, None, self.flat_weights, cos, sin, *store, slots, 0, len(self.layers), nq,
                                      inter, eps, kv.scale, self.windows, queries, *rule_args)
            covered = set(rule.layers) if rule is not None else set()
            if probe is not None:            # no hook ran inside the call: each layer read its rule's sets or all
                for layer in range(len(self.layers)):
                    probe.observe(layer, infos, chosen[layer] if layer in covered else None,
                                  self.windows[layer] or None)
            if rule is not None:
                self.last_selected = chosen[-1] if len(self.layers) - 1 in covered else None
                self.policy.pages_chosen(kv, DecodeLayers(slots=slots, seqs=infos, q=queries), rule, chosen)
            if deferred:
                self.policy.after_decode_step(kv, DecodeLayers(slots=slots, seqs=infos, q=queries))
        else:
            for layer, (ln1, qkv, bias, o, ln2, gate_up, down) in enumerate(self.layers):
                q = ops.decode_layer_in(h, delta, ln1, qkv, bias if bias.numel() else None, cos, sin, *store, slots,
                                        layer, nq, eps)
                if clock:
                    clock("append")
                step = DecodeStep(layer=layer, slots=slots, seqs=infos, q=q)
                managed = self.policy.manages(layer)       # a layer left to its window reads all it holds
                selected = self.policy.select_pages(kv, step) if managed else None
                self.last_selected = selected
                if probe is not None:
                    probe.observe(layer, infos, selected, self.windows[layer] or None)
                if clock:
                    clock("select")
                attn = ops.decode_layer_attend(q, selected, *store, slots, layer, kv.scale, self.windows[layer])
                if clock:
                    clock("attention")
                delta = ops.decode_layer_mlp(h, attn, o, ln2, gate_up, down, inter, eps)
                if managed:
                    self.policy.after_append(kv, step)
                if clock:
                    clock("rest")
        return ops.decode_logits(h, delta, model.norm, self.lm_head, model.lm_head.weight.shape[0], eps).float()

    def rule_args(self, rule: PageRule | None, batch: int) -> tuple[torch.Tensor, list]:
        """decode_layers' page-rule arguments (none without a rule) and the [L, B, sets, K] tensor it fills; the
        MinMax bytes the rule's scoring reads are counted here, as kv.ranked_pages / top_pages count them."""
        if rule is None or not rule.layers:
            return torch.empty(0), []
        kv = self.kv
        shape = rule.sets_shape(batch)
        chosen = torch.full((len(self.layers), *shape), -1, dtype=torch.long)
        kv.minmax_bytes_read += rule.scored_sets() * batch * rule.width * kv.minmax_bytes_per_page
        covered = set(rule.layers)
        flags = [int(layer in covered) for layer in range(len(self.layers))]
        return chosen, [chosen, flags, rule.heads, torch.tensor(rule.k, dtype=torch.long), rule.width, rule.ranked,
                        rule.keep_last, rule.held, list(rule.held_widths), rule.scored]


def layer_span(rule_args: list, first: int, last: int) -> list:
    """FusedDecode.rule_args for a call over layers first .. last - 1 only: its flags and held widths per layer from
    `first` (chosen, held and scored stay indexed by the stack's layer)."""
    if not rule_args:
        return rule_args
    chosen, flags, heads, k, width, ranked, keep_last, held, widths, scored = rule_args
    return [chosen, flags[first:last], heads, k, width, ranked, keep_last, held, widths[first:last], scored]

"""Mixed and prefill steps as one fused C++ call over the layer stack (ops/cpu_mixed.cpp).

Under load most of an online server's steps are mixed: a few decode rows beside a prompt chunk. Layer by layer from
Python such a step is ~40 torch calls per layer, whose dispatch cost a quarter of the step on a small model; the call
makes the same kernel calls on the same tensors from C++, so a step's numbers are the per-op path's bit for bit. It
serves what needs nothing between the pieces of a layer: a policy with no page choice, no decode-time eviction and no
after-prefill hook (dense), layers without sliding windows, prompt chunks that are prefill (not the extension of a
compressed context), no position probe, and GEMMs whose shapes are not tiled (batch-invariant mode tiles them).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from systems.engine.kv_cache import TieredKVCache
from systems.engine.models.linear import widens
from systems.engine.models.llama import LlamaModel
from systems.engine.ops import cpu_kernels
from systems.policies.base import Policy

if TYPE_CHECKING:
    from systems.engine.sequence import Sequence


def unsupported(model: LlamaModel, kv: TieredKVCache, policy: Policy) -> str | None:
    """Why mixed steps cannot run fused for this model, cache and policy (the fused decode step's conditions are
    assumed met), or None when they can."""
    hooks = [name for name in ("select_pages", "after_append", "after_prefill_layer")
             if getattr(type(policy), name) is not getattr(Policy, name)]
    if hooks:
        return f"the policy's {', '.join(hooks)} runs between the pieces of a layer"
    if any(w is not None for w in model.spec.layer_windows):
        return "sliding-window layers"
    if not hasattr(torch.ops.kvharness_cpu, "mixed_layers"):
        return "the mixed-step kernel is not built"
    return None


class FusedMixed:
    """Mixed and prefill steps of one engine's model over its paged cache."""

    def __init__(self, model: LlamaModel, kv: TieredKVCache):
        self.model, self.kv = model, kv
        self.rope_table = next(iter(model.rope_tables))
        self.steps = 0                  # steps run fused (tests and benchmarks check the path was taken)
        # the operand list depends on a step's rows only through the widened GEMM's threshold: built once per side
        self._operands: dict[bool, tuple[int, list[torch.Tensor]] | None] = {}

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

    def hidden(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
               chunks: list[tuple[int, int, int]]) -> torch.Tensor | None:
        """The final-normed hidden states [T, hidden] of the decode rows (one per slot, K/V appended) then every
        chunk's rows (slot, start, end: K/V stored), as LlamaModel.forward with the runner's attend returns them;
        None (nothing changed) where the products would not all take one GEMM kind."""
        model, kv, spec = self.model, self.kv, self.model.spec
        weights = self._weights(len(ids))
        if weights is None:
            return None
        kind, flat = weights
        # every layer's pages before the call, in the per-op path's order (layer, then chunk): the same blocks
        for layer in range(spec.num_layers):
            for slot, a, b in chunks:
                kv.reserve_prompt_pages(slot, layer, a, b - a)
        cos, sin = model.rope(positions, self.rope_table)
        h = torch.nn.functional.embedding(ids, model.embed)
        delta = torch.ops.kvharness_cpu.mixed_layers(
            h, None, flat, kind, cos, sin, kv.k_pool, kv.v_pool, kv.block_table, kv.num_tokens, kv.kmin, kv.kmax,
            slots.to(torch.int64).contiguous(), [slot for slot, _, _ in chunks], [a for _, a, _ in chunks],
            [b for _, _, b in chunks], spec.num_q_heads, spec.intermediate_size, spec.rms_norm_eps, kv.scale,
            cpu_kernels.bf16_prompt_kernel())
        self.steps += 1
        return model.add_norm(h, delta, model.norm)[1]

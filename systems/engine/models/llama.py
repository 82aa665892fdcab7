"""The engine's decoder over flattened tokens: Llama 3.x, Mistral, Qwen2, Qwen3, SmolLM2 and Gemma 3, weights from
HF safetensors.

All of these are the Llama decoder with small, declared differences (models/spec.py's Family: q/k norms, (1 + w)
norms, sandwich norms, scaled embeddings, the MLP's activation, per-layer RoPE and sliding windows), so one forward
serves them all and a family is a row of flags, not a copy of the forward.

The model knows nothing of the KV cache: each layer hands its post-RoPE q, k, v to an `attend(layer, q, k, v)`
callable supplied by the model runner, which stores K/V in pages and computes attention with the layer's window
(spec.layer_windows) and the model's softmax scale (spec.attn_scale).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open

from systems.engine.models.linear import Linear
from systems.engine.models.spec import ModelSpec, rope_inv_freq

__all__ = ["LayerWeights", "LlamaModel", "ModelSpec", "fused_cpu_steps", "rotate_half"]


def fused_cpu_steps(device: torch.device, dtype: torch.dtype) -> Any:
    """The fused elementwise CPU kernels (residual add + RMSNorm, RoPE, SiLU gate: ops/cpu_model.cpp) where they are
    built, else None (the torch expressions below, which round identically)."""
    if torch.device(device).type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        return None
    from systems.engine.ops import cpu_kernels

    return torch.ops.kvharness_cpu if cpu_kernels.available() and cpu_kernels.has_model_steps() else None


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@dataclass
class LayerWeights:
    ln1: torch.Tensor                   # before attention (input_layernorm)
    ln2: torch.Tensor                   # before the MLP (Llama's post_attention_layernorm, Gemma's pre_feedforward)
    qkv: Linear                         # q, k and v projections stacked (with their biases): one matmul
    o: Linear
    gate_up: Linear                     # gate and up projections stacked
    down: Linear
    qk_norm: torch.Tensor | None = None         # [Hq + Hkv, D]: q_norm's weight per q head, then k_norm's per k head
    attn_out_norm: torch.Tensor | None = None   # on the attention output before its residual add (Gemma 3)
    mlp_out_norm: torch.Tensor | None = None    # on the MLP output before its residual add (Gemma 3)


class LlamaModel:
    """Norm weights as plain tensors, projections as Linear; q/k/v and gate/up stacked so each is one matmul."""

    def __init__(self, model_dir: str | Path, dtype: torch.dtype, device: torch.device, autograd: bool = False):
        """`autograd`: plain torch ops throughout, so gradients flow through forward (gate training); otherwise the
        fused CPU kernels and prepacked weights, which have none."""
        self.spec = spec = ModelSpec.from_dir(model_dir)
        fam = spec.family
        self.dtype, self.device = dtype, device
        w = self._load(Path(model_dir))
        pre = next((p for p in spec.weight_prefixes if p + "embed_tokens.weight" in w), None)
        if pre is None:
            raise ValueError(f"{model_dir}: no embed_tokens.weight under {list(spec.weight_prefixes)}; the "
                             "checkpoint's tensor names are not a supported layout")

        def get(name: str) -> torch.Tensor:
            if name not in w:
                raise ValueError(f"{model_dir}: tensor {name!r} is missing from the checkpoint its config describes")
            return w[name]

        def linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
            return Linear(weight, bias, prepack=not autograd)

        def norm(name: str) -> torch.Tensor:
            # (1 + w) kept in fp32: Gemma multiplies before casting back, so the sum must not round to the dtype
            return 1.0 + get(name).float() if fam.unit_offset_norm else get(name)

        self.embed = get(pre + "embed_tokens.weight")
        # Gemma scales embeddings by sqrt(hidden) after casting that factor to the weight dtype (25.25 in bf16 for 640)
        self.embed_scale = (torch.tensor(spec.hidden_size ** 0.5).to(dtype) if fam.scaled_embedding else None)
        self.norm = norm(pre + "norm.weight")
        self.lm_head = linear(self.embed if spec.tie_word_embeddings else w.get("lm_head.weight", self.embed))
        self.layers: list[LayerWeights] = []
        for i in range(spec.num_layers):
            p = f"{pre}layers.{i}."
            a = p + "self_attn."
            qkv_b = torch.cat([get(a + f"{n}_proj.bias") for n in "qkv"]) if spec.qkv_bias else None
            layer = LayerWeights(
                ln1=norm(p + "input_layernorm.weight"),
                ln2=norm(p + ("pre_feedforward_layernorm.weight" if fam.sandwich_norms
                              else "post_attention_layernorm.weight")),
                qkv=linear(torch.cat([get(a + f"{n}_proj.weight") for n in "qkv"]), qkv_b),
                o=linear(get(a + "o_proj.weight"), get(a + "o_proj.bias") if spec.o_bias else None),
                gate_up=linear(torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])),
                down=linear(get(p + "mlp.down_proj.weight")))
            if fam.qk_norm:
                layer.qk_norm = torch.cat([norm(a + "q_norm.weight").expand(spec.num_q_heads, -1),
                                           norm(a + "k_norm.weight").expand(spec.num_kv_heads, -1)])
            if fam.sandwich_norms:
                layer.attn_out_norm = norm(p + "post_attention_layernorm.weight")
                layer.mlp_out_norm = norm(p + "post_feedforward_layernorm.weight")
            self.layers.append(layer)
        # one cos/sin table per distinct RoPE (Gemma 3: local and global bases); each layer names its table
        keys = {t: json.dumps(r, sort_keys=True) for t, r in spec.ropes.items()}
        self.rope_tables: dict[str, tuple[torch.Tensor, float]] = {}
        for t, key in keys.items():
            inv, scaling = rope_inv_freq(spec.ropes[t], spec.head_dim)
            self.rope_tables[key] = (inv.to(device), scaling)
        self.layer_rope = [keys[t] for t in spec.layer_types]
        self.fused = None if autograd else fused_cpu_steps(self.device, dtype)
        # the fused norm rounds as Llama does (to the dtype, then times w); Gemma's (1 + w) norm stays in torch
        self.fused_norm = None if fam.unit_offset_norm else self.fused
        self.fused_silu = self.fused if spec.activation == "silu" else None

    def _load(self, folder: Path) -> dict[str, torch.Tensor]:
        """The decoder's tensors (a multimodal checkpoint's vision tower is never read)."""
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {folder}: convert the checkpoint to safetensors first")
        wanted = (*self.spec.weight_prefixes, "lm_head.")
        out = {}
        for f in files:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():
                    if name.startswith(wanted):
                        out[name] = fh.get_tensor(name).to(device=self.device, dtype=self.dtype)
        return out

    def rope(self, positions: torch.Tensor, table: str) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D] ([T, D] for the fused CPU steps) of one RoPE table at the given positions, computed in
        fp32 as HF does, then cast to the model dtype."""
        inv_freq, scaling = self.rope_tables[table]
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * scaling).to(self.dtype)
        sin = (emb.sin() * scaling).to(self.dtype)
        return (cos, sin) if self.fused is not None else (cos[:, None, :], sin[:, None, :])

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm over the last dim; `weight` broadcasts (per-head [H, D] weights for q/k norms)."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.spec.rms_norm_eps)
        if self.spec.family.unit_offset_norm:
            return (xf * weight).to(x.dtype)
        return weight * xf.to(x.dtype)

    def add_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream after adding `delta`, and its RMSNorm (one fused pass on CPU, h updated in place)."""
        if self.fused_norm is not None:
            return h, self.fused_norm.add_rms_norm(h, delta, weight, self.spec.rms_norm_eps)
        if delta is not None:
            h = h + delta
        return h, self.rms_norm(h, weight)

    def rotate(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE over q and k heads [T, H, D] together (in place on CPU)."""
        if self.fused is not None:
            self.fused.rope_(qk, cos, sin)
            return qk
        return qk * cos + rotate_half(qk) * sin

    def gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up of the stacked gate/up projection [T, 2I]."""
        if self.fused_silu is not None:
            return self.fused_silu.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        if self.spec.activation == "silu":
            return F.silu(gate) * up
        return F.gelu(gate, approximate="tanh") * up

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                tile: int | None = None, decode: bool = False) -> torch.Tensor:
        """input_ids, positions: [T]; returns the final-normed hidden states [T, hidden]. `tile`: rows per matmul
        call (see Linear); None = one call over all T rows. `decode`: the rows are decode tokens, multiplied by
        Linear.rows (the fused decode step's arithmetic)."""
        if self.fused is not None and torch.is_grad_enabled():
            raise RuntimeError("the fused CPU kernels have no gradients: run under torch.inference_mode(), or build "
                               "the model with LlamaModel(..., autograd=True)")
        s = self.spec
        T = input_ids.shape[0]
        nq, nkv, d = s.num_q_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.head_dim
        tables = {key: self.rope(positions, key) for key in self.rope_tables}
        h = F.embedding(input_ids, self.embed)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        delta = None
        for i, lw in enumerate(self.layers):
            qkv_mm, o_mm, gate_up_mm, down_mm = ((lw.qkv.rows, lw.o.rows, lw.gate_up.rows, lw.down.rows) if decode
                                                 else (lw.qkv, lw.o, lw.gate_up, lw.down))
            h, x = self.add_norm(h, delta, lw.ln1)
            qkv = qkv_mm(x, tile)
            qk = qkv[:, :nq + nkv].view(T, s.num_q_heads + s.num_kv_heads, d)
            if lw.qk_norm is not None:
                qk = self.rms_norm(qk, lw.qk_norm)
            qk = self.rotate(qk, *tables[self.layer_rope[i]])
            q, k = qk[:, :s.num_q_heads], qk[:, s.num_q_heads:]
            v = qkv[:, nq + nkv:].reshape(T, s.num_kv_heads, d)
            delta = o_mm(attend(i, q, k, v).reshape(T, nq), tile)
            if lw.attn_out_norm is not None:
                delta = self.rms_norm(delta, lw.attn_out_norm)
            h, x = self.add_norm(h, delta, lw.ln2)
            delta = down_mm(self.gated(gate_up_mm(x, tile)), tile)
            if lw.mlp_out_norm is not None:
                delta = self.rms_norm(delta, lw.mlp_out_norm)
        return self.add_norm(h, delta, self.norm)[1]

    def logits(self, hidden: torch.Tensor, tile: int | None = None) -> torch.Tensor:
        """fp32 logits of a few final hidden rows (the last prompt rows, decode rows), through Linear.rows: the
        same arithmetic whichever step produced the row."""
        out = self.lm_head.rows(hidden, tile)
        cap = self.spec.final_logit_softcapping
        if cap is not None:
            out = torch.tanh(out / cap) * cap
        return out.float()

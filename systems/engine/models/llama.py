"""Llama-family decoder (Llama 3.x, Mistral, Qwen2, SmolLM2) over flattened tokens, weights from HF safetensors.

The model knows nothing of the KV cache: each layer hands its post-RoPE q, k, v to an `attend(layer, q, k, v)`
callable supplied by the model runner, which stores K/V in pages and computes attention.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open

from systems.engine.models.linear import Linear

SUPPORTED = ("llama", "mistral", "qwen2")


@dataclass
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    rope: dict
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelSpec:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: pass a local HF model folder (config.json + *.safetensors)")
        cfg = json.loads(path.read_text())
        kind = cfg.get("model_type")
        if kind not in SUPPORTED:
            raise ValueError(f"model_type {kind!r} is not supported by the engine; supported: {list(SUPPORTED)}")
        if kind == "qwen2" and cfg.get("use_sliding_window"):
            raise ValueError("Qwen2 sliding-window attention is not implemented; set use_sliding_window=false")
        if kind == "mistral" and cfg.get("sliding_window") not in (None, 0):
            if cfg["sliding_window"] < cfg.get("max_position_embeddings", 0):
                raise ValueError("Mistral sliding-window attention is not implemented; use a checkpoint with "
                                 "sliding_window=null (Mistral v0.2+)")
        if cfg.get("hidden_act", "silu") != "silu" or cfg.get("mlp_bias"):
            raise ValueError("only SiLU-gated MLPs without bias are supported")
        heads = cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
        eos = cfg.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        return cls(
            model_type=kind, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"], num_q_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, rms_norm_eps=cfg["rms_norm_eps"],
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=kind == "qwen2" or bool(cfg.get("attention_bias", False)), rope=rope, eos_token_ids=eos)


def rope_inv_freq(spec: ModelSpec) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for the config's rope type (default, linear, llama3)."""
    dim = spec.head_dim
    rope = spec.rope
    inv = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / rope["factor"], 1.0
    if kind == "llama3":
        factor, old_len = rope["factor"], rope["original_max_position_embeddings"]
        low, high = rope["low_freq_factor"], rope["high_freq_factor"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled), 1.0
    raise ValueError(f"rope_type {kind!r} is not supported by the engine; supported: default, linear, llama3")


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
    ln1: torch.Tensor
    ln2: torch.Tensor
    qkv: Linear                         # q, k and v projections stacked (with Qwen2's bias): one matmul
    o: Linear
    gate_up: Linear                     # gate and up projections stacked
    down: Linear


class LlamaModel:
    """Norm weights as plain tensors, projections as Linear; q/k/v and gate/up stacked so each is one matmul."""

    def __init__(self, model_dir: str | Path, dtype: torch.dtype, device: torch.device, autograd: bool = False):
        """`autograd`: plain torch ops throughout, so gradients flow through forward (gate training); otherwise the
        fused CPU kernels and prepacked weights, which have none."""
        self.spec = spec = ModelSpec.from_dir(model_dir)
        self.dtype, self.device = dtype, device
        w = self._load(Path(model_dir))
        pre = "model."
        self.embed = w[pre + "embed_tokens.weight"]
        self.norm = w[pre + "norm.weight"]
        def linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
            return Linear(weight, bias, prepack=not autograd)

        self.lm_head = linear(self.embed if spec.tie_word_embeddings else w.get("lm_head.weight", self.embed))
        self.layers: list[LayerWeights] = []
        for i in range(spec.num_layers):
            p = f"{pre}layers.{i}."
            a = p + "self_attn."
            qkv_b = (torch.cat([w[a + f"{n}_proj.bias"] for n in "qkv"]) if spec.qkv_bias else None)
            self.layers.append(LayerWeights(
                ln1=w[p + "input_layernorm.weight"], ln2=w[p + "post_attention_layernorm.weight"],
                qkv=linear(torch.cat([w[a + f"{n}_proj.weight"] for n in "qkv"]), qkv_b),
                o=linear(w[a + "o_proj.weight"]),
                gate_up=linear(torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])),
                down=linear(w[p + "mlp.down_proj.weight"])))
        inv, self.rope_scaling = rope_inv_freq(spec)
        self.inv_freq = inv.to(device)
        self.fused = None if autograd else fused_cpu_steps(self.device, dtype)

    def _load(self, folder: Path) -> dict[str, torch.Tensor]:
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {folder}: convert the checkpoint to safetensors first")
        out = {}
        for f in files:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():
                    out[name] = fh.get_tensor(name).to(device=self.device, dtype=self.dtype)
        return out

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D] ([T, D] for the fused CPU steps) for the given positions, computed in fp32 as HF
        does, then cast to the model dtype."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scaling).to(self.dtype)
        sin = (emb.sin() * self.rope_scaling).to(self.dtype)
        return (cos, sin) if self.fused is not None else (cos[:, None, :], sin[:, None, :])

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.spec.rms_norm_eps)
        return weight * xf.to(x.dtype)

    def add_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream after adding `delta`, and its RMSNorm (one fused pass on CPU, h updated in place)."""
        if self.fused is not None:
            return h, self.fused.add_rms_norm(h, delta, weight, self.spec.rms_norm_eps)
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
        """silu(gate) * up of the stacked gate/up projection [T, 2I]."""
        if self.fused is not None:
            return self.fused.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                tile: int | None = None) -> torch.Tensor:
        """input_ids, positions: [T]; returns the final-normed hidden states [T, hidden]. `tile`: rows per matmul
        call (see Linear); None = one call over all T rows."""
        if self.fused is not None and torch.is_grad_enabled():
            raise RuntimeError("the fused CPU kernels have no gradients: run under torch.inference_mode(), or build "
                               "the model with LlamaModel(..., autograd=True)")
        s = self.spec
        T = input_ids.shape[0]
        nq, nkv, d = s.num_q_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.head_dim
        cos, sin = self.rope(positions)
        h = F.embedding(input_ids, self.embed)
        delta = None
        for i, lw in enumerate(self.layers):
            h, x = self.add_norm(h, delta, lw.ln1)
            qkv = lw.qkv(x, tile)
            qk = self.rotate(qkv[:, :nq + nkv].view(T, s.num_q_heads + s.num_kv_heads, d), cos, sin)
            q, k = qk[:, :s.num_q_heads], qk[:, s.num_q_heads:]
            v = qkv[:, nq + nkv:].reshape(T, s.num_kv_heads, d)
            o = attend(i, q, k, v)
            h, x = self.add_norm(h, lw.o(o.reshape(T, nq), tile), lw.ln2)
            delta = lw.down(self.gated(lw.gate_up(x, tile)), tile)
        return self.add_norm(h, delta, self.norm)[1]

    def logits(self, hidden: torch.Tensor, tile: int | None = None) -> torch.Tensor:
        return self.lm_head(hidden, tile).float()

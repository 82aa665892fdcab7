"""What the engine needs to know about a checkpoint: dimensions, the family's differences from Llama, each layer's
attention type and window, RoPE per layer type and the softmax scale, read from the folder's config.json.

The config is parsed by transformers' own config class (AutoConfig), so legacy and current field layouts
(`rope_scaling` vs `rope_parameters`, Gemma 3's `sliding_window_pattern` vs `layer_types`, a multimodal checkpoint's
nested `text_config`) resolve to the values transformers itself would run with. Anything the engine cannot run
fails here, in one line naming the config field, rather than producing a silently different model.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class Family:
    """How one decoder family departs from the Llama baseline (pre-norm, SwiGLU, RoPE on rotate_half pairs)."""

    qkv_bias: bool = False          # q/k/v projections carry a bias whatever attention_bias says (Qwen2)
    qk_norm: bool = False           # RMSNorm over each head of q and k, before RoPE (Qwen3, Gemma 3)
    unit_offset_norm: bool = False  # RMSNorm scales by (1 + w) in fp32 before casting back, not w after (Gemma)
    sandwich_norms: bool = False    # RMSNorm on the attention and MLP outputs before each residual add (Gemma 3)
    scaled_embedding: bool = False  # embeddings times sqrt(hidden), that scale first cast to the weight dtype (Gemma)
    layer_types: bool = False       # the config's layer_types may make layers sliding-window (Qwen2/3, Gemma 3)
    window_everywhere: bool = False  # a set sliding_window applies to every layer (Mistral)


FAMILIES = {
    "llama": Family(),
    "mistral": Family(window_everywhere=True),
    "qwen2": Family(qkv_bias=True, layer_types=True),
    "qwen3": Family(qk_norm=True, layer_types=True),
    "gemma3_text": Family(qk_norm=True, unit_offset_norm=True, sandwich_norms=True, scaled_embedding=True,
                          layer_types=True),
}
MULTIMODAL = {"gemma3": "gemma3_text"}      # a vision-language checkpoint whose text decoder the engine runs
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class ModelSpec:
    model_type: str                         # the decoder's type (gemma3_text for a gemma3 checkpoint)
    family: Family
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
    o_bias: bool
    activation: str
    layer_types: tuple[str, ...]            # FULL or SLIDING per layer
    sliding_window: int | None              # keys a sliding layer's query sees, itself included
    ropes: dict[str, dict]                  # RoPE parameters per layer type
    attn_scale: float                       # softmax scale of q.k (Gemma: query_pre_attn_scalar ** -0.5)
    final_logit_softcapping: float | None
    eos_token_ids: tuple[int, ...]
    weight_prefixes: tuple[str, ...] = field(default=("model.",))   # where the decoder's tensors live

    @property
    def rope(self) -> dict:
        """The full-attention layers' RoPE parameters."""
        return self.ropes[FULL] if FULL in self.ropes else next(iter(self.ropes.values()))

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer: the sliding window, or None for full attention."""
        return tuple(self.sliding_window if t == SLIDING else None for t in self.layer_types)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelSpec:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: pass a local HF model folder (config.json + *.safetensors)")
        kind = json.loads(path.read_text()).get("model_type")
        supported = sorted([*FAMILIES, *MULTIMODAL])
        if kind not in supported:
            raise ValueError(f"model_type {kind!r} is not supported by the engine; supported: {supported}")
        from transformers import AutoConfig

        top = AutoConfig.from_pretrained(str(model_dir))
        return cls.from_config(top)

    @classmethod
    def from_config(cls, top: Any) -> ModelSpec:
        """The spec of a transformers config object (a multimodal one contributes its text decoder)."""
        kind = top.model_type
        cfg = top.get_text_config() if kind in MULTIMODAL else top
        family = FAMILIES[MULTIMODAL.get(kind, kind)]
        _refuse_unsupported(cfg)
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        layers = cfg.num_hidden_layers
        types, window = _layer_types(cfg, family, layers)
        ropes = _ropes(cfg, types)
        activation = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")
        if activation not in ACTIVATIONS:
            raise ValueError(f"hidden_act {activation!r} is not supported by the engine; supported: {ACTIVATIONS}")
        scalar = getattr(cfg, "query_pre_attn_scalar", None)
        eos = getattr(top, "eos_token_id", None)
        eos = getattr(cfg, "eos_token_id", None) if eos is None else eos
        eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        bias = bool(getattr(cfg, "attention_bias", False))
        tie = getattr(top, "tie_word_embeddings", None)
        tie = getattr(cfg, "tie_word_embeddings", False) if tie is None else tie
        prefixes = ("model.language_model.", "language_model.model.") if kind in MULTIMODAL else ("model.",)
        return cls(
            model_type=MULTIMODAL.get(kind, kind), family=family, vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, num_layers=layers,
            num_q_heads=heads, num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads, head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=getattr(cfg, "max_position_embeddings", 4096),
            tie_word_embeddings=bool(tie), qkv_bias=family.qkv_bias or bias, o_bias=bias, activation=activation,
            layer_types=types, sliding_window=window, ropes=ropes,
            attn_scale=(scalar if scalar is not None else head_dim) ** -0.5,
            final_logit_softcapping=getattr(cfg, "final_logit_softcapping", None), eos_token_ids=eos,
            weight_prefixes=prefixes)


def _refuse_unsupported(cfg: Any) -> None:
    """One-line errors for config fields that would change the model in ways the engine does not implement."""
    if getattr(cfg, "mlp_bias", False):
        raise ValueError("mlp_bias=true is not supported by the engine (its MLP projections have no bias)")
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        raise ValueError("attn_logit_softcapping is not supported by the engine's attention kernels (Gemma 3 "
                         "checkpoints leave it null)")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=true is not supported: the engine decodes causally")
    if getattr(cfg, "partial_rotary_factor", 1.0) not in (None, 1.0):
        raise ValueError("partial_rotary_factor != 1 is not supported: the engine rotates the whole head")


def _layer_types(cfg: Any, family: Family, layers: int) -> tuple[tuple[str, ...], int | None]:
    """Each layer's attention type, and the window of the sliding ones (None when no layer slides)."""
    window = getattr(cfg, "sliding_window", None)
    if family.window_everywhere:
        types = [SLIDING if window else FULL] * layers
    elif family.layer_types and getattr(cfg, "layer_types", None):
        types = list(cfg.layer_types)
    else:
        types = [FULL] * layers
    unknown = sorted(set(types) - {FULL, SLIDING})
    if unknown or len(types) != layers:
        raise ValueError(f"layer_types {unknown or types} is not supported by the engine: it runs "
                         f"{FULL!r} and {SLIDING!r} layers, one entry per layer")
    if SLIDING not in types:
        return tuple(types), None
    if not isinstance(window, int) or window <= 0:
        raise ValueError(f"sliding_window={window!r} must be a positive integer for the sliding layers")
    return tuple(types), window


def _ropes(cfg: Any, types: tuple[str, ...]) -> dict[str, dict]:
    """RoPE parameters per layer type: transformers keeps one dict, or one per layer type (Gemma 3)."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    per_type = isinstance(params, dict) and any(isinstance(v, dict) for v in params.values())
    out = {}
    for t in set(types):
        rope = dict(params.get(t) or {}) if per_type else dict(params)
        rope.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ROPE_TYPES:
            raise ValueError(f"rope_type {kind!r} is not supported by the engine; supported: {list(ROPE_TYPES)}")
        out[t] = rope
    return out


def rope_inv_freq(rope: dict, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scaling for one set of RoPE parameters (default, linear, llama3)."""
    inv = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / rope["factor"], 1.0
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth blend between the two bands
    factor, old_len = rope["factor"], rope["original_max_position_embeddings"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled), 1.0

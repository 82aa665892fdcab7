"""Gemma 3 GGUF (llama.cpp's layout, any gguf-py quant type) -> an HF Gemma3ForCausalLM safetensors folder.

The folder holds `model.safetensors` (fp32, HF tensor names), `config.json` (gemma3_text, built with the installed
transformers' own config class so the engine and HF read it alike) and the tokenizer transformers builds from the
GGUF's vocabulary. Two things differ from a naive copy:
- llama.cpp stores every Gemma RMSNorm weight as (1 + w) so its plain `x * w` kernel fits; HF multiplies by (1 + w)
  itself, so 1 is subtracted here (transformers' own GGUF loader does the same);
- the GGUF carries neither the local (sliding-layer) RoPE base, the layer pattern nor query_pre_attn_scalar; the
  Gemma 3 values for the text-only sizes (10k, 5 sliding + 1 full, head_dim) are used unless the file states a
  pattern or local base itself (keys some converters write). Gemma 3 4B+ (linear RoPE scaling, 27B's scalar of 168)
  would need more than the metadata holds; the embedded model is the 270M.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

# llama.cpp block tensor suffix -> HF module path inside model.layers.N
_BLOCK = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    # in Gemma GGUFs ffn_norm is the norm before the MLP (in Llama GGUFs it is post_attention_layernorm)
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LOCAL_ROPE_BASE = 10_000.0     # Gemma 3's sliding layers (all sizes)
PATTERN = 6                    # every 6th layer attends globally


class GGUFError(ValueError):
    """The GGUF is not a Gemma 3 text model this converter can read; the message says what is off."""


def hf_name(gguf_name: str) -> str:
    """The HF state-dict key of a llama.cpp tensor name, e.g. blk.3.ffn_norm.weight ->
    model.layers.3.pre_feedforward_layernorm.weight."""
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _TOP:
        return f"{_TOP[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _BLOCK:
        return f"model.layers.{parts[1]}.{_BLOCK[parts[2]]}.{kind}"
    raise GGUFError(f"tensor {gguf_name!r} has no Gemma 3 counterpart")


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def read_weights(reader: Any) -> dict[str, np.ndarray]:
    """Every tensor dequantized to fp32 in the torch Linear layout [out, in], norms back to HF's w (not 1 + w)."""
    from gguf.quants import dequantize

    out = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        arr = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if not arr.flags.writeable:             # F32 tensors come back as views of the read-only memory map
            arr = arr.copy()
        expected = tuple(int(n) for n in reversed(t.shape))
        if arr.shape != expected:
            raise GGUFError(f"{t.name}: dequantized to {arr.shape}, the header says {expected}")
        if name.endswith("norm.weight"):
            arr = arr - np.float32(1.0)
        out[name] = arr
    return out


def build_config(reader: Any, vocab_size: int, tied: bool) -> Any:
    """A transformers Gemma3TextConfig from the GGUF metadata (see the module docstring for what is filled in)."""
    from transformers import Gemma3TextConfig

    arch = _field(reader, "general.architecture")
    if arch != "gemma3":
        raise GGUFError(f"general.architecture is {arch!r}, expected 'gemma3'")

    def meta(key: str, default: Any = None) -> Any:
        value = _field(reader, f"gemma3.{key}", default)
        if value is None:
            raise GGUFError(f"metadata gemma3.{key} is missing")
        return value

    layers = int(meta("block_count"))
    head_dim = int(meta("attention.key_length"))
    pattern = int(meta("attention.sliding_window_pattern", PATTERN))
    types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    global_base = float(meta("rope.freq_base"))
    local_base = float(meta("rope.freq_base_swa", LOCAL_ROPE_BASE))
    cfg = Gemma3TextConfig(
        vocab_size=vocab_size, hidden_size=int(meta("embedding_length")),
        intermediate_size=int(meta("feed_forward_length")), num_hidden_layers=layers,
        num_attention_heads=int(meta("attention.head_count")),
        num_key_value_heads=int(meta("attention.head_count_kv")), head_dim=head_dim,
        max_position_embeddings=int(meta("context_length")),
        # the file holds eps as float32 (1e-6 reads back as 9.99999997e-07): round it to what the model was given
        rms_norm_eps=float(f'{float(meta("attention.layer_norm_rms_epsilon")):.6g}'),
        sliding_window=int(meta("attention.sliding_window")), layer_types=types, query_pre_attn_scalar=head_dim,
        hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None, attn_logit_softcapping=None,
        tie_word_embeddings=tied, bos_token_id=int(_field(reader, "tokenizer.ggml.bos_token_id", 2)),
        eos_token_id=int(_field(reader, "tokenizer.ggml.eos_token_id", 1)),
        pad_token_id=int(_field(reader, "tokenizer.ggml.padding_token_id", 0)),
    )
    _set_rope(cfg, global_base, local_base)
    cfg.architectures = ["Gemma3ForCausalLM"]
    return cfg


def _set_rope(cfg: Any, global_base: float, local_base: float) -> None:
    """Both RoPE bases in whichever form the installed transformers keeps them (v5: rope_parameters per layer type;
    v4: rope_theta + rope_local_base_freq)."""
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and "full_attention" in params:
        params["full_attention"] = {**params["full_attention"], "rope_type": "default", "rope_theta": global_base}
        params["sliding_attention"] = {**params["sliding_attention"], "rope_type": "default",
                                       "rope_theta": local_base}
    else:
        cfg.rope_theta, cfg.rope_local_base_freq = global_base, local_base


def convert(gguf_file: Path, out: Path) -> None:
    """Write the HF folder for `gguf_file` into `out` (which exists): weights, config.json, tokenizer."""
    import torch
    from gguf import GGUFReader
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    reader = GGUFReader(str(gguf_file))
    weights = read_weights(reader)
    embed = weights.get("model.embed_tokens.weight")
    if embed is None:
        raise GGUFError(f"{gguf_file.name} has no token_embd tensor")
    tied = "lm_head.weight" not in weights
    cfg = build_config(reader, vocab_size=int(embed.shape[0]), tied=tied)
    missing = _missing(weights, cfg.num_hidden_layers)
    if missing:
        raise GGUFError(f"{gguf_file.name} lacks {len(missing)} tensor(s), e.g. {missing[:3]}")
    save_file({k: torch.from_numpy(v) for k, v in weights.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    cfg.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    # Gemma is trained with <bos> first; the GGUF says so (add_bos_token) but the built tokenizer may not add it
    if bool(_field(reader, "tokenizer.ggml.add_bos_token", True)):
        tokenizer.add_bos_token = True
    template = _field(reader, "tokenizer.chat_template")
    if template:
        tokenizer.chat_template = template
    tokenizer.save_pretrained(out)


def _missing(weights: dict[str, np.ndarray], layers: int) -> list[str]:
    want = ["model.embed_tokens.weight", "model.norm.weight"]
    want += [f"model.layers.{i}.{m}.weight" for i in range(layers) for m in _BLOCK.values()]
    return [k for k in want if k not in weights]

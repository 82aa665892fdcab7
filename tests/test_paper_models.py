"""The paper twins on every paper model: each `*_paper` experiment composes and validates with model=llama31_8b,
mistral7b, qwen3_8b and gemma3_12b, and each model's published config.json reads into a spec the engine runs."""
from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir

from harness.running.config import CONF_DIR
from harness.running.driver import prepare
from harness.running.schema import register
from systems.engine.models.spec import FULL, SLIDING, ModelSpec
from tasks.base import TaskError

register()
PAPER_EXPS = sorted(p.stem for p in (CONF_DIR / "exp").glob("*_paper.yaml"))
PAPER_MODELS = {"llama31_8b": "llama-3.1-8b-instruct", "mistral7b": "mistral-7b-instruct-v0.2",
                "qwen3_8b": "qwen3-8b", "gemma3_12b": "gemma-3-12b-it"}


@pytest.mark.parametrize("model", list(PAPER_MODELS))
@pytest.mark.parametrize("exp", PAPER_EXPS)
def test_every_paper_twin_composes_and_validates_on_every_paper_model(exp, model):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=[f"+exp={exp}", f"model={model}"])
    assert cfg.model.name == PAPER_MODELS[model] and cfg.model.dtype == "bfloat16"
    assert cfg.model.max_input_tokens < cfg.model.max_model_len
    try:
        assert prepare(cfg)[1].grid
    except TaskError as exc:     # a hub dataset (LongBench, RULER's QA) fails in one line on a machine without it
        assert "HF hub" in str(exc)


# The published config.json of each paper model, as its hub folder ships it (transformers 4.x field layout).
LLAMA31_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
              "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "hidden_act": "silu", "max_position_embeddings": 131072,
              "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False, "vocab_size": 128256,
              "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"},
              "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]}
MISTRAL_7B_V02 = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
                  "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "hidden_act": "silu", "max_position_embeddings": 32768,
                  "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "sliding_window": None,
                  "tie_word_embeddings": False, "vocab_size": 32000, "bos_token_id": 1, "eos_token_id": 2}
QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 40960, "max_window_layers": 36,
            "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
            "use_sliding_window": False, "attention_bias": False, "tie_word_embeddings": False,
            "vocab_size": 151936, "bos_token_id": 151643, "eos_token_id": 151645}
GEMMA3_12B = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
              "boi_token_index": 255999, "eoi_token_index": 256000, "image_token_index": 262144,
              "mm_tokens_per_image": 256, "eos_token_id": [1, 106],
              "text_config": {"model_type": "gemma3_text", "hidden_size": 3840, "intermediate_size": 15360,
                              "num_attention_heads": 16, "num_hidden_layers": 48, "num_key_value_heads": 8,
                              "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
              "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "image_size": 896,
                                "intermediate_size": 4304, "num_attention_heads": 16, "num_hidden_layers": 27,
                                "patch_size": 14, "vision_use_head": False}}


def _spec(tmp_path, config: dict) -> ModelSpec:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return ModelSpec.from_dir(tmp_path)


def test_llama31_8b_reads_its_llama3_rope(tmp_path):
    spec = _spec(tmp_path, LLAMA31_8B)
    assert spec.rope["rope_type"] == "llama3" and spec.rope["rope_theta"] == 500000.0
    assert spec.layer_windows == (None,) * 32 and spec.attn_scale == 128 ** -0.5
    assert spec.eos_token_ids == (128001, 128008, 128009)


def test_mistral_v02_has_no_window(tmp_path):
    assert set(_spec(tmp_path, MISTRAL_7B_V02).layer_windows) == {None}


def test_mistral_v01_window_slides_every_layer(tmp_path):
    spec = _spec(tmp_path, {**MISTRAL_7B_V02, "sliding_window": 4096, "rope_theta": 10000.0})
    assert spec.layer_windows == (4096,) * 32


def test_qwen3_8b_has_qk_norms_and_full_layers(tmp_path):
    spec = _spec(tmp_path, QWEN3_8B)
    assert spec.family.qk_norm and not spec.qkv_bias and spec.layer_windows == (None,) * 36
    assert (spec.num_q_heads, spec.num_kv_heads, spec.head_dim) == (32, 8, 128)


def test_gemma3_12b_text_decoder_from_the_multimodal_config(tmp_path):
    """The omitted text_config fields take Gemma3TextConfig's defaults, as transformers runs the model."""
    spec = _spec(tmp_path, GEMMA3_12B)
    assert spec.model_type == "gemma3_text" and (spec.num_q_heads, spec.num_kv_heads, spec.head_dim) == (16, 8, 256)
    assert spec.layer_types == ((SLIDING,) * 5 + (FULL,)) * 8 and spec.sliding_window == 1024
    assert spec.ropes[FULL] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}
    assert spec.ropes[SLIDING] == {"rope_type": "default", "rope_theta": 10000.0}
    assert spec.attn_scale == 256 ** -0.5 and spec.tie_word_embeddings and spec.eos_token_ids == (1, 106)
    assert spec.weight_prefixes == ("model.language_model.", "language_model.model.")

"""Every decoder family the engine runs against HF transformers on a tiny random model (fp32): greedy tokens identical
and log-probabilities within TOL, on prompts longer than the sliding window, batched, with chunked prefill; and a
one-line error naming the config field for what the engine cannot run."""
from __future__ import annotations

import pytest
import torch

from systems.base import GenerationRequest
from systems.engine.engine import Engine
from systems.engine.models.spec import FULL, SLIDING, ModelSpec
from systems.policies import load_policy

VOCAB, WINDOW, MAX_NEW = 256, 24, 12
# fp32 on both sides; the engine's paged/chunked attention and fused steps sum in another order than HF. Measured
# on these models (initializer_range 0.2: logits of a few units): max |delta logit| <= 1e-5 for the model alone, max
# |delta log p| <= 2e-5 through the engine; the bound leaves room for other BLAS builds and CPUs.
TOL = 1e-4
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=256, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
             pad_token_id=0)


def _config(family: str):
    import transformers as tf

    if family == "llama31":        # Llama 3.1's llama3 RoPE scaling (a short original context so all bands occur)
        return tf.LlamaConfig(**SMALL, num_hidden_layers=2, rms_norm_eps=1e-5, tie_word_embeddings=False,
                              rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 32})
    if family == "mistral":        # one window on every layer
        return tf.MistralConfig(**SMALL, num_hidden_layers=2, sliding_window=WINDOW)
    if family == "qwen3":          # q/k norms; use_sliding_window makes layers >= max_window_layers slide
        return tf.Qwen3Config(**SMALL, num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW,
                              max_window_layers=1, tie_word_embeddings=True)
    if family == "gemma3":         # local/global layers, own RoPE bases, (1 + w) and sandwich norms, scaled scores
        return tf.Gemma3TextConfig(**SMALL, num_hidden_layers=4, sliding_window=WINDOW,
                                   layer_types=[SLIDING, SLIDING, FULL, SLIDING], query_pre_attn_scalar=20,
                                   final_logit_softcapping=8.0)
    raise AssertionError(family)


def _randomize_norms(model) -> None:
    """Norm weights start at ones (zeros for Gemma's 1 + w): random values make a misplaced or missing norm show."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(param + 0.3 * torch.randn(param.shape, generator=g))


@pytest.fixture(scope="module", params=["llama31", "mistral", "qwen3", "gemma3"])
def tiny(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(request.param)).float().eval()
    _randomize_norms(model)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, path, model


def _prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (61, 30, 47, 9)]


def _hf_reference(model, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """HF's greedy continuation and its log-probabilities at each output step (one teacher-forced pass)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(prompt):].tolist()
        logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1].float()
    return out, torch.log_softmax(logits, -1)


def test_greedy_tokens_and_logprobs_equal_hf(tiny):
    family, path, model = tiny
    engine = Engine(str(path), load_policy("dense"),
                    dict(page_size=4, device_memory_gb=0.02, host_memory_gb=0.02, max_num_seqs=4,
                         max_num_batched_tokens=40, chunked_prefill=True), dtype="float32")
    spec = engine.model.spec
    if family != "llama31":
        assert spec.sliding_window == WINDOW and SLIDING in spec.layer_types
    prompts = _prompts()
    assert max(map(len, prompts)) > 2 * WINDOW and len(prompts) > 1
    requests = [GenerationRequest(str(i), p, MAX_NEW, ignore_eos=True, logprob_steps=MAX_NEW)
                for i, p in enumerate(prompts)]
    seqs = engine.generate(requests)
    assert engine.steps["prefill"] > 3                 # 147 prompt tokens at 40 per step: chunked, beside decodes
    worst = 0.0
    for prompt, seq in zip(prompts, seqs):
        tokens, logp = _hf_reference(model, prompt)
        assert seq.output_ids == tokens, family
        worst = max(worst, float((torch.stack(seq.logprob_rows) - logp).abs().max()))
    assert worst < TOL, f"{family}: max |delta log p| {worst:.2e}"


def test_logits_equal_hf(tiny):
    """The model alone (reference attention with each layer's window and the model's scale) over a whole prompt."""
    from systems.engine.models.llama import LlamaModel
    from systems.engine.ops import torch_attention

    family, path, model = tiny
    engine_model = LlamaModel(path, torch.float32, torch.device("cpu"))
    spec = engine_model.spec

    def attend(layer, q, k, v):
        return torch_attention.prompt_attention(q, k, v, spec.attn_scale, window=spec.layer_windows[layer])

    ids = torch.tensor(_prompts()[0])
    with torch.inference_mode():
        got = engine_model.logits(engine_model.forward(ids, torch.arange(len(ids)), attend))
        want = model(ids[None]).logits[0].float()
    worst = float((got - want).abs().max())
    assert worst < TOL, f"{family}: max |delta logit| {worst:.2e}"


def test_the_window_changes_the_output(tiny):
    """The window matters on these prompts: the same checkpoint without it decodes differently (so the parity above
    is a check of the window, not of a model that never looks far back)."""
    family, path, _ = tiny
    if family == "llama31":
        pytest.skip("no sliding window")
    engine = Engine(str(path), load_policy("dense"),
                    dict(page_size=4, device_memory_gb=0.02, host_memory_gb=0.02, max_num_seqs=4,
                         max_num_batched_tokens=256), dtype="float32")
    requests = [GenerationRequest(str(i), p, MAX_NEW, ignore_eos=True) for i, p in enumerate(_prompts())]
    windowed = [s.output_ids for s in engine.generate(requests)]
    engine.runner.windows = (None,) * len(engine.runner.windows)
    unbounded = [s.output_ids for s in engine.generate(requests)]
    assert windowed != unbounded


def test_gemma3_spec_reads_scale_ropes_and_layer_types(tiny):
    family, path, _ = tiny
    spec = ModelSpec.from_dir(path)
    if family == "gemma3":
        assert spec.attn_scale == 20 ** -0.5 and spec.layer_windows == (WINDOW, WINDOW, None, WINDOW)
        assert spec.ropes[SLIDING]["rope_theta"] == 10000.0 and spec.ropes[FULL]["rope_theta"] == 1e6
        assert spec.family.unit_offset_norm and spec.tie_word_embeddings and spec.activation == "gelu_pytorch_tanh"
    else:
        assert spec.attn_scale == 16 ** -0.5
        assert spec.layer_windows == {"llama31": (None, None), "mistral": (WINDOW, WINDOW),
                                      "qwen3": (None, WINDOW, WINDOW)}[family]


def test_gemma3_multimodal_checkpoint_runs_its_text_decoder(tmp_path):
    """Gemma 3 4B/12B/27B ship as Gemma3ForConditionalGeneration: the engine reads the text decoder (nested
    text_config, tensors under the language model) and ignores the vision tower."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    torch.manual_seed(0)
    text = _config("gemma3").to_dict()
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    model = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision.to_dict(),
                                                        mm_tokens_per_image=4, image_token_index=VOCAB - 1,
                                                        boi_token_index=VOCAB - 2, eoi_token_index=VOCAB - 3))
    model = model.float().eval()
    _randomize_norms(model)
    model.save_pretrained(tmp_path)
    engine = Engine(str(tmp_path), load_policy("dense"),
                    dict(page_size=4, device_memory_gb=0.02, host_memory_gb=0.02, max_num_seqs=4,
                         max_num_batched_tokens=64), dtype="float32")
    assert engine.model.spec.model_type == "gemma3_text"
    prompt = _prompts()[0]
    [seq] = engine.generate([GenerationRequest("a", prompt, MAX_NEW, ignore_eos=True)])
    assert seq.output_ids == _hf_reference(model, prompt)[0]


def _config_dir(tmp_path, family: str, **changes):
    cfg = _config(family)
    for key, value in changes.items():
        setattr(cfg, key, value)
    cfg.save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("family, changes, field", [
    ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("llama31", {"mlp_bias": True}, "mlp_bias"),
    ("llama31", {"hidden_act": "relu"}, "hidden_act"),
    ("llama31", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                     "original_max_position_embeddings": 64}}, "rope_type"),
    ("qwen3", {"layer_types": ["full_attention", "chunked_attention", "full_attention"]}, "layer_types"),
    ("mistral", {"sliding_window": -3}, "sliding_window"),
])
def test_unsupported_config_fails_in_one_line_naming_the_field(tmp_path, family, changes, field):
    with pytest.raises(ValueError) as err:
        ModelSpec.from_dir(_config_dir(tmp_path, family, **changes))
    assert field in str(err.value) and "\n" not in str(err.value)


def test_unknown_model_type_is_named(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "phi3"}')
    with pytest.raises(ValueError, match="model_type 'phi3' is not supported by the engine; supported: "):
        ModelSpec.from_dir(tmp_path)


def test_gemma_embedding_scale_is_cast_to_the_weight_dtype_first(tmp_path):
    """sqrt(640) = 25.298 is 25.25 in bf16: HF multiplies by the rounded factor, so the engine must too."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from systems.engine.models.llama import LlamaModel

    cfg = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=640, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=1, num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
    Gemma3ForCausalLM(cfg).save_pretrained(tmp_path)
    assert float(LlamaModel(tmp_path, torch.bfloat16, torch.device("cpu")).embed_scale) == 25.25
    assert float(LlamaModel(tmp_path, torch.float32, torch.device("cpu")).embed_scale) == pytest.approx(640 ** 0.5)

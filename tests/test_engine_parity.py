"""Engine (dense policy, fp32) vs HF transformers greedy, batching vs one-at-a-time, block accounting, preemption."""
from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch

from systems.base import GenerationRequest
from systems.engine.engine import Engine
from systems.policies import load_policy

VOCAB = 512


def _build(path, kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.15, bos_token_id=1, eos_token_id=2)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=True,
                                             rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0,
                                                              "factor": 8.0, "low_freq_factor": 1.0,
                                                              "high_freq_factor": 4.0,
                                                              "original_max_position_embeddings": 64}))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False))
        with torch.no_grad():                     # random non-zero q/k/v biases so the bias path matters
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"engine_{request.param}")
    return path, _build(path, request.param)


def _prompts(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 17, 40, 9, 64, 26][:n]
    return [torch.randint(3, VOCAB, (length,), generator=g).tolist() for length in lengths]


def _hf_greedy(model, prompt, max_new):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _engine(path, **cfg):
    base = dict(page_size=4, device_memory_gb=0.02, host_memory_gb=0.02, max_num_seqs=8,
                max_num_batched_tokens=128)
    base.update(cfg)
    return Engine(str(path), load_policy("dense"), SimpleNamespace(**base), dtype="float32")


def _requests(prompts, max_new=16):
    return [GenerationRequest(str(i), p, max_new, ignore_eos=True) for i, p in enumerate(prompts)]


def test_greedy_equals_hf_and_blocks_return(tiny):
    path, model = tiny
    prompts = _prompts()
    reference = [_hf_greedy(model, p, 16) for p in prompts]
    assert len({tuple(r) for r in reference}) == len(reference)    # the model is not degenerate
    engine = _engine(path)
    free_dev, free_host = engine.kv.free_device_blocks(), engine.kv.free_host_blocks()
    seqs = engine.generate(_requests(prompts))
    assert [s.output_ids for s in seqs] == reference
    assert engine.kv.free_device_blocks() == free_dev and engine.kv.free_host_blocks() == free_host
    assert engine.kv.device_blocks.peak_used > 0 and all(len(s.token_times) == 16 for s in seqs)
    assert all(a <= b for s in seqs for a, b in zip(s.token_times, s.token_times[1:]))


def test_batched_with_mid_run_arrivals_equals_one_at_a_time(tiny):
    path, _ = tiny
    prompts = _prompts(6, seed=1)
    engine = _engine(path, max_num_seqs=3, max_num_batched_tokens=50)
    alone = [engine.generate(r)[0].output_ids for r in ([q] for q in _requests(prompts, 12))]
    free = engine.kv.free_device_blocks()
    requests = _requests(prompts, 12)
    seqs = [engine.add_request(r) for r in requests[:2]]
    for _ in range(3):                         # two sequences decode a few steps before the others arrive
        engine.step()
    seqs += [engine.add_request(r) for r in requests[2:]]
    engine.run()
    assert [s.output_ids for s in seqs] == alone
    assert engine.kv.free_device_blocks() == free


def test_small_device_pool_preempts_and_keeps_output(tiny):
    path, _ = tiny
    prompts = _prompts(4, seed=2)
    reference = [s.output_ids for s in _engine(path).generate(_requests(prompts, 20))]
    kv_bytes = 2 * 4 * 16 * 4                  # K+V of one fp32 page of one head (head_dim 16)
    per_seq_pages = 2 * 2 * (-(-(64 + 20) // 4))   # layers x kv heads x pages of the longest request
    small = _engine(path, device_memory_gb=per_seq_pages * 1.6 * kv_bytes / (1 << 30))
    free = small.kv.free_device_blocks()
    seqs = small.generate(_requests(prompts, 20))
    assert small.scheduler.num_preemptions > 0
    assert small.kv.device_blocks.peak_used <= small.kv.device_blocks.capacity
    assert [s.output_ids for s in seqs] == reference
    assert small.kv.free_device_blocks() == free


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny):
    path, _ = tiny
    prompts = _prompts(3, seed=3)
    reqs = [GenerationRequest(str(i), p, 10, temperature=0.8, top_p=0.9, seed=7 + i, ignore_eos=True)
            for i, p in enumerate(prompts)]
    engine = _engine(path)
    batched = [s.output_ids for s in engine.generate(reqs)]
    alone = [engine.generate([r])[0].output_ids for r in reqs]
    greedy = [s.output_ids for s in engine.generate(_requests(prompts, 10))]
    assert batched == alone and batched != greedy


def test_engine_system_text_stop_and_memory(tmp_path, tokenizer_dir):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from systems.engine.system import EngineSystem
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.2, tie_word_embeddings=True, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp_path)
    engine_cfg = SimpleNamespace(page_size=8, device_memory_gb=0.01, host_memory_gb=0.01, max_num_seqs=4,
                                 max_num_batched_tokens=256, threads=None)
    with pytest.raises(ValueError, match="unknown parameter.*valid: none"):
        EngineSystem(str(tmp_path), "dense", {"budget": 4}, engine_cfg)
    system = EngineSystem(str(tmp_path), "dense", {}, engine_cfg, dtype="float32")
    prompt = list(range(10, 40))
    free = system.engine.kv.free_device_blocks()
    [full] = system.generate([GenerationRequest("a", prompt, 12, ignore_eos=True)])
    assert full.output_tokens == 12 and full.finish_reason == "length" and full.text
    stop = full.text[len(full.text) // 2:][:3]
    [cut] = system.generate([GenerationRequest("b", prompt, 12, ignore_eos=True, stop=(stop,))])
    assert cut.finish_reason == "stop" and stop not in cut.text and full.text.startswith(cut.text)
    report = system.memory_report()
    assert report.mode == "physical" and 0 < report.device_kv_peak_bytes <= report.device_kv_capacity_bytes
    assert report.extra["minmax_peak_bytes"] > 0 and full.kv_stats["policy"] == "dense"
    assert system.engine.kv.free_device_blocks() == free
    shutil.rmtree(tmp_path, ignore_errors=True)

"""Eviction policies on the engine with tiny fp32 models: dense parity at budget >= context, realized budgets, no state
leak across samples, batched == one at a time, and physical memory (blocks freed, cascading's prefill peak)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from systems.base import GenerationRequest
from systems.engine.engine import Engine
from systems.policies import load_policy

P, NEW = 4, 12
SMALL = {
    "cake": dict(budget=24, window=8),
    "cake_nocascade": dict(budget=24, window=8, cascading=False),
    "streaming": dict(budget=24, sink_size=4),
    "h2o": dict(budget=24, recent_size=None),
    "tova": dict(budget=24),
    "snapkv": dict(budget=24, window=8, kernel=5, pooling="avgpool"),
    "pyramidkv": dict(budget=24, window=8),
    "knorm": dict(budget=24, window=4),
}


def _policy(key: str, **override):
    return load_policy("cake" if key.startswith("cake") else key, {**SMALL[key], **override})


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: a second intra-op thread only adds synchronization, badly so on a shared CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    out = {}
    for kind, cfg_cls, model_cls in (("llama", LlamaConfig, LlamaForCausalLM),
                                     ("qwen2", Qwen2Config, Qwen2ForCausalLM)):
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(f"evict_{kind}")
        model_cls(cfg_cls(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          initializer_range=0.2, use_sliding_window=False)).save_pretrained(path)
        out[kind] = path
    return out


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in (9, 70, 131)]


def _engine(path, policy, device_gb=0.01):
    cfg = SimpleNamespace(page_size=P, device_memory_gb=device_gb, host_memory_gb=0.001, max_num_seqs=4,
                          max_num_batched_tokens=512)
    return Engine(str(path), policy, cfg, dtype="float32")


def _generate(engine, prompts, tag=""):
    free = engine.kv.free_device_blocks()
    seqs = engine.generate([GenerationRequest(f"{tag}{i}", p, NEW, ignore_eos=True) for i, p in enumerate(prompts)])
    assert engine.kv.free_device_blocks() == free                    # every block back after the run
    return [s.output_ids for s in seqs], [s.kv_stats for s in seqs]


@pytest.fixture(scope="module")
def dense_outputs(tiny_dirs, prompts):
    return {kind: _generate(_engine(path, load_policy("dense")), prompts)[0] for kind, path in tiny_dirs.items()}


@pytest.mark.parametrize("kind, key", [("llama", key) for key in SMALL] + [("qwen2", "cake"), ("qwen2", "h2o")])
def test_budget_at_least_context_equals_dense(tiny_dirs, prompts, dense_outputs, key, kind):
    out, stats = _generate(_engine(tiny_dirs[kind], _policy(key, budget=400)), prompts)
    assert out == dense_outputs[kind]
    for p, st in zip(prompts, stats):
        assert st["kept_tokens"] == [[len(p) + NEW - 1] * 2] * 3                 # nothing was evicted


def _expected_kept(key: str, n: int, stats: dict) -> list[int]:
    """Tokens per layer at the end of generation (the last sampled token is never appended)."""
    total = n + NEW - 1
    if key in ("streaming", "h2o", "tova"):
        return [min(total, 24)] * 3
    if key.startswith("cake"):
        return [b + 8 for b in stats["layer_budgets"]] if total > 24 else [total] * 3
    if key == "snapkv":
        return [(24 if n >= 24 else n) + NEW - 1] * 3
    if key == "knorm":
        return [min(n, 24) + NEW - 1] * 3
    return [b + 8 + NEW - 1 for b in stats["layer_budgets"]] if n >= 24 else [total] * 3


@pytest.mark.parametrize("key", SMALL)
def test_realized_budgets_no_leak_and_batching(tiny_dirs, prompts, key):
    engine = _engine(tiny_dirs["llama"], _policy(key))
    a, a_stats = _generate(engine, prompts[2:], "a")
    _generate(engine, prompts[1:2], "b")
    again, again_stats = _generate(engine, prompts[2:], "a")
    assert again == a and again_stats == a_stats                             # run A, B, A: no state leaks
    batched, stats = _generate(engine, prompts)
    assert batched[2] == a[0] and stats[2] == a_stats[0]                     # batched decode == alone
    for p, st in zip(prompts, stats):
        kept = _expected_kept(key, len(p), st)
        assert st["kept_tokens"] == [[c, c] for c in kept]
        if key.startswith("cake") and len(p) > 32:
            assert sum(st["layer_budgets"]) == (24 - 8) * 3                  # CAKE's total is exact
        if key == "pyramidkv" and len(p) >= 2 * 16:
            assert st["layer_budgets"] == sorted(st["layer_budgets"], reverse=True)


def _prefill_peak(path, key, prompt):
    engine = _engine(path, _policy(key))
    engine.add_request(GenerationRequest("m", prompt, NEW, ignore_eos=True))
    engine.kv.device_blocks.reset_peak()
    engine.step()                                                            # the prefill
    seq = engine.scheduler.running[0]
    held = engine.kv.device_blocks.num_used
    pages = -(-engine.kv.num_tokens[seq.slot].long() // P)
    assert held == int(pages.sum())                                          # evicted pages went back to the pool
    need = engine.policy.device_blocks_needed(len(prompt), NEW)
    return engine.kv.device_blocks.peak_used, held, need


def test_cascading_keeps_prefill_memory_within_budget_plus_one_layer(tiny_dirs):
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 256, (300,), generator=g).tolist()
    layer_blocks = 2 * -(-300 // P)
    peak_c, held_c, need_c = _prefill_peak(tiny_dirs["llama"], "cake", prompt)
    peak_n, held_n, need_n = _prefill_peak(tiny_dirs["llama"], "cake_nocascade", prompt)
    assert held_c == held_n                                                  # same budgets at the end of prefill
    assert peak_n == 3 * layer_blocks                                        # the whole prefill held at once
    budget_blocks = 2 * (-(-(16 * 3 + 8 * 3) // P) + 3)                      # total + windows, page rounding
    assert peak_c <= budget_blocks + layer_blocks < peak_n
    assert peak_c <= need_c and peak_n <= need_n                             # admission reserves the real peak
    for key in ("snapkv", "h2o", "tova", "streaming", "pyramidkv", "knorm"):
        peak, _, need = _prefill_peak(tiny_dirs["llama"], key, prompt)
        assert peak <= need < peak_n


@pytest.mark.parametrize("name", ["cake", "cake_nocascade", "streaming", "h2o", "tova", "snapkv", "pyramidkv", "knorm"])
def test_system_yaml_matches_the_dataclass_defaults(name):
    from pathlib import Path

    from omegaconf import OmegaConf

    from harness.running.schema import SystemConfig
    cfg = OmegaConf.merge(OmegaConf.structured(SystemConfig),
                          OmegaConf.load(Path(__file__).parents[1] / "conf" / "system" / f"{name}.yaml"))
    policy = load_policy(cfg.policy, OmegaConf.to_container(cfg.params))
    if name == "cake_nocascade":
        assert policy == load_policy("cake", {"cascading": False})
    else:
        assert policy == load_policy(cfg.policy)                 # the YAML states the official defaults


@pytest.mark.parametrize("name, params, match", [
    ("cake", {"allocation": "greedy"}, "allocation='greedy' is not supported"),
    ("cake", {"budget": 32, "window": 32}, "budget > window"),
    ("snapkv", {"pooling": "median"}, "pooling='median'"),
    ("h2o", {"budget": 64, "recent_size": 64}, "recent_size < budget"),
    ("streaming", {"budget": 4}, "budget > sink_size"),
    ("knorm", {"budget": 8, "window": 8}, "budget > window"),
])
def test_bad_params_fail_in_one_line(name, params, match):
    with pytest.raises(ValueError, match=match) as err:
        load_policy(name, params)
    assert "\n" not in str(err.value)

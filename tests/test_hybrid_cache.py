"""Hybrid attention in the paged cache: a sliding-window layer keeps only the pages its window can still read.

On tiny random Gemma-3-like (sliding + global layers) and Mistral-like (a window on every layer) models, with prompts
longer than the window and chunked prefill: the engine's tokens and log-probabilities are the same with and without
freeing (per-op and fused decode), a windowed layer never holds more than ceil((W - 1) / P) + 1 pages per KV head
between steps, the freed blocks go back to the pool (no leak, no double free, shared contexts included, under every
policy), and policies act only on the full-attention layers, with budgets and analytic counts over those. A page rule
run inside the fused step (a Qwen2-like model whose last layer is windowed) equals the per-op step bit for bit.
"""
from __future__ import annotations

import json

import pytest
import torch

from systems.base import GenerationRequest
from systems.engine.engine import Engine
from systems.engine.models.spec import FULL, SLIDING
from systems.policies import load_policy
from tests.test_engine_invariants import MODULE, POLICIES, _check, _engine, _fuzz, _fuzz_shared
from tests.test_model_families import SMALL, VOCAB, _randomize_norms

P, W, MAX_NEW = 4, 10, 12


def _config(family: str):
    import transformers as tf

    if family == "gemma3":      # global layers 1 and 3 (the policies' profiles name heads there)
        return tf.Gemma3TextConfig(**SMALL, num_hidden_layers=4, sliding_window=W,
                                   layer_types=[SLIDING, FULL, SLIDING, FULL], query_pre_attn_scalar=20)
    return tf.MistralConfig(**SMALL, num_hidden_layers=2, sliding_window=W)


@pytest.fixture(scope="module", params=["gemma3", "mistral"])
def hybrid(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(request.param)).float().eval()
    _randomize_norms(model)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, path


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (61, 30, 47, 9)]


def _run(path, release: bool, fused: bool, policy: str = "dense") -> tuple[Engine, list]:
    engine = Engine(str(path), load_policy(policy), dict(page_size=P, device_memory_gb=0.02, host_memory_gb=0.02,
                                                         max_num_seqs=4, max_num_batched_tokens=24,
                                                         chunked_prefill=True, fused_decode=fused), dtype="float32")
    if not release:
        engine.kv.set_released_windows({})
    requests = [GenerationRequest(str(i), p, MAX_NEW, ignore_eos=True, logprob_steps=MAX_NEW)
                for i, p in enumerate(_prompts())]
    for r in requests:
        engine.add_request(r)
    seqs, bound = [], -(-(W - 1) // P) + 1
    while engine.scheduler.has_work():
        seqs += engine.step()
        for layer in engine.kv.released_windows:        # between steps a windowed layer holds its window only
            held = (engine.kv.block_table[:, layer] != 0).sum(-1)
            assert int(held.max()) <= bound, (layer, held.max())
        _check(engine)
    assert engine.kv.device_blocks.num_used == 0
    return engine, sorted(seqs, key=lambda s: s.request.request_id)


@pytest.mark.parametrize("fused", [False, True])
def test_freeing_pages_outside_the_window_changes_no_token(hybrid, fused):
    family, path = hybrid
    freed, seqs = _run(path, release=True, fused=fused)
    if fused and freed.runner.fused is None:
        pytest.skip(f"no fused step here: {freed.runner.fused_unsupported}")
    kept, ref = _run(path, release=False, fused=fused)
    windowed = [layer for layer, w in enumerate(freed.model.spec.layer_windows) if w]
    assert sorted(freed.kv.released_windows) == windowed and not kept.kv.released_windows
    assert freed.steps["prefill"] > 3                  # 147 prompt tokens at 24 per step: chunked, beside decodes
    for a, b in zip(seqs, ref):
        assert a.output_ids == b.output_ids, family
        assert torch.equal(torch.stack(a.logprob_rows), torch.stack(b.logprob_rows))
    assert freed.kv.device_blocks.peak_used < kept.kv.device_blocks.peak_used


def test_finished_request_holds_the_window_and_full_layers(hybrid):
    """kv_stats splits device pages by layer type; the policy's analytic count (expected_device_blocks) matches."""
    family, path = hybrid
    engine, seqs = _run(path, release=True, fused=False)
    policy = engine.policy
    for seq in seqs:
        stats = seq.kv_stats
        expected = policy.expected_device_blocks(seq.num_prompt_tokens, seq.num_output_tokens)
        assert stats["device_pages"] == expected, seq.request.request_id
        full_layers = sum(w is None for w in engine.model.spec.layer_windows)
        tokens = seq.num_prompt_tokens + seq.num_output_tokens - 1
        assert stats["device_pages_full"] == full_layers * engine.kv.num_kv_heads * -(-tokens // P)
        assert stats["device_pages_windowed"] == policy.window_blocks(tokens)
    # the memory experiment's analytic count, split the same way
    from harness.experiments.memory import analytic

    kv = engine.kv
    spec = {"layers": kv.num_layers, "kv_heads": kv.num_kv_heads, "page_size": P, "bytes_per_block": 1,
            "minmax_bytes_per_page": 1}
    seq = seqs[0]
    row = analytic(policy, spec, seq.num_prompt_tokens, seq.num_output_tokens)
    assert row["analytic_windowed_kv_bytes"] == seq.kv_stats["device_pages_windowed"]
    assert row["analytic_full_kv_bytes"] == seq.kv_stats["device_pages_full"]


@pytest.mark.parametrize("name", list(POLICIES))
def test_invariants_hold_on_a_hybrid_model(hybrid, name):
    family, path = hybrid
    policy = load_policy(MODULE.get(name, name), POLICIES[name])
    engine = _engine(path, policy, blocks=240 if family == "gemma3" else 160)     # twice the layers of the llama
    for seed in (0, 1):
        _fuzz(engine, seed)
    _fuzz_shared(engine, 2)
    if family == "gemma3":
        assert policy.managed_layers == (1, 3) and sorted(engine.kv.released_windows) == [0, 2]


def test_dims_of_a_multimodal_checkpoint_come_from_its_text_config(tmp_path):
    """The capacity and dims checks read a Gemma-3-12B-style config (decoder shape under text_config)."""
    from systems.backends import DimsView

    text = _config("gemma3").to_dict()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text,
                                                      "vision_config": {"model_type": "siglip_vision_model"}}))
    dims = DimsView.of(tmp_path, 16, 4096)
    assert (dims.num_layers, dims.num_q_heads, dims.num_kv_heads, dims.head_dim) == (4, 4, 2, 16)
    assert dims.layer_windows == (W, None, W, None) and dims.scale == 20 ** -0.5
    from omegaconf import OmegaConf

    from harness.experiments.decode_microbench import model_dims
    from harness.experiments.decode_microbench.params import Params
    cfg = OmegaConf.create({"model": {"path": str(tmp_path)}})
    assert model_dims(cfg, Params()) == {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 16}   # decode_microbench


@pytest.mark.parametrize("name, params", [("snapkv", dict(budget=16, window=4)), ("cake", dict(budget=16, window=4)),
                                          ("h2o", dict(budget=16))])
def test_policies_compress_only_the_full_attention_layers(hybrid, name, params):
    """On Gemma-3-like layers a policy's budget holds on the global layers; the sliding ones keep every token
    counted but only their window's pages, and the analytic count matches within the policy's slack."""
    family, path = hybrid
    if family != "gemma3":
        pytest.skip("a window on every layer: the policy manages them all")
    policy = load_policy(name, params)
    engine = Engine(str(path), policy, dict(page_size=P, device_memory_gb=0.02, host_memory_gb=0.02, max_num_seqs=2,
                                            max_num_batched_tokens=128), dtype="float32")
    prompt, new = _prompts()[0], 5
    [seq] = engine.generate([GenerationRequest("a", prompt, new, ignore_eos=True)])
    kept = torch.tensor(seq.kv_stats["kept_tokens"])                    # [L, Hkv]
    tokens = len(prompt) + new - 1
    assert (kept[[0, 2]] == tokens).all() and (kept[[1, 3]] <= params["budget"] + new).all()
    assert policy.managed_layers == (1, 3) and policy.left_windows == {0: W, 2: W}
    if name == "cake":
        assert len(seq.kv_stats["layer_budgets"]) == 2
    expected = policy.expected_device_blocks(len(prompt), new)
    assert abs(seq.kv_stats["device_pages"] - expected) <= policy.expected_blocks_slack()
    assert seq.kv_stats["device_pages_windowed"] == policy.window_blocks(tokens)
    # admission: the policy's footprint counts the full layers at the budget and the windowed ones at their window
    dense = load_policy("dense")
    dense.configure(engine.kv)
    assert policy.device_blocks_needed(len(prompt), new) < dense.device_blocks_needed(len(prompt), new)
    assert dense.device_blocks_needed(len(prompt), new) < 4 * engine.kv.num_kv_heads * -(-len(prompt) // P)


def _chunked_engine(path, name: str, chunk: int, blocks: int):
    block_bytes = 2 * P * SMALL["head_dim"] * 4
    cfg = dict(page_size=P, device_memory_gb=blocks * block_bytes / 2 ** 30,
               host_memory_gb=2048 * block_bytes / 2 ** 30, max_num_seqs=4, max_num_batched_tokens=chunk,
               chunked_prefill=chunk < 4096)
    return Engine(str(path), load_policy(MODULE.get(name, name), POLICIES[name]), cfg, dtype="float32")


@pytest.mark.parametrize("name", list(POLICIES))
def test_chunked_prefill_on_a_hybrid_model(hybrid, name):
    """Chunks (ends mid-page) give the whole-prompt output under every policy, and a tight pool with chunks and
    preemption keeps the invariants: chunked admission counts a windowed layer at its window plus one chunk."""
    family, path = hybrid
    g = torch.Generator().manual_seed(7)
    requests = [GenerationRequest(f"r{i}", torch.randint(3, 200, (n,), generator=g).tolist(), 12, ignore_eos=True)
                for i, n in enumerate([37, 70, 110, 95, 5, 64])]
    whole = [s.output_ids for s in _chunked_engine(path, name, 4096, 4096).generate(requests)]
    assert [s.output_ids for s in _chunked_engine(path, name, 45, 4096).generate(requests)] == whole
    engine = _chunked_engine(path, name, 24, 240 if family == "gemma3" else 160)
    for seed in (0, 1):
        _fuzz(engine, seed)


def test_chunked_admission_reserves_the_window_not_the_prompt(hybrid):
    family, path = hybrid
    engine = _chunked_engine(path, "dense", 24, 4096)
    kv, sched = engine.kv, engine.scheduler
    rows, pages = kv.num_layers * kv.num_kv_heads, -(-110 // P)
    windowed = len(kv.released_windows)
    per_window = min(pages, -(-(W - 1) // P) + 1 + -(-24 // P))
    assert sched._dense_blocks(110) == kv.num_kv_heads * ((kv.num_layers - windowed) * pages + windowed * per_window)
    assert sched._dense_blocks(110) < rows * pages


def test_every_policy_states_what_it_does_on_windowed_layers():
    from systems.policies import policy_class, policy_names
    from systems.policies.base import WINDOWED_LAYERS

    for name in policy_names():
        cls = policy_class(name)
        assert cls is not None and cls.windowed_layers in WINDOWED_LAYERS, name


@pytest.fixture(scope="module")
def windowed_llama_like(tmp_path_factory):
    """A plain decoder the fused step runs (Qwen2: Llama's layer with QKV biases) whose last layer keeps a window:
    layers 0 and 1 full attention, layer 2 sliding."""
    import transformers as tf
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = tf.Qwen2Config(**SMALL, num_hidden_layers=3, use_sliding_window=True, sliding_window=W, max_window_layers=2)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    _randomize_norms(model)
    path = tmp_path_factory.mktemp("qwen2_window")
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("name", ["flexicache", "flexicache_naive", "quest"])
def test_a_page_rule_beside_windowed_layers_equals_the_per_op_step(windowed_llama_like, name):
    """A policy's page rule runs inside the fused step on the full-attention layers only, beside a layer that keeps
    its window: the same tokens and log-probability bits as the per-op step, which asks select_pages per layer."""
    from tests.test_deferred_eviction import instrument

    outputs, calls = [], []
    for fused in (True, False):
        engine = Engine(str(windowed_llama_like), load_policy(MODULE.get(name, name), POLICIES[name]),
                        dict(page_size=P, device_memory_gb=0.02, host_memory_gb=0.02, max_num_seqs=4,
                             max_num_batched_tokens=24, chunked_prefill=True, fused_decode=fused), dtype="float32")
        assert (engine.runner.fused is not None) == fused, engine.runner.fused_unsupported
        assert engine.policy.managed_layers == (0, 1) and sorted(engine.kv.released_windows) == [2]
        record = instrument(engine, ("decode_page_rule",))
        seqs = engine.generate([GenerationRequest(str(i), p, MAX_NEW, ignore_eos=True, logprob_steps=MAX_NEW)
                                for i, p in enumerate(_prompts())])
        outputs.append([(s.output_ids, s.token_logprobs) for s in sorted(seqs, key=lambda s: s.request.request_id)])
        calls.append(record["decode_page_rule"])
        assert engine.kv.device_blocks.num_used == 0
    assert outputs[0] == outputs[1]
    assert calls[0] > 0 and calls[1] == 0           # the fused engine ran the rule, the per-op one its hooks

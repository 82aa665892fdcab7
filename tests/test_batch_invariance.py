"""Batch-invariant greedy decoding: a prompt's tokens do not depend on its batch, the arrival order or the threads.

The model has SmolLM2-135M's matrix shapes (hidden 576, MLP 1536, 9 query / 3 KV heads of 64, vocabulary 49,152)
with random weights, so the GEMM kernels are the ones the real model uses and near-tied logits are everywhere: any
batch-dependent rounding shows up as a different token.
"""
import random
from types import SimpleNamespace

import pytest
import torch

from systems.base import GenerationRequest
from systems.engine.engine import Engine
from systems.policies import load_policy


@pytest.fixture(scope="module")
def smollm_shaped_dir(tmp_path_factory, tokenizer_dir):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, rope_theta=100000.0)
    torch.manual_seed(7)
    path = tmp_path_factory.mktemp("smollm_shaped")
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path, safe_serialization=True)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return path


def _prompts() -> list[list[int]]:
    """Ten prompts no other test uses: their own seed, lengths 20-300 (several share a prefill step)."""
    rng = random.Random(20261201)
    return [[rng.randrange(3, 49000) for _ in range(rng.randint(20, 300))] for _ in range(10)]


def _engine(path, dtype: str, threads: int) -> Engine:
    cfg = SimpleNamespace(page_size=16, device_memory_gb=0.25, host_memory_gb=0.01, max_num_seqs=16,
                          max_num_batched_tokens=1024, threads=threads, batch_invariant=True)
    return Engine(str(path), load_policy("dense", {}), cfg, dtype=dtype)


def _requests(ids: list[int]) -> list[GenerationRequest]:
    prompts = _prompts()
    return [GenerationRequest(f"p{i}", prompts[i], 10 + i % 3, ignore_eos=True, logprob_steps=1) for i in ids]


def _out(seq) -> tuple:
    """The tokens, and the bits of every chosen token's log-probability: stricter than tokens alone."""
    return seq.output_ids, seq.token_logprobs


def _staggered(engine: Engine, ids: list[int]) -> dict[str, list[int]]:
    """Requests arrive one engine step apart, so each joins a decode batch of a different size and makeup."""
    pending, seqs = _requests(ids), []
    while pending or engine.scheduler.has_work():
        if pending:
            seqs.append(engine.add_request(pending.pop(0)))
        engine.step()
    return {s.request.request_id: _out(s) for s in seqs}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_tokens_do_not_depend_on_batch_order_or_threads(smollm_shaped_dir, dtype):
    threads_before = torch.get_num_threads()
    try:
        alone = {}
        engine = _engine(smollm_shaped_dir, dtype, threads=1)
        for i in range(10):
            (seq,) = engine.generate(_requests([i]))
            alone[seq.request.request_id] = _out(seq)
        runs = []
        for threads in (1, 2):
            engine = _engine(smollm_shaped_dir, dtype, threads=threads)
            runs.append({s.request.request_id: _out(s) for s in engine.generate(_requests(list(range(10))))})
            runs.append({s.request.request_id: _out(s) for s in engine.generate(_requests([7, 2, 9]))})
            runs.append({s.request.request_id: _out(s) for s in engine.generate(_requests([5, 0, 8, 1, 6]))})
            runs.append(_staggered(engine, [3, 9, 4, 0, 6, 2]))
        for run in runs:
            assert run == {k: alone[k] for k in run}
    finally:
        torch.set_num_threads(threads_before)

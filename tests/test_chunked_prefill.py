"""Chunked prefill: decodes share steps with prompt chunks, and every policy's output equals whole-prompt prefill."""
import pytest
import torch
from test_engine_invariants import MODULE, POLICIES, TINY, _check, _fuzz

from systems.base import GenerationRequest
from systems.engine.engine import Engine
from systems.policies import load_policy

P = 4
LENGTHS = [37, 70, 110, 95, 5, 64]


def _engine(path, name, chunked: bool, budget: int, blocks: int = 4096):
    block_bytes = 2 * P * TINY["head_dim"] * 4
    cfg = dict(page_size=P, device_memory_gb=blocks * block_bytes / 2 ** 30,
               host_memory_gb=2048 * block_bytes / 2 ** 30, max_num_seqs=4, max_num_batched_tokens=budget,
               chunked_prefill=chunked)
    return Engine(str(path), load_policy(MODULE.get(name, name), POLICIES[name]), cfg, dtype="float32")


def _requests():
    g = torch.Generator().manual_seed(7)
    return [GenerationRequest(f"r{i}", torch.randint(3, 200, (n,), generator=g).tolist(), 12, ignore_eos=True)
            for i, n in enumerate(LENGTHS)]


@pytest.mark.parametrize("chunk", [32, 45])          # 45: chunk ends fall mid-page (page size 4)
@pytest.mark.parametrize("name", list(POLICIES))
def test_chunked_output_equals_whole_prompt_prefill(tiny_llama_dir, name, chunk):
    whole = _engine(tiny_llama_dir, name, chunked=False, budget=4096)
    chunked = _engine(tiny_llama_dir, name, chunked=True, budget=chunk)
    expect = [s.output_ids for s in whole.generate(_requests())]
    got = [s.output_ids for s in chunked.generate(_requests())]
    assert got == expect
    # prompts longer than the budget were split, and decodes ran in the same steps as chunks
    assert chunked.steps["prefill"] > whole.steps["prefill"]


def test_a_long_arrival_does_not_stall_running_decodes(tiny_llama_dir):
    engine = _engine(tiny_llama_dir, "dense", chunked=True, budget=16)
    first = engine.add_request(GenerationRequest("a", list(range(3, 11)), 40, ignore_eos=True))
    engine.step()                                          # the short prompt prefills in one chunk
    engine.add_request(GenerationRequest("b", list(range(3, 103)), 4, ignore_eos=True))
    before = first.num_output_tokens
    for _ in range(7):                                     # 100 prompt tokens at <= 15 per step: 7 chunk steps
        engine.step()
    assert first.num_output_tokens == before + 7           # one token per step while "b" was being prefilled


@pytest.mark.parametrize("name", list(POLICIES))
def test_invariants_hold_with_chunks_and_preemption(tiny_llama_dir, name):
    engine = _engine(tiny_llama_dir, name, chunked=True, budget=24, blocks=160)
    for seed in (0, 1):
        _fuzz(engine, seed)
    _check(engine)
    if name == "dense":
        assert engine.scheduler.num_preemptions > 0                  # chunked sequences were preempted too

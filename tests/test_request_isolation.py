"""One request's failure is its own: the engine refuses bad sampling values, and a sequence that fails in a step (its
sampling, or a forward it shares) fails alone while its neighbours finish with the tokens they get alone, on every
policy."""
from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from systems.base import GenerationRequest
from systems.engine.engine import Engine
from systems.engine.sequence import Status
from systems.policies import load_policy

P = 4                        # page size: small, so every policy's budget (and eviction, offload) is exercised
POLICIES = {
    "dense": {},
    "quest": dict(budget=3 * P, skip_layers=0),
    "flexicache": dict(budget=2 * P, rerank_interval=2, unstable_heads=[[1, 0]]),
    "lserve": dict(budget=4 * P, sink_tokens=4, local_tokens=8, physical_page=8, reuse_interval=2,
                   streaming_heads=[[0, 1], [1, 0]]),
    "cake": dict(budget=24, window=8),
    "snapkv": dict(budget=24, window=8),
    "pyramidkv": dict(budget=24, window=8),
    "h2o": dict(budget=24),
    "tova": dict(budget=24),
    "streaming": dict(budget=24),
}
POISON = "poisoned"


def _engine(path, name: str, device_blocks: int = 4096) -> Engine:
    block_bytes = 2 * P * 16 * 4                                    # K + V, one page of one head, fp32
    cfg = SimpleNamespace(page_size=P, device_memory_gb=device_blocks * block_bytes / 2 ** 30,
                          host_memory_gb=4096 * block_bytes / 2 ** 30, max_num_seqs=4, max_num_batched_tokens=512)
    return Engine(str(path), load_policy(name, POLICIES[name]), cfg, dtype="float32")


def _requests() -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 4000, (n,), generator=g).tolist() for n in (37, 52, 29)]
    return [GenerationRequest("greedy-a", prompts[0], 10, ignore_eos=True),
            GenerationRequest("sampled", prompts[1], 10, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
            GenerationRequest("greedy-b", prompts[2], 10, ignore_eos=True)]


def _run(engine: Engine, reqs: list[GenerationRequest], poison: GenerationRequest | None = None,
         nan_temperature: bool = False):
    seqs = [engine.add_request(r) for r in reqs[:1]]
    if poison is not None:
        bad = engine.add_request(poison)
        if nan_temperature:      # past the engine's gate, as a bug elsewhere could: only its own draw may fail
            bad.request = dataclasses.replace(poison, temperature=math.nan)
        seqs.append(bad)
    seqs += [engine.add_request(r) for r in reqs[1:]]
    steps = 0
    while engine.scheduler.has_work():
        engine.step()
        steps += 1
        assert steps < 500
    return seqs


def _forward_fails_with(engine: Engine, request_id: str) -> None:
    """The forward raises whenever that request shares it, after the whole step has run (KV written, policy
    hooks called): the worst case for what the others' state must survive."""
    real = engine.runner.run_step

    def run_step(decodes, chunks):
        out = real(decodes, chunks)
        if any(s.request.request_id == request_id for s in [*decodes, *(c[0] for c in chunks)]):
            raise RuntimeError("injected forward failure")
        return out

    engine.runner.run_step = run_step          # type: ignore[method-assign]


@pytest.mark.parametrize("failure", ["sampling", "forward"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_poisoned_request_fails_alone(tiny_llama_dir, policy, failure):
    engine = _engine(tiny_llama_dir, policy)
    reqs = _requests()
    alone = {s.request.request_id: s.output_ids for s in _run(engine, reqs)}
    free = (engine.kv.free_device_blocks(), engine.kv.free_host_blocks())
    poison = GenerationRequest(POISON, list(range(5, 45)), 10, temperature=0.5, seed=3, ignore_eos=True)
    if failure == "forward":
        _forward_fails_with(engine, POISON)
    seqs = _run(engine, reqs, poison, nan_temperature=failure == "sampling")
    by_id = {s.request.request_id: s for s in seqs}
    bad = by_id.pop(POISON)
    assert bad.status is Status.FINISHED and bad.finish_reason == "error"
    assert ("probability" in bad.error) if failure == "sampling" else ("injected forward failure" in bad.error)
    for rid, seq in by_id.items():            # the neighbours: finished, with the tokens they get alone
        assert seq.finish_reason == "length" and not seq.error, (rid, seq.error)
        assert seq.output_ids == alone[rid], rid
    assert (engine.kv.free_device_blocks(), engine.kv.free_host_blocks()) == free   # nothing leaked
    assert not engine.scheduler.suspects
    if failure == "forward":          # the shared step failed: all its sequences were re-run alone
        assert engine.scheduler.num_preemptions >= len(reqs) + 1
    # the step tally counts the raised forwards apart (the shared one, then the poison's own), and no other
    assert engine.tally.failed_steps >= 2 and engine.tally.failed_s > 0 if failure == "forward" \
        else engine.tally.failed_steps == 0


def test_generate_finishes_the_others_then_names_the_failed_request(tiny_llama_dir):
    engine = _engine(tiny_llama_dir, "dense")
    _forward_fails_with(engine, POISON)
    reqs = [*_requests(), GenerationRequest(POISON, [5, 6, 7], 4)]
    with pytest.raises(RuntimeError, match=f"1 of 4 requests failed; the first, request {POISON}: RuntimeError"):
        engine.generate(reqs)
    assert engine.kv.free_device_blocks() == engine.kv.device_blocks.capacity


def test_a_request_too_big_for_the_device_tier_fails_alone(tiny_llama_dir):
    engine = _engine(tiny_llama_dir, "dense", device_blocks=65)     # 64 blocks: 16 pages of 2 layers x 2 heads
    small = [GenerationRequest(f"small{i}", [5 + i] * 10, 8, ignore_eos=True) for i in range(2)]
    big = GenerationRequest("big", list(range(5, 105)), 4, ignore_eos=True)          # 100 tokens: 100 blocks
    seqs = [engine.add_request(r) for r in (small[0], big, small[1])]
    engine.run()
    assert seqs[1].finish_reason == "error" and "engine.device_memory_gb" in seqs[1].error
    assert [s.num_output_tokens for s in (seqs[0], seqs[2])] == [8, 8]
    assert engine.kv.free_device_blocks() == engine.kv.device_blocks.capacity


@pytest.mark.parametrize("change, field", [
    (dict(temperature=math.nan), "temperature"),
    (dict(temperature=math.inf), "temperature"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=math.nan), "top_p"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(seed=2 ** 70), "seed"),
    (dict(seed=1.5), "seed"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=-3), "max_new_tokens"),
    (dict(max_new_tokens=2.0), "max_new_tokens"),
    (dict(logprob_steps=-1), "logprob_steps"),
    (dict(prompt_token_ids=[5, 10 ** 9]), "prompt token ids"),
    (dict(prompt_token_ids=[5, True]), "prompt token ids"),
    (dict(prompt_token_ids=[5, 2.0]), "prompt token ids"),
    (dict(stop="x"), "stop"),
])
def test_engine_refuses_values_that_could_fail_a_batch(tiny_llama_dir, change, field):
    engine = _engine(tiny_llama_dir, "dense")
    req = dataclasses.replace(GenerationRequest("r", [5, 6, 7], 4, temperature=0.7), **change)
    with pytest.raises(ValueError, match=field) as err:
        engine.add_request(req)
    assert len(str(err.value).splitlines()) == 1
    assert not engine.scheduler.has_work()
    engine.add_request(GenerationRequest("ok", [5, 6, 7], 2, seed=2 ** 63 - 1, temperature=0.5, top_p=1.0))
    engine.run()

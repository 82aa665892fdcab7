"""Reference log-probabilities are stored exactly: the reference against itself gives KL = 0.0 and top-1 agreement
1.0, bit for bit, both from a generation's own distributions and through the teacher-forced pass."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from harness.measuring import fidelity
from systems.base import GenerationRequest

STEPS = 8


@pytest.fixture(scope="module")
def dense(tiny_llama_dir):
    from systems.engine.system import EngineSystem

    engine = SimpleNamespace(device_memory_gb=0.01, host_memory_gb=0.01, max_num_seqs=4, page_size=16)
    return EngineSystem(str(tiny_llama_dir), "dense", {}, engine=engine, dtype="float32")


def _generate(system, prompts, logprob_steps):
    return system.generate([GenerationRequest(f"s{i}", p, STEPS + 4, ignore_eos=True, logprob_steps=logprob_steps)
                            for i, p in enumerate(prompts)])


def test_dense_against_itself_gives_kl_exactly_zero(dense, tmp_path):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 4000, (n,), generator=g).tolist() for n in (21, 40, 33)]
    samples = [SimpleNamespace(id=f"sample/{i}", answers=[]) for i in range(len(prompts))]
    reference = fidelity.FidelityPlan(role="reference", steps=STEPS, gold=False, reference_dir=tmp_path)
    fidelity.run_batch(reference, dense, dense.tokenizer, samples, prompts, _generate(dense, prompts, STEPS))
    stored = fidelity.load_reference(reference.store(), samples[0].id)
    assert stored is not None and stored["logprobs"].dtype == torch.float32
    policy = fidelity.FidelityPlan(role="policy", steps=STEPS, gold=False, reference_dir=tmp_path)
    # a generation that kept its distributions (compared as they are), and one that did not (teacher-forced pass)
    for logprob_steps in (STEPS, 0):
        rows = fidelity.run_batch(policy, dense, dense.tokenizer, samples, prompts,
                                  _generate(dense, prompts, logprob_steps))
        for row in rows:
            assert row["fid_steps"] == STEPS
            assert row["fid_kl"] == 0.0 and row["fid_top1"] == 1.0, (logprob_steps, row)
    # what fp16 storage cost: the same distributions, rounded, no longer compare as identical
    rounded = fidelity.compare(stored["ids"], stored["logprobs"].half(), stored["ids"], stored["logprobs"])
    assert rounded["fid_kl"] > 0


def test_identical_rows_with_impossible_tokens_compare_as_zero_not_nan():
    row = torch.log_softmax(torch.tensor([[2.0, 1.0, float("-inf"), 0.5]]), dim=-1)
    assert fidelity.compare([0], row, [0], row.clone()) == {"fid_top1": 1.0, "fid_kl": 0.0, "fid_steps": 1}

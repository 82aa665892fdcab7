"""The HF reference system on a tiny random Llama: batching, timestamps, stop strings, memory report."""
import torch

from systems.base import GenerationRequest, cut_at_stop
from systems.hf import HFSystem


def test_tiny_llama_batched_equals_single(tiny_llama_dir):
    system = HFSystem(str(tiny_llama_dir), dtype="float32", batch_size=3)
    prompts = [[1, 5, 9, 200, 31], [1, 77, 4000], [1, 8, 8, 8, 8, 8, 8, 8]]
    reqs = [GenerationRequest(f"r{i}", p, max_new_tokens=6, ignore_eos=True) for i, p in enumerate(prompts)]
    batched = system.generate(reqs)
    single = [system.generate([r])[0] for r in reqs]
    for b, s, r in zip(batched, single, reqs):
        assert b.request_id == r.request_id
        assert b.token_ids == s.token_ids
        assert b.output_tokens == 6 == len(b.token_times)
        assert b.prompt_tokens == len(r.prompt_token_ids)
        assert all(t2 >= t1 for t1, t2 in zip(b.token_times, b.token_times[1:]))
        assert b.ttft is not None and b.ttft >= 0 and b.tpot is not None
    rep = system.memory_report()
    assert rep.mode == "physical" and rep.device_kv_peak_bytes > 0


def test_tiny_llama_matches_plain_generate(tiny_llama_dir):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    ids = torch.tensor([[1, 300, 301, 302]])
    ref = model.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)[0, 4:].tolist()
    out = HFSystem(str(tiny_llama_dir), dtype="float32").generate(
        [GenerationRequest("a", [1, 300, 301, 302], max_new_tokens=5, ignore_eos=True)])[0]
    assert out.token_ids == ref


def test_cut_at_stop():
    assert cut_at_stop("abc\ndef", ["\n"]) == ("abc", True)
    assert cut_at_stop("abc", ["\n"]) == ("abc", False)
    assert cut_at_stop("a.b,c", [",", "."]) == ("a", True)

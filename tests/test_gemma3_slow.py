"""The embedded Gemma-3-270M on the real package (slow): prepared and verified, fluent greedy English, and the engine's
fp32 greedy tokens equal HF transformers' (one prompt longer than the 512-token sliding window)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from systems.base import GenerationRequest

pytestmark = pytest.mark.slow
PROMPTS = ["The capital of France is", "Once upon a time, there was a little girl who", "def fibonacci(n):"]


def test_gemma3_270m_engine_equals_hf_greedy():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from harness.integrations.assets import GEMMA3_NAME, essay_files, model_dir
    from systems.engine.engine import Engine
    from systems.policies import load_policy
    folder = str(model_dir(None, GEMMA3_NAME))
    tok = AutoTokenizer.from_pretrained(folder)
    prompts = [tok(p).input_ids for p in PROMPTS]
    essay = tok(essay_files()[0].read_text(), add_special_tokens=False).input_ids[:700]
    prompts.append([tok.bos_token_id, *essay, *tok.encode("\n\nIn one sentence, the essay above is about",
                                                           add_special_tokens=False)])
    max_new = 24
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    reference = []
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False, top_p=None,
                                 top_k=None, temperature=None)
            reference.append(out[0, len(p):].tolist())
    del model
    text = tok.decode(reference[0])
    assert "France" in text and "city" in text, text            # fluent English about the prompt, not noise
    cfg = SimpleNamespace(page_size=16, device_memory_gb=1.0, host_memory_gb=0.1, max_num_seqs=8,
                          max_num_batched_tokens=8192)
    engine = Engine(folder, load_policy("dense"), cfg, dtype="float32")
    eos = set(engine.model.spec.eos_token_ids) | {tok.eos_token_id}
    engine.is_eos = lambda t: t in eos
    seqs = engine.generate([GenerationRequest(str(i), p, max_new) for i, p in enumerate(prompts)])
    mismatches = [(i, len(prompts[i]), tok.decode(s.output_ids), tok.decode(r))
                  for i, (s, r) in enumerate(zip(seqs, reference)) if s.output_ids != r]
    assert not mismatches, f"{len(mismatches)}/{len(prompts)} differ: {mismatches[:2]}"

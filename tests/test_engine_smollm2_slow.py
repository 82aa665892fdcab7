"""SmolLM2 in fp32: the engine's greedy tokens equal HF transformers' on 20 prompts (short chat, 2k and 6k needles)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from systems.base import GenerationRequest

pytestmark = pytest.mark.slow

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three primary colors.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Give me a name for a pet turtle.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet in one sentence.",
    "What does CPU stand for?",
]
NEEDLES = [
    ("The secret password for the vault is 'blue pelican 42'.", "What is the secret password for the vault?"),
    ("The best thing to do in San Francisco is eat a sandwich in Dolores Park.",
     "What is the best thing to do in San Francisco?"),
    ("Marta's favourite number is 318.", "What is Marta's favourite number?"),
]


def _haystack_ids(tokenizer, n_tokens: int) -> list[int]:
    from harness.integrations.assets import essay_files
    ids: list[int] = []
    for path in essay_files():
        ids += tokenizer(path.read_text(), add_special_tokens=False)["input_ids"]
        if len(ids) >= n_tokens:
            break
    return ids[:n_tokens]


def _needle_prompt(tokenizer, n_tokens: int, depth: float, needle: str, question: str) -> list[int]:
    hay = _haystack_ids(tokenizer, n_tokens)
    cut = int(len(hay) * depth)
    context = tokenizer.decode(hay[:cut]) + " " + needle + " " + tokenizer.decode(hay[cut:])
    message = f"{context}\n\nAnswer from the text above. {question}"
    return tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def _chat_prompt(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def test_smollm2_fp32_engine_equals_hf_greedy():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from harness.integrations.assets import model_dir
    from systems.engine.engine import Engine
    from systems.policies import load_policy
    folder = str(model_dir())
    tok = AutoTokenizer.from_pretrained(folder)
    prompts = [_chat_prompt(tok, c) for c in CHATS]
    for i, (needle, question) in enumerate(NEEDLES * 2):
        prompts.append(_needle_prompt(tok, 2000, [0.1, 0.5, 0.9][i % 3], needle, question))
    for i, depth in enumerate([0.2, 0.45, 0.7, 0.9]):
        needle, question = NEEDLES[i % len(NEEDLES)]
        prompts.append(_needle_prompt(tok, 6000, depth, needle, question))
    assert len(prompts) >= 20
    max_new = 32
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    reference = []
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False, top_p=None,
                                 top_k=None, temperature=None)
            reference.append(out[0, len(p):].tolist())
    del model
    cfg = SimpleNamespace(page_size=16, device_memory_gb=1.0, host_memory_gb=0.1, max_num_seqs=8,
                          max_num_batched_tokens=8192)
    engine = Engine(folder, load_policy("dense"), cfg, dtype="float32")
    eos = set(engine.model.spec.eos_token_ids) | {tok.eos_token_id}
    engine.is_eos = lambda t: t in eos
    free = engine.kv.free_device_blocks()
    seqs = engine.generate([GenerationRequest(str(i), p, max_new) for i, p in enumerate(prompts)])
    mismatches = [(i, len(prompts[i]), s.output_ids, r) for i, (s, r) in enumerate(zip(seqs, reference))
                  if s.output_ids != r]
    assert not mismatches, f"{len(mismatches)}/{len(prompts)} differ: {mismatches[:3]}"
    assert engine.kv.free_device_blocks() == free

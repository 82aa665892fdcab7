"""Real SmolLM2 checks (slow): the embedded checkpoint answers a short needle question through the harness path."""
import pytest

pytestmark = pytest.mark.slow


def test_smollm2_answers_short_needle(tokenizer_dir):
    from transformers import AutoTokenizer

    from harness.running.prompts import render
    from systems.base import GenerationRequest
    from systems.hf import HFSystem
    from tasks.base import load_task

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    task = load_task("needlebench", "srt", {"mode": "srt", "lengths": [1000], "depths": [50]})
    sample = task.samples(tok)[0]
    ids = render(sample, tok, 7500)
    out = HFSystem(str(tokenizer_dir), dtype="float32").generate(
        [GenerationRequest("s", ids, max_new_tokens=sample.max_new_tokens)])[0]
    assert task.score(sample, out.text)["score"] == 100.0, (sample.answers, out.text)

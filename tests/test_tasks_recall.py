"""Recall probe: deterministic contexts, the target paragraph where asked, ROUGE-L scoring and the baseline."""
import re

import pytest
from fixtures.task_tokenizer import WordTokenizer

from tasks.base import TaskError, load_task


def make(**params):
    return load_task("recall", "recall", {"context_tokens": [1500], "passage_tokens": [128], **params}, seed=2)


def paragraphs_of(sample):
    body = sample.prompt.split("\n\n", 1)[1]
    body = re.split(r"\n\nParagraph \d+ is repeated|\n\nRepeat, word for word", body)[0]
    paras = body.split("\n\n")
    assert all(p.startswith(f"Paragraph {i + 1}: ") for i, p in enumerate(paras))
    return [p.split(": ", 1)[1] for p in paras]


def test_samples_are_deterministic_and_hold_the_target_once_at_its_depth():
    a = make(depths=[0, 50, 100]).samples(WordTokenizer())
    b = make(depths=[0, 50, 100]).samples(WordTokenizer())
    assert [s.prompt for s in a] == [s.prompt for s in b]
    for sample in a:
        paras = paragraphs_of(sample)
        assert len(paras) == sample.meta["paragraphs"]
        target = paras[round(sample.meta["depth"] / 100 * (len(paras) - 1))]
        phrase = " ".join(target.split()[:10])
        assert target == f"{phrase} {sample.answers[0]}"          # the answer is the rest of the paragraph
        label = f"Paragraph {round(sample.meta['depth'] / 100 * (len(paras) - 1)) + 1}"
        assert sample.prompt.endswith(f"{label} is repeated here in full:\n\n{label}: {phrase}")
        assert sample.prompt.count(phrase) == 2                     # its paragraph and the lead-in
        assert sum(p.startswith(phrase) for p in paras) == 1 and not sample.chat_template
        assert 90 <= sample.meta["target_tokens"] <= 200 and sample.meta["prompt_tokens"] <= 1500
        assert sample.max_new_tokens >= sample.meta["target_tokens"] and sample.stop == ("\n\nParagraph ",)
    assert len({s.answers[0] for s in a}) == 3


def test_chat_style_asks_for_the_whole_paragraph():
    (sample,) = make(depths=[50], style="chat").samples(WordTokenizer())
    paras = paragraphs_of(sample)
    assert sample.chat_template and sample.answers[0] == paras[round(0.5 * (len(paras) - 1))]
    assert sample.prompt.endswith("Write out the whole paragraph and nothing else.")


def test_exact_copy_scores_100_and_beats_the_random_paragraph_baseline():
    task = make(depths=[50])
    (sample,) = task.samples(WordTokenizer())
    target = sample.answers[0]
    exact = task.score(sample, target)
    assert exact["score"] == pytest.approx(100.0)
    half = task.score(sample, " ".join(target.split()[: len(target.split()) // 2]))
    assert half["precision"] == pytest.approx(100.0) and 40 < half["recall"] < 60
    assert task.score(sample, "")["score"] == 0.0
    assert 0 < sample.meta["baseline_random_paragraph"] < 40
    rows = [{**exact, "meta": sample.meta, "prediction": target}]
    summary = task.summarize(rows)
    assert summary["score"] == pytest.approx(100.0)
    assert summary["margin_over_baseline"] == pytest.approx(100.0 - sample.meta["baseline_random_paragraph"])
    assert summary["ctx1500_depth50"] == pytest.approx(100.0)


def test_bad_params_fail_with_the_key_to_fix():
    with pytest.raises(TaskError, match="passage_tokens"):
        make(passage_tokens=[2048])
    with pytest.raises(TaskError, match="context_tokens"):
        make(context_tokens=[200])
    with pytest.raises(TaskError, match="task.params.style"):
        make(style="essay")
    assert make(max_new_tokens=64).samples(WordTokenizer())[0].max_new_tokens == 64


@pytest.mark.slow
def test_smollm2_dense_recall_beats_the_random_paragraph_baseline():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from harness.integrations.assets import model_dir
    tok = AutoTokenizer.from_pretrained(model_dir())
    model = AutoModelForCausalLM.from_pretrained(model_dir(), dtype=torch.bfloat16).eval()
    task = load_task("recall", "recall", {"context_tokens": [2000], "depths": [90], "passage_tokens": [128]})
    rows = []
    for sample in task.samples(tok):
        ids = torch.tensor([tok.encode(sample.prompt)])          # completion style: no chat template
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=sample.max_new_tokens, do_sample=False)
        text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).split(sample.stop[0])[0]
        rows.append({**task.score(sample, text), "meta": sample.meta, "prediction": text})
    summary = task.summarize(rows)
    assert summary["score"] > summary["baseline_random_paragraph"] + 20

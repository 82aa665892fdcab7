"""LongBench and L-Eval metrics on hand-worked cases from the upstream definitions."""
import pytest

from tasks import metrics as m


def test_english_normalization_drops_punctuation_articles_and_case():
    assert m.normalize_en("An apple, the banana & a pear.") == "apple banana pear"
    assert m.normalize_en("Theory of Anatomy") == "theory of anatomy"       # only whole-word articles
    assert m.normalize_en("The A-Team", lowercase=False) == "The ATeam"     # L-Eval exam keeps case


def test_qa_f1():
    assert m.qa_f1("The Eiffel Tower!", "eiffel tower") == 1.0
    assert m.qa_f1("a big red apple", "the red apple") == pytest.approx(0.8)   # P 2/3, R 1
    assert m.qa_f1("", "anything") == 0.0
    assert m.qa_f1("the", "a") == 0.0                                          # both normalize to nothing
    assert m.best_over_references(m.qa_f1, "Paris", ["London", "Paris, France"]) == pytest.approx(2 / 3)


def test_chinese_f1_uses_jieba_words_and_drops_punctuation():
    assert m.segment_zh("我在北京大学") == ["我", "在", "北京大学"]
    assert m.qa_f1_zh("北京大学。", "我在北京大学") == pytest.approx(0.5)      # 1 of 3 reference words
    assert m.normalize_zh("Ｈｅｌｌｏ， 世界！ ") == "ｈｅｌｌｏ世界"
    assert m.qa_f1_zh("", "北京") == 0.0


def test_rouge_l_follows_the_rouge_package():
    # `rouge` counts distinct tokens: 4 of 5 shared both ways.
    assert m.rouge_l("the cat sat on the mat", "the cat is on the mat") == pytest.approx(0.8, abs=1e-6)
    assert m.rouge_l("", "the cat") == 0.0                                     # package raises -> 0
    assert m.rouge_l("...", "the cat") == 0.0
    # jieba: [今天天气, 很, 好] vs [今天天气, 不错]: LCS 1, P 1/3, R 1/2.
    assert m.rouge_l_zh("今天天气很好", "今天天气不错") == pytest.approx(0.4, abs=1e-6)


def test_classification_partial_credit_and_substring_rule():
    classes = ["Location", "Number", "Description", "Entity"]
    assert m.classification("Number", "Number", all_classes=classes) == 1.0
    assert m.classification("Number or Location", "Location", all_classes=classes) == 0.5
    assert m.classification("Entity", "Number", all_classes=classes) == 0.0
    assert m.classification("Full Name", "Full Name", all_classes=["Name", "Full Name"]) == 1.0
    # Upstream removes while iterating: "a" slides into the removed slot and is never checked.
    assert m.classification("abc", "abc", all_classes=["ab", "a", "abc"]) == 0.5


def test_retrieval_and_count_are_shares_of_digit_runs():
    assert m.retrieval("Paragraph 3", "Paragraph 3") == 1.0
    assert m.retrieval("Paragraph 3 or Paragraph 7", "Paragraph 3") == 0.5
    assert m.retrieval("Paragraph 13", "Paragraph 3") == 0.0
    assert m.retrieval("I am not sure", "Paragraph 3") == 0.0
    assert m.retrieval_zh("答案是段落5", "段落5") == 1.0
    assert m.count("There are 12 unique paragraphs.", "12") == 1.0
    assert m.count("12 or 13", "12") == 0.5
    assert m.count("", "12") == 0.0


def test_code_sim_takes_the_first_code_line():
    assert m.code_sim("\n\n# comment\n    return a + b\nfoo", "    return a + b") == 1.0
    assert m.code_sim("```python\nx = 1", "x = 1") == 1.0
    assert m.code_sim("abce", "abcd") == 0.75                  # indel distance 2 over 8 characters
    assert m.code_sim("sitting", "kitten") == 0.62             # LCS 4: 8/13 = 61.5 -> 62
    assert m.code_sim("// only comments", "x = 1") == 0.0
    assert m.fuzz_ratio("", "") == 100


def test_first_line_and_aggregation():
    assert m.first_line("\n\nLocation\nQuestion: where?") == "Location"
    assert m.first_line("") == ""
    assert m.longbench_aggregate([1.0, 0.5, 0.0]) == 50.0
    assert m.longbench_aggregate([1 / 3]) == 33.33


def test_leval_exam():
    assert m.leval_exam("A", "A") == 1.0
    assert m.leval_exam("AB", "ABC") == 0.25                   # coursera: a subset of the correct options
    assert m.leval_exam("AD", "AB") == 0.0
    assert m.leval_exam("", "B") == 0.25                       # upstream: the empty set is a subset
    assert m.leval_exam("12.0", "12") == 1.0
    assert m.leval_exam("\nx\nThe capital is paris", "Paris") == 1.0   # anywhere in the output
    assert m.leval_exam("Sure!\nTHE HISTORY OF JAZZ", "The history of jazz") == 1.0  # upstream since Oct 2023
    assert m.leval_exam("The history\nof jazz", "The history of jazz") == 0.0     # only spaces are removed
    assert m.leval_exam("Lyon", "Paris") == 0.0


def test_leval_f1_and_rouge():
    assert m.leval_f1("The Red Apple.", "red apple") == 1.0
    got = m.leval_rouge_best("the cat sat", ["a dog", "the cat sat on the mat"])
    assert got["rouge1"] == pytest.approx(200 / 3)            # P 1, R 1/2
    assert got["rouge2"] == pytest.approx(400 / 7)            # P 1, R 2/5
    assert got["rougeL"] == pytest.approx(200 / 3)
    assert m.leval_rouge("", "the cat")["rouge1"] == 0.0
    assert m.geometric_mean_rouge(8.0, 1.0, 8.0) == pytest.approx(4.0)
    assert m.split_sentences("One. Two!  Three?") == "One.\nTwo!\nThree?"

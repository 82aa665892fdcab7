"""Scoring functions of LongBench v1 (THUDM/LongBench metrics.py, eval.py) and L-Eval (Evaluation/*.py).

Every function returns the upstream per-sample value (0-1 for LongBench, 0/0.25/1 for L-Eval exam) so the
callers can aggregate exactly as upstream does (`longbench_aggregate`: round(100 * mean, 2)).
Backends, pinned: ROUGE-L for LongBench is the PyPI `rouge==1.0.1` package itself (n-gram sets, raises on an
empty hypothesis, which scores 0 as upstream); code similarity uses `rapidfuzz`'s ratio rounded to an
integer, which is fuzzywuzzy's `fuzz.ratio` with its python-Levenshtein backend; L-Eval ROUGE uses
`rouge-score`. L-Eval splits sentences with nltk punkt, whose data cannot be downloaded offline; we split on
[.!?] followed by whitespace instead, which only changes rougeLsum (rouge_score's tokenizer drops newlines,
so R1, R2, RL and the L-Eval geometric mean are unaffected).
"""
from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache
from typing import Any

_EN_PUNCT = set(string.punctuation)
_ZH_PUNCT = _EN_PUNCT | set("！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣"
                            "､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏.")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_DIGITS = re.compile(r"\d+")


# -- normalization ------------------------------------------------------------------------------
def normalize_en(text: str, lowercase: bool = True) -> str:
    """SQuAD normalization: lowercase, drop ASCII punctuation, articles -> space, single spaces."""
    if lowercase:
        text = text.lower()
    text = "".join(ch for ch in text if ch not in _EN_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def normalize_zh(text: str) -> str:
    """LongBench Chinese normalization: lowercase, drop ASCII + CJK punctuation, drop all whitespace."""
    return "".join("".join(ch for ch in text.lower() if ch not in _ZH_PUNCT).split())


@lru_cache(maxsize=1)
def _jieba() -> Any:
    import jieba
    jieba.setLogLevel(60)          # its dictionary-loading banner is noise in logs
    return jieba


def segment_zh(text: str) -> list[str]:
    """jieba precise-mode segmentation, as upstream (`jieba.cut(text, cut_all=False)`)."""
    return list(_jieba().cut(text, cut_all=False))


# -- LongBench ----------------------------------------------------------------------------------
def token_f1(prediction: Sequence[str], reference: Sequence[str]) -> float:
    same = sum((Counter(prediction) & Counter(reference)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(prediction), same / len(reference)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, reference: str, **_: Any) -> float:
    return token_f1(normalize_en(prediction).split(), normalize_en(reference).split())


def qa_f1_zh(prediction: str, reference: str, **_: Any) -> float:
    def tokens(text: str) -> list[str]:
        return [t for t in (normalize_zh(tok) for tok in segment_zh(text)) if t]
    return token_f1(tokens(prediction), tokens(reference))


def rouge_l(prediction: str, reference: str, **_: Any) -> float:
    """ROUGE-L F of the `rouge` package; any exception (empty hypothesis, recursion depth) scores 0."""
    from rouge import Rouge
    try:
        return Rouge().get_scores([prediction], [reference], avg=True)["rouge-l"]["f"]
    except Exception:          # upstream's bare except: every failure is a zero
        return 0.0


def rouge_l_zh(prediction: str, reference: str, **_: Any) -> float:
    return rouge_l(" ".join(segment_zh(prediction)), " ".join(segment_zh(reference)))


def classification(prediction: str, reference: str, *, all_classes: Sequence[str], **_: Any) -> float:
    """1/len(matches) when the gold class is among the class names found in the prediction."""
    matched = [c for c in all_classes if c in prediction]
    i = 0
    while i < len(matched):
        term = matched[i]
        if term in reference and term != reference:
            # Upstream removes while iterating a list, so the element sliding into slot i is never checked.
            matched.remove(term)
        i += 1
    return 1.0 / len(matched) if reference in matched else 0.0


def _digit_share(prediction: str, gold: str) -> float:
    numbers = _DIGITS.findall(prediction)
    return sum(n == gold for n in numbers) / len(numbers) if numbers else 0.0


def retrieval(prediction: str, reference: str, **_: Any) -> float:
    return _digit_share(prediction, re.findall(r"Paragraph (\d+)", reference)[0])


def retrieval_zh(prediction: str, reference: str, **_: Any) -> float:
    return _digit_share(prediction, re.findall(r"段落(\d+)", reference)[0])


def count(prediction: str, reference: str, **_: Any) -> float:
    return _digit_share(prediction, str(reference))


def fuzz_ratio(a: str, b: str) -> int:
    """fuzzywuzzy `fuzz.ratio` (python-Levenshtein backend): equal strings 100, an empty one 0."""
    from rapidfuzz import fuzz
    if a == b:
        return 100
    if not a or not b:
        return 0
    return int(round(fuzz.ratio(a, b)))


def code_sim(prediction: str, reference: str, **_: Any) -> float:
    """Edit similarity of the first generated line that is not a comment or a code fence."""
    line = next((ln for ln in prediction.lstrip("\n").split("\n")
                 if "`" not in ln and "#" not in ln and "//" not in ln), "")
    return fuzz_ratio(line, reference) / 100


LONGBENCH_METRICS: dict[str, Callable[..., float]] = {
    "qa_f1": qa_f1, "qa_f1_zh": qa_f1_zh, "rouge": rouge_l, "rouge_zh": rouge_l_zh,
    "classification": classification, "retrieval": retrieval, "retrieval_zh": retrieval_zh,
    "count": count, "code_sim": code_sim,
}


def first_line(prediction: str) -> str:
    """Few-shot sets are scored on the first generated line only."""
    return prediction.lstrip("\n").split("\n")[0]


def best_over_references(metric: Callable[..., float], prediction: str, references: Iterable[str],
                         **kwargs: Any) -> float:
    return max([0.0] + [metric(prediction, ref, **kwargs) for ref in references])


def longbench_aggregate(values: Sequence[float]) -> float:
    """Dataset score: round(100 * mean of per-sample values in [0, 1], 2)."""
    return round(100 * sum(values) / len(values), 2) if values else float("nan")


# -- L-Eval -------------------------------------------------------------------------------------
def leval_exam(prediction: str, reference: str) -> float:
    """L-Eval exact match: options (gold only A-D) 1 exact / 0.25 subset; else number or substring match."""
    gold = normalize_en(reference, lowercase=False)
    if all(ch in "ABCD" for ch in gold):
        pred = normalize_en(prediction, lowercase=False)
        if pred == gold:
            return 1.0
        return 0.25 if set(pred) <= set(gold) else 0.0
    try:
        return float(float(prediction) == float(reference))
    except ValueError:
        pass
    # the whole output: upstream dropped its "first line longer than one character" rule in October 2023
    return 1.0 if reference.lower().replace(" ", "") in prediction.lower().replace(" ", "") else 0.0


def leval_f1(prediction: str, reference: str) -> float:
    """SQuAD token F1 (0-1)."""
    return token_f1(normalize_en(prediction).split(), normalize_en(reference).split())


def split_sentences(text: str) -> str:
    """Offline stand-in for "\\n".join(nltk.sent_tokenize(text))."""
    return "\n".join(s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s)


@lru_cache(maxsize=1)
def _rouge_scorer() -> Any:
    from rouge_score import rouge_scorer
    return rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL", "rougeLsum"], use_stemmer=False)


def leval_rouge(prediction: str, reference: str) -> dict[str, float]:
    """rouge-score F-measures x100 for rouge1/2/L/Lsum on sentence-split text."""
    scores = _rouge_scorer().score(split_sentences(reference), split_sentences(prediction))
    return {key: value.fmeasure * 100 for key, value in scores.items()}


def leval_rouge_best(prediction: str, references: Iterable[str]) -> dict[str, float]:
    """Per-key max over references (upstream aggregates each ROUGE key separately)."""
    per_ref = [leval_rouge(prediction, ref) for ref in references]
    return {key: max(r[key] for r in per_ref) for key in per_ref[0]}


def geometric_mean_rouge(r1: float, r2: float, rl: float) -> float:
    """The reported L-Eval ROUGE score."""
    return (r1 * r2 * rl) ** (1 / 3)

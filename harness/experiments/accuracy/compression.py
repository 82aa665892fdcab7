"""exp.params.compression: whether a policy compresses with the question in view or the context alone.

`query_aware` (the default, and what every cell did before the mode existed) prefills the whole prompt at once, so a
policy that scores tokens by the last queries (SnapKV's window) sees the question. `query_agnostic` prefills and
compresses the context alone, then prefills the question onto the compressed cache (kvpress's default protocol), so
one compressed context can answer any later question. Only systems whose backend declares `shared_context` can split
a prompt; any other system in the grid is refused rather than silently run query-aware under a query-agnostic label.
A non-default mode names the cell (key suffix, config) so cells of the two modes never mix; default cells keep the
keys they had.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig

from harness.experiments.accuracy.params import COMPRESSION_MODES, COMPRESSION_PHRASES
from harness.running.config import UserError
from harness.running.prompts import render_parts
from systems.registry import backend_of

DEFAULT = COMPRESSION_MODES[0]


def check(mode: str) -> None:
    if mode not in COMPRESSION_MODES:
        raise UserError(f"exp.params.compression={mode!r}: use one of {list(COMPRESSION_MODES)}")


def check_systems(mode: str, systems: Sequence[DictConfig]) -> None:
    """Refuse, before any model loads, a system that cannot run the mode."""
    if mode == DEFAULT:
        return
    unable = sorted({str(s.name) for s in systems if not backend_of(s).shared_context})
    if unable:
        raise UserError(f"exp.params.compression={mode}: system(s) {unable} cannot compress a context apart from its "
                        "question (their backend lacks shared_context); drop them or use query_aware")


def key_suffix(mode: str) -> str:
    return "" if mode == DEFAULT else f"__compression={mode}"


def phrase(mode: str) -> str:
    """The line every accuracy summary prints about the mode."""
    return f"Compression: {COMPRESSION_PHRASES.get(mode, mode)}."


def context_lens(mode: str, samples: Sequence[Any], prompts: Sequence[list[int]], tokenizer: Any,
                 max_input_tokens: int) -> dict[str, int | None]:
    """{sample id: GenerationRequest.context_len}: None (query-aware) for every sample in the default mode, and for a
    sample without a context part; else the length of its rendered context part."""
    out: dict[str, int | None] = {}
    for sample, prompt in zip(samples, prompts):
        if mode == DEFAULT:
            out[sample.id] = None
            continue
        context, question = render_parts(sample, tokenizer, max_input_tokens)
        # the split is of the very prompt the cell sends: anything else would compress other tokens than it scores
        assert context + question == prompt, f"sample {sample.id}: render_parts differs from the rendered prompt"
        out[sample.id] = len(context) or None
    return out

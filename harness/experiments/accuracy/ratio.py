"""kvpress's `compression_ratio` as the budget language of an accuracy run: one budget per sample, from its context.

kvpress removes the share `compression_ratio` of the KV pairs of every layer (`n_kept = int(k_len * (1 - r))`,
0 <= r < 1, each KV head keeping its own positions). Here `exp.params.compression_ratio` does the same through each
budgeted policy's own budget: a sample whose prompt holds n tokens runs with budget int(n * (1 - r)) tokens per
layer and KV head, rounded down to the policy's granularity (Policy.budget_granularity: a page for paged policies,
a token otherwise) and at least one granule, mapped onto its knobs by Policy.with_budget. The budget travels with
the request (GenerationRequest.kv_budget) into generation and the teacher-forced passes. Exclusive with
`budget` and `budgets`; systems that keep the full cache run as configured. kvpress compresses the context before
the question; the engine's policies compress the prompt they are given, so n counts the whole rendered prompt.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig

from harness.running.config import UserError, plain
from harness.running.grid import swept
from systems.policies import policy_class


def check(ratio: float | None, budget: int | None, budgets: list | None) -> None:
    if ratio is None:
        return
    if budget is not None or budgets is not None:
        raise UserError("set exp.params.compression_ratio or exp.params.budget(s), not both")
    if not 0.0 <= float(ratio) < 1.0:
        raise UserError(f"exp.params.compression_ratio={ratio}: kvpress's ratio is the share of the KV removed, "
                        "0 <= ratio < 1")


def applies(system: DictConfig, ratio: float | None) -> bool:
    """Whether the ratio sets this system's budget (a budgeted policy; the full-cache ones run as configured)."""
    return ratio is not None and swept(system)


def budget_for(system: DictConfig, ratio: float, context: int) -> int:
    """kvpress's kept count for a context of `context` tokens, in the policy's granularity."""
    cls = policy_class(system.policy)
    assert cls is not None, "validated cells name known policies"
    step = max(1, int(cls.budget_granularity(plain(system.params), int(system.engine.page_size))))
    kept = int(context * (1.0 - float(ratio)))
    return max(step, kept // step * step)


def sample_budgets(system: DictConfig, ratio: float, samples: Sequence[Any], prompts: Sequence[list[int]]
                   ) -> dict[str, int]:
    """{sample id: budget} for every sample, each checked against the policy before any generation (a budget the
    policy cannot run at names the sample and the fix)."""
    cls = policy_class(system.policy)
    assert cls is not None
    params = plain(system.params)
    out: dict[str, int] = {}
    for sample, prompt in zip(samples, prompts):
        budget = budget_for(system, ratio, len(prompt))
        try:
            cls.from_params(cls.with_budget(params, budget))
        except ValueError as exc:
            raise UserError(f"{system.name} cannot keep {budget} tokens of sample {sample.id!r} ({len(prompt)} "
                            f"prompt tokens) at compression_ratio={ratio}: {exc}; lower the ratio") from None
        out[sample.id] = budget
    return out


def phrase(ratio: float | None, budget: int | None, budgets: list | None) -> str:
    """How a summary names the budget, kvpress's words for a ratio (a leading space; empty without a budget)."""
    if ratio is not None:
        return (f" at kvpress compression_ratio {float(ratio):g} (each budgeted policy keeps (1 − {float(ratio):g}) × "
                "each sample's prompt tokens per layer and KV head, rounded down to its page)")
    if budget is not None:
        return f" at a budget of {budget} tokens"
    if budgets:
        return f" at budgets of {', '.join(str(b) for b in budgets)} tokens (`system@budget`)"
    return ""

"""exp.params of every accuracy kind: the reference, fidelity settings, per-task params, budgets, the size reasons."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from harness.running.params import GridParams

FIDELITY_DEFAULTS = {"steps": 64, "gold": True}
COMPRESSION_MODES = ("query_aware", "query_agnostic")
# how a summary says what the policy saw when it compressed
COMPRESSION_PHRASES = {
    "query_aware": "query-aware (the whole prompt, question included, is prefilled before the policy compresses)",
    "query_agnostic": "query-agnostic (the context is prefilled and compressed alone, the question is prefilled "
                      "onto the compressed cache: kvpress's default protocol)",
}
# change only how the summary reads the finished cells: a new value rebuilds the summary and reruns nothing
REPORT_PARAMS = frozenset({"reference", "min_reference_score", "size_reason", "budget_reason"})


@dataclass
class AccuracyParams(GridParams):
    reference: Optional[str] = None            # system label retention and fidelity compare with; None: scores only
    min_reference_score: float = 5.0           # units whose reference is less above chance are left out of averages
    fidelity: Any = True                       # false | true | {steps, gold}: teacher-forced fidelity settings
    task_params: dict[str, Any] = field(default_factory=dict)   # {task name: {param: value}} per-task overrides
    budgets: Optional[list[int]] = None        # run every budgeted policy at each budget (`system@budget`)
    # kvpress's compression_ratio instead of a budget: each budgeted policy keeps (1 - ratio) x each sample's context
    # (prompt tokens) per layer and KV head, rounded down to its granularity (harness.experiments.accuracy.ratio)
    compression_ratio: Optional[float] = None
    # query_aware: the policy compresses with the question in view (the whole prompt at once); query_agnostic: the
    # context alone, then the question onto the compressed cache (systems that support shared contexts only)
    compression: str = "query_aware"
    size_reason: str = ""                      # why the committed grid is this size (printed in the summary)
    budget_reason: str = ""

"""Model transfer: the same accuracy grid on several models (exp.models), and whether the policy ranking carries over.

Each model of exp.models runs the experiment's systems × tasks as an ordinary accuracy grid in its own folder
(`results/<exp>/<model name>/`, with that model's own summary), driven by the models axis of the shared driver
(harness.running.models). The summary across models (`results/<exp>/summary.md`) gives per model the retention table
(score, retention = policy ÷ reference on the same samples, n, 95 % paired bootstrap intervals), the reference's score
beside chance per task unit (a retention is only worth reading where the reference is well above chance), Kendall's τ
between the two models' retention rankings with a bootstrap interval, the pairs whose order flips (and whether both
models' paired intervals exclude 0), and a bar chart of retention per policy, one colour per model
(model_transfer.transfer holds the statistics).

A policy that needs a profile made on the model (FlexiCache's head-stability profile, LServe's DuoAttention gates)
and has none for one of the models is left out on that model, not run with another model's profile: the summary
names it with the command that makes the profile, and the ranking compares the policies every model ran. This keeps
the other policies' comparison available at once; make the profile and rerun to add the policy (finished cells are
reused).

exp.params: as accuracy_retention (budget, reference, min_reference_score, fidelity, task_params, size_reason,
budget_reason), plus well_above_chance (points, default 20: the margin over chance the summary asks of the reference's
score before it calls a unit's retentions informative).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.experiments.accuracy import Accuracy, AccuracyItem
from harness.experiments.accuracy.cells import collect
from harness.experiments.accuracy.params import REPORT_PARAMS, AccuracyParams
from harness.experiments.model_transfer import report
from harness.running.config import UserError
from harness.running.experiment import Run


@dataclass
class Params(AccuracyParams):
    well_above_chance: float = 20.0      # points over chance the reference should score for a unit to be informative


class ModelTransfer(Accuracy):
    """Per model an accuracy grid (its summary is the accuracy kind's); across models, report.write."""

    params_type = Params
    report_params = REPORT_PARAMS | {"well_above_chance"}

    def check(self, run: Run[Any]) -> None:
        super().check(run)
        if not run.cfg.exp.get("models"):
            raise UserError("model_transfer compares models: set exp.models (e.g. [smollm2, gemma3_270m])")
        if run.params.reference is None:
            raise UserError("model_transfer needs exp.params.reference, the system each retention divides by")
        if run.params.budgets is not None:
            raise UserError("model_transfer compares policies at one budget: set exp.params.budget, not budgets")

    def found(self, run: Run[Any]) -> report.Found:
        """The model's finished cells, as its own summary reads them."""
        mine = [c.item for c in self.cells(run) if isinstance(c.item, AccuracyItem)]
        return collect(run, [i.keyed() for i in mine], [i.label for i in mine], self.label_of, self.report_params,
                       lambda g: self.cell_config(run, g))

    def report_models(self, run: Run[Any], runs: list[Run[Any]]) -> dict[str, str]:
        found = {str(r.cfg.model.name): self.found(r) for r in runs}
        return report.write(run, {m: f for m, f in found.items() if f[0]})


EXPERIMENT = ModelTransfer()

"""The CAKE ablation's report: which finished cell is which ablation point, and the tables and plots of each study."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from harness.experiments.accuracy.data import AccuracyData
from harness.experiments.cake_ablation.params import Params
from harness.reporting import plots
from harness.reporting import uncertainty as unc
from harness.reporting.summary import Summary
from harness.reporting.uncertainty import Estimate


def matches(row: dict, study: str, want: dict) -> bool:
    """Whether a row is the point `want` of `study` (run for it, or run for another study with the same params)."""
    if row["study"] == study:
        return all(row[k] == v for k, v in want.items())
    if study not in row.get("also", []):
        return False
    if study == "tau":
        return [want["tau1"], want["tau2"]] in row.get("tau_alias", [])
    return all(row[k] == v for k, v in want.items())


class AblationReport:
    """The ablation's tables and plots, from the finished cells and the points they were run for."""

    def __init__(self, p: Params, data: AccuracyData, reference: str, points: list[dict], summary: Summary,
                 out_dir: Path):
        self.p, self.data, self.reference, self.points = p, data, reference, points
        self.summary, self.out_dir = summary, out_dir

    def find(self, budget: int, study: str, **want: Any) -> str | None:
        return next((pt["label"] for pt in self.points if pt["budget"] == budget and matches(pt, study, want)), None)

    def n_text(self) -> str:
        """The samples behind each point (paired with the reference)."""
        counts = sorted({e.n for e in (self.retention(pt["label"]) for pt in self.points) if e.n})
        return (f"n = {counts[0]}" if len(counts) == 1 else f"n = {counts[0]}–{counts[-1]}" if counts
                else "n = 0") + " paired samples per point"

    def retention(self, label: str | None) -> Estimate:
        return self.data.macro_retention(label, self.reference) if label else unc.NAN

    def heatmap(self, name: str, labs: list[list[str | None]], rows: list, cols: list, **kw: Any) -> str:
        return plots.heatmap(self.out_dir / name, [[self.retention(x).value for x in row] for row in labs], rows,
                             cols, colorbar=f"retention vs {self.reference}", digits=2,
                             notes=[[ci_note(self.retention(x)) if x else "" for x in row] for row in labs],
                             note=self.summary.figure_note(self.n_text()), **kw)

    def grid(self, b: int) -> None:
        p, ref = self.p, self.reference
        labs = [[self.find(b, "grid", allocation=a, indicator=i) for i in p.indicators] for a in p.allocations]
        self.summary.section(f"Allocation × indicator at budget {b} (CAKE F8; T2/T3 are its row/column): "
                             f"retention vs `{ref}`")
        self.summary.table(["allocation \\ indicator", *p.indicators],
                           [[a, *[self.retention(x).fmt(2) for x in row]] for a, row in zip(p.allocations, labs)])
        self.summary.image(f"png_grid_{b}", self.heatmap(
            f"allocation_x_indicator_b{b}.png", labs, p.allocations, p.indicators, xlabel="eviction indicator",
            ylabel="budget allocation", title=f"CAKE ablation at {b} tokens/layer"), f"allocation x indicator b{b}")

    def study(self, study: str, budgets: list[int]) -> None:
        values = self.p.allocations if study == "allocation" else self.p.indicators
        fixed = (f"indicator {self.p.base.indicator}" if study == "allocation"
                 else f"allocation {self.p.base.allocation}")
        est = {b: [self.retention(self.find(b, study, **{study: x})) for x in values] for b in budgets}
        self.summary.section(f"{study.capitalize()} study ({fixed}; CAKE {'T2' if study == 'allocation' else 'T3'}): "
                             f"retention vs `{self.reference}` [95 % CI] n")
        self.summary.table([study, *[f"budget {b}" for b in budgets]],
                           [[x, *[est[b][j].fmt(2) for b in budgets]] for j, x in enumerate(values)])
        self.summary.image(f"png_{study}", plots.bar_plot(
            self.out_dir / f"{study}.png", [str(x) for x in values],
            {f"budget {b}": [e.value for e in est[b]] for b in budgets},
            errors={f"budget {b}": [(e.low, e.high) for e in est[b]] for b in budgets},
            notes={f"budget {b}": [f"n={e.n}" if e.n else "" for e in est[b]] for b in budgets},
            xlabel=study, ylabel=f"retention vs {self.reference} (95 % CI)", reference=1.0,
            reference_label=f"{self.reference} (= 1)", title=f"CAKE {study} ablation ({fixed})",
            note=self.summary.figure_note(self.n_text())), study)

    def taus(self, b: int) -> None:
        p = self.p
        labs = [[self.find(b, "tau", tau1=float(t1), tau2=float(t2)) for t2 in p.tau2s] for t1 in p.tau1s]
        self.summary.section(f"tau1 × tau2 at budget {b} (CAKE F13; {p.base.allocation} + {p.base.indicator}): "
                             f"retention vs `{self.reference}`")
        self.summary.table(["tau1 \\ tau2", *[f"{t:g}" for t in p.tau2s]],
                           [[f"{t1:g}", *[self.retention(x).fmt(2) for x in row]] for t1, row in zip(p.tau1s, labs)])
        self.summary.image(f"png_tau_{b}", self.heatmap(
            f"tau_sweep_b{b}.png", labs, p.tau1s, p.tau2s, xlabel="tau2 (variance exponent 1/τ2)",
            ylabel="tau1 (entropy exponent 1/τ1)", title=f"CAKE tau sweep at {b} tokens/layer"), f"tau sweep b{b}")


def ci_note(e: Estimate) -> str:
    return f"[{e.low:.2f}, {e.high:.2f}]" if math.isfinite(e.low) and math.isfinite(e.high) else ""


def retention_columns(e: Estimate) -> dict:
    return {"retention": e.value, "retention_ci_low": e.low, "retention_ci_high": e.high, "n": e.n}

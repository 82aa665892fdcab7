"""exp.params of the CAKE ablation: budgets, the allocations and indicators studied, the tau sweep, the base point."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harness.experiments.accuracy.params import AccuracyParams


@dataclass
class Base:
    allocation: str = "preference"
    indicator: str = "mean_plus_var"


@dataclass
class Params(AccuracyParams):
    budgets: list[int] = field(default_factory=lambda: [128])     # CAKE cache_size points (not a budget sweep)
    allocations: list[str] = field(default_factory=lambda: ["preference", "uniform", "pyramid", "random"])
    indicators: list[str] = field(default_factory=lambda: ["mean_plus_var", "mean", "var", "mean_times_var"])
    full_grid: bool = False
    tau1s: list[float] = field(default_factory=list)
    tau2s: list[float] = field(default_factory=list)
    base: Base = field(default_factory=Base)
    template_params: dict[str, Any] = field(default_factory=dict)

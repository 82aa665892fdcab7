"""The experiment interface: typed Params, the cells of a run, the work of one cell, and the report from disk.

An experiment kind is a module or package `harness.experiments.<kind>` exposing EXPERIMENT, an instance of an
`Experiment` subclass. It never loops over cells: the driver (harness.running.driver) plans, checks, runs, resumes
and summarizes them, asking the experiment four things:

- `params_type`: the dataclass of its exp.params (typed: a typo or a wrong type fails in one line);
- `cells(run)`: the cells to run, each a `Cell` (key, the config that makes it, what it needs);
- `run_cell(run, cell, store)`: the work of one cell, returning its metrics (rows go to `store` as they come);
- `report(run, cells)`: the summary, built from what the cells stored on disk.

A kind that compares models implements `report_models` (the same grid on each model of exp.models, one summary
across them). Optional hooks: `check` (cheap validation before any work), `plan_cell` (finish a pending cell's plan,
e.g. render its prompts, and say how much of it is on disk), `is_complete` (a cell whose completeness is not just its
metrics), `damage` (what is wrong with a cell's files, beyond what every store checks; `row_fields` are the fields
every row it stores has). `report_params` names the exp.params that only change how the summary is written:
changing them reuses every finished cell and rebuilds the summary, and a finished cell counts for the summary
whatever their value was.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

from omegaconf import DictConfig

from harness.reporting.summary import Summary
from harness.running.cells import stored_metrics
from harness.running.config import dump_yaml
from harness.running.damage import ROW_FIELDS, Damage
from harness.running.grid import GridCell, left_out_of_budget
from harness.running.params import GridParams
from harness.running.progress import RunProgress
from harness.running.store import CellStore
from harness.running.workspace import Workspace
from systems.policies.base import Policy

P = TypeVar("P", bound=GridParams)


@dataclass
class Cell:
    """One unit of work whose results live in results/<exp>/<key>/, run once and resumed after any crash."""

    key: str                                    # folder name under results/<exp>/
    config: DictConfig                          # what config.yaml records: another config reruns the cell
    label: str                                  # what progress and logs call it
    units: int = 1                              # progress units (samples, requests, steps)
    system: DictConfig | None = None            # the system it runs, checked against `fits` before any weights load
    policy: Policy | None = None                # that system's policy, parsed once
    fits: tuple[int, int] | None = None         # (prompt tokens, new tokens) of its largest request
    first: bool = False                         # runs before the others (a reference later cells read)
    item: Any = None                            # what the experiment needs to run it

    def config_yaml(self) -> str:
        return dump_yaml(self.config)


@dataclass
class Run(Generic[P]):
    """What the experiment sees of the run: config, typed params, the grid, the results folder, the workspace."""

    cfg: DictConfig
    params: P
    grid: list[GridCell]
    out_dir: Path
    workspace: Workspace
    same_code: bool = True                      # read only cells made by this code (False: a rebuild from disk)
    progress: RunProgress | None = None
    extra_systems: list[DictConfig] = field(default_factory=list)   # systems outside the grid (left-out notes)
    notes: list[str] = field(default_factory=list)      # what the summary must say about what it read (damage)

    def advance(self, units: int) -> None:
        """Count `units` of the current cell as done (progress bar and ETA)."""
        if self.progress is not None:
            self.progress.advance(units)

    def stored(self, key: str) -> dict | None:
        """A complete cell's metrics, its env record attached as `_env`, or None."""
        return stored_metrics(self.out_dir, key)

    def summary(self, title: str | None = None, envs: list[dict] | None = None) -> Summary:
        """The summary writer, told which systems a shared budget left as configured (it says so)."""
        summary = Summary(self.cfg, title, envs)
        params = self.cfg.exp.get("params") or {}
        budget = params.get("budget") or params.get("budgets")
        left_out = left_out_of_budget([c.system for c in self.grid] + self.extra_systems) if budget else []
        if left_out:
            summary.note("Left out of the shared budget, run as configured: " + "; ".join(left_out) + ".")
        for note in self.notes:
            summary.note(note)
        return summary


class Experiment(Generic[P]):
    """Base of every experiment kind; see the module docstring for what a kind declares."""

    params_type: ClassVar[type] = GridParams      # its exp.params dataclass
    report_params: ClassVar[frozenset[str]] = frozenset()   # exp.params that change only the summary
    row_fields: ClassVar[tuple[str, ...]] = ROW_FIELDS      # fields every row of its predictions.jsonl has
    # merged into every system of the grid before its cells are keyed, on the settings its backend honours
    system_defaults: ClassVar[Mapping[str, Any]] = {}

    def check(self, run: Run[P]) -> None:
        """Cheap checks of the params and grid (UserError names the fix), before any model loads."""

    def cells(self, run: Run[P]) -> list[Cell]:
        raise NotImplementedError

    def plan_cell(self, run: Run[P], cell: Cell, store: CellStore) -> int:
        """Called for each cell that will run, before any does: finish its plan (render prompts, set `units` and
        `fits`) and return the units already on disk (a resumed cell)."""
        return 0

    def is_complete(self, run: Run[P], cell: Cell, store: CellStore) -> bool:
        """Whether the cell's results on disk are complete and made by this code with this config."""
        return store.is_complete(cell.config_yaml())

    def damage(self, run: Run[P], store: CellStore) -> Damage:
        """What is wrong with a cell folder's files (falsy: nothing), checked before the folder is reused, resumed
        or summarized; a kind that stores more files extends it."""
        return store.damage(self.row_fields)

    def run_cell(self, run: Run[P], cell: Cell, store: CellStore) -> dict:
        """The work of one cell: its metrics (the driver writes them and marks the cell complete)."""
        raise NotImplementedError

    def report(self, run: Run[P], cells: list[Cell]) -> dict[str, str]:
        """Write the summary from what the cells stored; returns the paths written (md, csv, PNGs)."""
        raise NotImplementedError

    def report_models(self, run: Run[P], runs: list[Run[P]]) -> dict[str, str]:
        """With exp.models: the summary across models (into run.out_dir) from each model's run, once every model's
        cells are on disk (harness.running.models). A kind that does not override it refuses exp.models."""
        raise NotImplementedError

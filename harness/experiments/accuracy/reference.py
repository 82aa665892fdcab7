"""The reference's cells in every run that compares with it, so a job of a sweep never loses retention or fidelity.

`python -m harness -m +exp=accuracy_retention system=dense,streaming exp.systems=[]` runs one job per system: the
streaming job's grid has no engine-dense, yet its retention and teacher-forced fidelity are measured against it. So
an accuracy run whose reference is not in its grid adds the reference's cells exactly as a run naming both systems
would make them (same keys, same config): complete ones are reused from disk, missing ones run once in this job
before the others — the driver holds a file lock around every cell, so concurrent jobs needing the same reference
cell run it once and the others wait and reuse it.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig, OmegaConf

from harness.running.config import CONF_DIR, UserError
from harness.running.experiment import Run
from harness.running.grid import GridCell, resolve_cells, validate_cells

Grid = tuple[list[GridCell], list[str]]


def system_file(label: str) -> str | None:
    """The conf/system file whose `name` is `label` (the reference is named by its system label)."""
    for path in sorted((CONF_DIR / "system").glob("*.yaml")):
        node = OmegaConf.load(path)
        if isinstance(node, DictConfig) and node.get("name") == label:
            return path.stem
    return None


def with_reference(run: Run[Any], grid: Grid, make_grid: Callable[[Run[Any]], Grid],
                   system_defaults: Any) -> Grid:
    """`grid` plus the reference's cells when exp.params.reference names a system the grid lacks; `make_grid` is the
    kind's own expansion (per-task params, budgets, ablation points), applied to a run of the reference alone."""
    reference = getattr(run.params, "reference", None)
    cells, labels = grid
    if reference is None or reference in labels:
        return grid
    name = system_file(reference)
    if name is None:
        raise UserError(f"reference system {reference!r} is neither in the grid {sorted(set(labels))} nor the name of "
                        "a conf/system file: add it to exp.systems or set exp.params.reference")
    cfg = copy.deepcopy(run.cfg)
    cfg.exp.systems = [name]
    ref_grid = resolve_cells(cfg, system_defaults)
    validate_cells(cfg, ref_grid)
    ref_cells, ref_labels = make_grid(Run(cfg, run.params, ref_grid, run.out_dir, run.workspace, run.same_code))
    keep = [(c, label) for c, label in zip(ref_cells, ref_labels) if label == reference]
    known = {c.key for c in cells}
    keep = [(c, label) for c, label in keep if c.key not in known]
    return [c for c, _ in keep] + cells, [label for _, label in keep] + labels

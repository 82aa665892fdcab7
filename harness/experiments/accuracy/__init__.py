"""The `accuracy` kind: any system × task grid scored, with retention and fidelity against a reference when there is
one (engine-dense or exp.params.reference); a single cell is the default run of `python -m harness`."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from harness import accuracy_cells, accuracy_report
from harness.running.params import AccuracyParams
from harness.running.runner import GridCell

Params = AccuracyParams
SYSTEM_DEFAULTS = accuracy_cells.SYSTEM_DEFAULTS
grid = accuracy_cells.grid


def write_summary(cfg, p, cells, labels, metrics, rows_by_cell, out_dir) -> dict[str, str]:
    return accuracy_report.write_cells_summary(cfg, p, cells, labels, metrics, rows_by_cell, out_dir)


def run(cfg: DictConfig, cells: list[GridCell], out_dir: Path) -> Any:
    return accuracy_cells.run_kind(sys.modules[__name__], cfg, cells, out_dir)


def summarize(cfg: DictConfig, cells: list[GridCell], out_dir: Path, same_code: bool = True) -> dict[str, str]:
    return accuracy_cells.summarize_kind(sys.modules[__name__], cfg, cells, out_dir, same_code)

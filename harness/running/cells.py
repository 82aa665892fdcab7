"""Cells on disk: a cell's resolved config, and the finished cells of a results folder read back for a summary.

Every summary is built from the complete cells of its results folder — after a run, after a multirun job (whichever
job ends last sees every finished cell), or by `python -m harness.report`.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from harness.running.damage import CONFIG, ENV, METRICS, ROW_FIELDS, set_aside
from harness.running.envinfo import code_identity, static_env
from harness.running.store import CellStore


@dataclass
class StoredCell:
    """A finished cell read back from its folder; `system` and `task` are OmegaConf nodes as in a grid cell."""

    key: str
    root: Path
    config: dict
    metrics: dict
    env: dict

    @property
    def system(self) -> DictConfig:
        return OmegaConf.create(self.config.get("system") or {"name": None})

    @property
    def task(self) -> DictConfig:
        return OmegaConf.create(self.config.get("task") or {"name": None})

    def rows(self, fields: Sequence[str] = ROW_FIELDS) -> list[dict]:
        return CellStore(self.root).rows(fields)


def exp_block(cfg: DictConfig, report_params: Iterable[str] = ()) -> dict:
    """The experiment block as stored in a cell's config.yaml (resolved, plain data), without `report_params`."""
    return without_report_params(yaml.safe_load(OmegaConf.to_yaml(cfg.exp, resolve=True)), report_params)


def without_report_params(exp: Any, report_params: Iterable[str]) -> Any:
    """An experiment block with the exp.params that change only the summary dropped (a cell is the same cell
    whatever they were when it ran)."""
    if not isinstance(exp, dict) or not isinstance(exp.get("params"), dict):
        return exp
    drop = set(report_params)
    return {**exp, "params": {k: v for k, v in exp["params"].items() if k not in drop}}


def finished(out_dir: Path, exp: dict | None = None, same_code: bool = True,
             report_params: Iterable[str] = ()) -> list[StoredCell]:
    """Complete, readable cells under out_dir (folders set aside skipped; a damaged one is left to the summary's
    damage note), optionally only those made with the experiment block `exp` (compared without `report_params`)
    and with the code running now."""
    out: list[StoredCell] = []
    if not Path(out_dir).is_dir():
        return out
    now = code_identity(static_env())
    for folder in sorted(Path(out_dir).iterdir()):
        if not folder.is_dir() or set_aside(folder):
            continue
        try:
            metrics = json.loads((folder / METRICS).read_text(encoding="utf-8"))
            config = yaml.safe_load((folder / CONFIG).read_text(encoding="utf-8")) or {}
            env = json.loads((folder / ENV).read_text(encoding="utf-8"))
        except (OSError, ValueError, yaml.YAMLError):
            continue
        if not (isinstance(metrics, dict) and isinstance(config, dict) and isinstance(env, dict)):
            continue
        if not metrics.get("complete"):
            continue
        if exp is not None and without_report_params(config.get("exp"), report_params) != exp:
            continue
        if same_code and code_identity(env) != now:
            continue
        out.append(StoredCell(folder.name, folder, config, metrics, env))
    return out


def cell_config(cfg: DictConfig, **parts: Any) -> DictConfig:
    """A cell's resolved config: the model, the experiment block, the seed, plus what makes this cell (system,
    task, lengths, ...)."""
    return OmegaConf.create({"model": cfg.model, "exp": cfg.exp, "seed": cfg.seed, **parts})


def stored_metrics(out_dir: Path, key: str) -> dict | None:
    """A complete cell's metrics with its env record attached as `_env` (for provenance), or None (a damaged cell:
    the summary's damage note names it)."""
    root = Path(out_dir) / key
    try:
        metrics = json.loads((root / METRICS).read_text(encoding="utf-8"))
        env = json.loads((root / ENV).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(metrics, dict) or not isinstance(env, dict):
        return None
    return {**metrics, "_env": env} if metrics.get("complete") else None

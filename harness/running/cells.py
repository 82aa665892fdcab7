"""Cells on disk: a cell's resolved config, and the finished cells of a results folder read back for a summary.

Every summary is built from the complete cells of its results folder — after a run, after a multirun job (whichever
job ends last sees every finished cell), or by `python -m harness.report`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

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

    def rows(self) -> list[dict]:
        return CellStore(self.root).rows()


def exp_block(cfg: DictConfig) -> dict:
    """The experiment block as stored in a cell's config.yaml (resolved, plain data)."""
    return yaml.safe_load(OmegaConf.to_yaml(cfg.exp, resolve=True))


def finished(out_dir: Path, exp: dict | None = None, same_code: bool = True) -> list[StoredCell]:
    """Complete cells under out_dir (stale folders skipped), optionally only those made with the experiment block
    `exp` and with the code running now."""
    out: list[StoredCell] = []
    if not Path(out_dir).is_dir():
        return out
    now = code_identity(static_env())
    for folder in sorted(Path(out_dir).iterdir()):
        if not folder.is_dir() or ".stale-" in folder.name:
            continue
        try:
            metrics = json.loads((folder / "metrics.json").read_text())
            config = yaml.safe_load((folder / "config.yaml").read_text()) or {}
            env = json.loads((folder / "env.json").read_text())
        except (OSError, ValueError):
            continue
        if not metrics.get("complete"):
            continue
        if exp is not None and config.get("exp") != exp:
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
    """A complete cell's metrics with its env record attached as `_env` (for provenance), or None."""
    root = Path(out_dir) / key
    try:
        metrics = json.loads((root / "metrics.json").read_text())
        env = json.loads((root / "env.json").read_text())
    except (OSError, ValueError):
        return None
    return {**metrics, "_env": env} if metrics.get("complete") else None

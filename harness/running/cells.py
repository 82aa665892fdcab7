"""Cells on disk: run one store-backed cell (skip, resume, retire stale), and find an experiment's finished cells.

Every experiment kind runs its cells through `run_cell`, except the two whose cells resume part-way on the same
store: accuracy cells per sample (harness.accuracy_cells) and online-sweep cells per request rate
(harness.online_cells). Each builds its summary from the complete cells of its results folder, so a summary is
always rebuilt from disk — after a run, after a multirun job (whichever job ends last sees every finished cell),
or by `python -m harness.report`.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from harness.running.envinfo import code_identity, env_record, static_env
from harness.running.progress import RunProgress
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


def run_cell(cfg: DictConfig, key: str, config: DictConfig, out_dir: Path, work: Callable[[CellStore], dict],
             progress: RunProgress, label: str, units: int = 1) -> dict:
    """Run `work` for one cell unless a complete one made by this code and config is on disk; the returned
    metrics are written (atomically) and mark the cell complete."""
    store = CellStore(out_dir / key)
    text = OmegaConf.to_yaml(config, resolve=True)
    if store.is_complete(text):
        progress.skip_cell(label)
        return store.metrics()
    store.open(text, env_record(cfg.seed))
    progress.start_cell(label, 0, units)
    metrics = work(store)
    progress.advance(units)
    progress.end_cell()
    store.write_metrics(metrics)
    return metrics


def check_fits(cfg: DictConfig, model_dir: Path, system_cfg: DictConfig, prompt_len: int, new_tokens: int) -> None:
    """Fail before any weights load when an engine system's device pool cannot hold one request of this size
    (every policy answers from the model's dimensions alone)."""
    from systems.hardware import dtype_bytes
    from systems.registry import check_capacity

    check_capacity(system_cfg, model_dir, dtype_bytes(cfg.model.dtype), prompt_len, new_tokens,
                   cfg.model.max_model_len)


def cell_config(cfg: DictConfig, **parts: Any) -> DictConfig:
    """A cell's resolved config: the model, the experiment block, the seed, plus what makes this cell (system,
    task, lengths, ...)."""
    return OmegaConf.create({"model": cfg.model, "exp": cfg.exp, "seed": cfg.seed, **parts})


def provenance(cells: list[StoredCell]) -> str:
    """Which code made the cells (git sha and code hash), for a summary rebuilt from disk."""
    made = sorted({(c.env.get("git_sha") or "unknown")[:10] + " / code " + str(c.env.get("code_hash")) for c in cells})
    if not made:
        return ""
    return ("Cells made at git " + ", ".join(f"`{m}`" for m in made)
            + (" — more than one code version: rerun to make them agree." if len(made) > 1 else "."))


def stored_metrics(out_dir: Path, key: str) -> dict | None:
    """A complete cell's metrics with its env record attached as `_env` (for provenance), or None."""
    root = Path(out_dir) / key
    try:
        metrics = json.loads((root / "metrics.json").read_text())
        env = json.loads((root / "env.json").read_text())
    except (OSError, ValueError):
        return None
    return {**metrics, "_env": env} if metrics.get("complete") else None

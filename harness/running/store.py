"""Results on disk: one folder per cell with predictions appended atomically, resumable after any crash.

Layout: results/<exp>/<cell-key>/{predictions.jsonl, metrics.json, config.yaml, env.json}.
A row is one JSON line written with a single write() and fsync'd, so a crash leaves at most one torn last
line; opening the cell cuts it off, so a rerun resumes at the first missing sample with no lost or
duplicated rows. metrics.json (written by temp file + rename) marks the cell complete.

A cell is resumed (or reused when complete) only by the code that made it, on the same arithmetic: when env.json
names another code hash (of the source and config files), package set or matrix ISA, or config.yaml differs
outside its experiment block (model, system, task, seed, lengths, ...), the folder is moved aside to
`<cell-key>.stale-<sha>` and the cell runs again, so a summary never mixes code versions or machine classes under
one provenance line. Asking (`stale_reason`, `is_complete`) never moves anything: the driver moves a folder aside only
once every check of the run has passed, so a command that fails validation leaves a finished result where it was.
A folder damaged from outside (harness.running.damage) is moved aside as `<cell-key>.damaged-<time>`.
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml

from harness.running.damage import CONFIG, ENV, METRICS, PREDICTIONS, ROW_FIELDS, Damage, inspect, row_problem
from harness.running.envinfo import code_identity, static_env

log = logging.getLogger("kvharness")


def atomic_write_text(path: Path, text: str) -> None:
    """Write to a temporary name in the same folder, fsync, rename: readers see old or new, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=True, default=str) + "\n")


def same_cell(config_yaml: str, stored: str | dict) -> bool:
    """Whether a resolved config and a stored one (YAML text, or already parsed) make the same cell: they agree
    outside their experiment blocks."""
    return bool(_cell_config(config_yaml) == _cell_config(stored))


def _cell_config(config: str | dict) -> Any:
    """The part of a resolved config that decides a cell's results: everything but the experiment block (whose
    params name the grid, e.g. a sweep's other budgets, and enter the cell key where they change a cell)."""
    conf = yaml.safe_load(config) if isinstance(config, str) else config
    return {k: v for k, v in conf.items() if k != "exp"} if isinstance(conf, dict) else conf


class CellStore:
    """One cell's folder: its predictions, metrics, resolved config and environment record."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._env: dict | None = None           # the env this process opened the cell with

    @property
    def predictions_path(self) -> Path:
        return self.root / PREDICTIONS

    def is_complete(self, config_yaml: str | None = None) -> bool:
        """metrics.json marks the cell complete, made by the code running now (and with `config_yaml`'s settings
        when given). Moves nothing: a stale folder is simply not complete."""
        if self.stale_reason(config_yaml) is not None:
            return False
        try:
            return bool(json.loads((self.root / METRICS).read_text()).get("complete"))
        except (OSError, ValueError, AttributeError):
            return False

    def damage(self, row_fields: Sequence[str] = ROW_FIELDS) -> Damage:
        """What is damaged in the folder (harness.running.damage); falsy when nothing is."""
        return inspect(self.root, row_fields)

    def stale_reason(self, config_yaml: str | None = None, env: dict | None = None) -> str | None:
        """Why other code (or another config) made the folder, or None when this run may reuse or resume it."""
        try:
            old_env = json.loads((self.root / ENV).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(old_env, dict):
            return None
        now = env if env is not None else self._env if self._env is not None else static_env()
        old_id, new_id = code_identity(old_env), code_identity(now)
        if old_id != new_id:
            what = [name for name, a, b in zip(("code", "packages", "matrix ISA"), old_id, new_id) if a != b]
            return f"made at git {(old_env.get('git_sha') or 'unknown')[:10]}" + (
                " with uncommitted changes" if old_env.get("git_diff") else "") + f", the {' and '.join(what)} " \
                f"differ{'s' if len(what) == 1 else ''} now"
        if config_yaml is not None and (self.root / CONFIG).is_file() and not same_cell(
                config_yaml, (self.root / CONFIG).read_text()):
            return "made with another model, system, task or seed"
        return None

    def retire_if_stale(self, config_yaml: str | None = None, env: dict | None = None) -> bool:
        """Move the folder aside if other code (or another config) made it; True when it did."""
        why = self.stale_reason(config_yaml, env)
        if why is None:
            return False
        try:
            sha = (json.loads((self.root / ENV).read_text()).get("git_sha") or "unknown")[:10]
        except (OSError, ValueError, AttributeError):
            sha = "unknown"
        self.move_aside(f"stale-{sha}", f"stale cell {self.root.name}: {why}")
        return True

    def move_aside(self, suffix: str, why: str) -> Path:
        """Rename the folder to `<key>.<suffix>` (numbered when taken), saying why; nothing in it is deleted."""
        stem = f"{self.root.name}.{suffix}"
        target, n = self.root.with_name(stem), 1
        while target.exists():
            n += 1
            target = self.root.with_name(f"{stem}-{n}")
        os.replace(self.root, target)
        log.warning("%s; moved to %s, running it again", why, target.name)
        return target

    def open(self, config_yaml: str, env: dict) -> None:
        """Create the folder, record how the cell is made, and cut a torn last line from a crash."""
        self.retire_if_stale(config_yaml, env)
        self._env = env
        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.root / CONFIG, config_yaml)
        atomic_write_json(self.root / ENV, env)
        self._repair()

    def _repair(self) -> None:
        path = self.predictions_path
        if not path.exists():
            return
        data = path.read_bytes()
        keep = data.rfind(b"\n") + 1  # everything after the last newline is a torn write
        good, seen = [], set()
        for line in data[:keep].splitlines(keepends=True):
            row, _ = row_problem(line.rstrip(b"\n"), ROW_FIELDS)
            if row is not None and row["id"] not in seen:   # a duplicate: a crash between write and bookkeeping
                seen.add(row["id"])
                good.append(line)
        fixed = b"".join(good)
        if fixed != data:
            tmp = path.with_name(f".{path.name}.repair")
            tmp.write_bytes(fixed)
            os.replace(tmp, path)

    def rows(self, fields: Sequence[str] = ROW_FIELDS) -> list[dict]:
        """The readable rows with `fields`, each id once, in file order; a line that is not such a row is left out
        here and counted by `damage()`, which a run checks first and a summary states."""
        try:
            data = self.predictions_path.read_bytes()
        except FileNotFoundError:
            return []
        out, seen = [], set()
        for line in data.split(b"\n")[:-1]:      # after the last newline: nothing, or a write a crash cut short
            row, _ = row_problem(line, fields)
            if row is not None and row["id"] not in seen:
                seen.add(row["id"])
                out.append(row)
        return out

    def done_ids(self) -> set[str]:
        return {r["id"] for r in self.rows()}

    def append(self, rows: Iterable[dict]) -> None:
        with open(self.predictions_path, "a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, sort_keys=True, default=str) + "\n")
                f.flush()
            os.fsync(f.fileno())

    def write_metrics(self, metrics: dict) -> None:
        atomic_write_json(self.root / METRICS, {**metrics, "complete": True})

    def metrics(self) -> dict:
        return json.loads((self.root / METRICS).read_text())

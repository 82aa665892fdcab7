"""Experiment tracking: `tracking=mlflow` logs every cell and every summary of a run to an MLflow store.

Per cell that runs (the driver calls `log_cell` once its metrics are on disk): one MLflow run named by the cell key,
with the cell's config as parameters (flattened: `system.params.budget`, `task.name`, `exp.params.fidelity`, ...),
its numeric metrics (flattened the same way: `summary.score`, `n`, `generation_seconds`, ...), its config.yaml,
env.json and metrics.json as artifacts, and tags for the experiment, system, task and git sha. Per summary
(`log_summary`): one run named `summary` holding summary.md, the tidy CSVs, results.json and the figures as
artifacts, and each task unit's score, retention and fidelity (value, interval and n) from results.json as metrics.

The store is `tracking.uri` (any MLflow tracking URI) or `file:./mlruns`, a local folder. MLflow 3 keeps its file
store in maintenance mode and refuses it unless MLFLOW_ALLOW_FILE_STORE is set; a local folder is what a CPU user
without a server has, so this module sets it for `file:` stores (a value the user exported wins).
"""
from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from omegaconf import DictConfig

log = logging.getLogger("kvharness")
MAX_PARAM = 500                  # MLflow stores params as strings; long prose (size_reason) is cut, not dropped


class Tracker(Protocol):
    def log_cell(self, key: str, root: Path, metrics: Mapping[str, Any]) -> None: ...

    def log_summary(self, out_dir: Path, paths: Mapping[str, str]) -> None: ...


def tracker_for(cfg: DictConfig) -> Tracker | None:
    """The run's tracker (None when tracking is off); a one-line error when the backend is unknown or missing."""
    from harness.running.config import UserError

    node = cfg.get("tracking")
    backend = str(node.backend) if node is not None else "none"
    if backend == "none":
        return None
    if backend != "mlflow":
        raise UserError(f"tracking={backend!r}: use tracking=mlflow (or tracking=none)")
    try:
        import mlflow  # noqa: F401 - checked before any cell runs
    except ImportError:
        raise UserError("tracking=mlflow needs mlflow-skinny: run `make setup` (requirements/tracking.txt)") from None
    return MLflowTracker(cfg)


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings as `a.b.c` keys (lists stay values)."""
    if isinstance(node, Mapping):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: node}


def metric_name(name: str) -> str:
    """MLflow metric keys allow letters, digits, `_ - . / ` and spaces: the rest (`@`, `×`, `:`) become `-`."""
    return re.sub(r"[^A-Za-z0-9_\-./ ]", "-", name)


def numeric(values: Mapping[str, Any]) -> dict[str, float]:
    return {metric_name(k): float(v) for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")}


class MLflowTracker:
    def __init__(self, cfg: DictConfig):
        import mlflow

        self.mlflow = mlflow
        uri = cfg.tracking.uri or Path("mlruns").resolve().as_uri()
        if uri.startswith("file:") or "://" not in uri:           # a local folder
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        for name in ("mlflow", "alembic", "git"):             # its INFO lines name nothing a user can act on
            logging.getLogger(name).setLevel(logging.WARNING)
        mlflow.set_tracking_uri(uri)
        self.experiment = cfg.tracking.experiment or f"kvharness/{cfg.exp.name}"
        mlflow.set_experiment(self.experiment)
        self.exp_name = str(cfg.exp.name)
        self.uri = uri

    def log_cell(self, key: str, root: Path, metrics: Mapping[str, Any]) -> None:
        import yaml

        config = yaml.safe_load((root / "config.yaml").read_text()) if (root / "config.yaml").is_file() else {}
        env = json.loads((root / "env.json").read_text()) if (root / "env.json").is_file() else {}
        params = {k: (str(v) if len(str(v)) <= MAX_PARAM else str(v)[:MAX_PARAM - 1] + "…")
                  for k, v in flatten(config or {}).items()}
        system = (config or {}).get("system") or {}
        task = (config or {}).get("task") or {}
        tags = {"kvharness.experiment": self.exp_name, "kvharness.cell": key, "kvharness.kind": "cell",
                "kvharness.system": str(system.get("name", "")), "kvharness.task": str(task.get("name", "")),
                "mlflow.source.git.commit": str(env.get("git_sha") or ""),
                "kvharness.code_hash": str(env.get("code_hash") or "")}
        with self.mlflow.start_run(run_name=key, tags=tags):
            self.mlflow.log_params(params)
            self.mlflow.log_metrics(numeric(flatten({k: v for k, v in metrics.items() if not k.startswith("_")})))
            for name in ("config.yaml", "env.json", "metrics.json"):
                if (root / name).is_file():
                    self.mlflow.log_artifact(str(root / name))

    def log_summary(self, out_dir: Path, paths: Mapping[str, str]) -> None:
        out_dir = Path(out_dir)
        doc = json.loads((out_dir / "results.json").read_text()) if (out_dir / "results.json").is_file() else {}
        metrics: dict[str, Any] = {}
        for r in doc.get("results") or []:
            for name in ("score", "retention", "fid_top1", "fid_kl"):
                est = r.get(name) or {}
                for field, value in (("", est.get("value")), ("_ci_low", est.get("ci_low")),
                                     ("_ci_high", est.get("ci_high")), ("_n", est.get("n"))):
                    metrics[f"{r['system']}/{r['task_unit']}/{name}{field}"] = value
        budget = doc.get("budget") or {}
        tags = {"kvharness.experiment": self.exp_name, "kvharness.kind": "summary",
                "kvharness.machine": str((doc.get("machine") or {}).get("class", ""))}
        with self.mlflow.start_run(run_name="summary", tags=tags):
            regenerate = str((doc.get("provenance") or {}).get("regenerate", ""))
            self.mlflow.log_params({f"budget.{k}": str(v) for k, v in budget.items()}
                                   | {"regenerate": regenerate[:MAX_PARAM]})
            self.mlflow.log_metrics(numeric(metrics))
            for path in paths.values():
                p = Path(path)
                if p.is_dir():
                    self.mlflow.log_artifacts(str(p), artifact_path=p.name)
                elif p.is_file():
                    self.mlflow.log_artifact(str(p))
        log.info("tracking: logged to MLflow experiment %r at %s", self.experiment, self.uri)


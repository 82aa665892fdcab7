"""The one loop every experiment runs through: resolve, validate, plan, check fits, run or resume, close, summarize.

`run(cfg)` is what `python -m harness` calls: it resolves the experiment kind and its grid, validates everything that
needs no model, then `drive`s the experiment's cells — complete ones are skipped, half-written ones resume, cells
marked `first` run before the others — with one progress display and ETA, the workspace (and the live system) closed
whatever happens, and the summary built from the cells on disk at the end. `summarize` does only the last step (a
summary rebuilt from disk, `python -m harness.report`).

Every cell runs under an exclusive file lock (`<results>/<exp>/.locks/<key>.lock`, released by the OS if the process
dies): two processes that need the same cell — the jobs of a sweep that all compare with one reference cell — run it
once; the others wait, find it complete and reuse it. A job of a multirun writes no summary: the sweep summarizes
each results folder once, after its last job (harness.running.sweep).
"""
from __future__ import annotations

import contextlib
import fcntl
import importlib
import importlib.metadata
import importlib.util
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from harness.integrations.tracking import Tracker, tracker_for
from harness.reporting.summary import print_paths
from harness.running import damage as damage_lib
from harness.running import models
from harness.running import params as params_lib
from harness.running.config import (
    USER_ERRORS,
    UserError,
    check_dtype,
    check_model_lengths,
    check_no_extra_keys,
    check_one_model,
    check_paths,
    check_writable,
    pin_dtype,
    quiet_libraries,
)
from harness.running.envinfo import env_record
from harness.running.experiment import Cell, Experiment, Run
from harness.running.grid import resolve_cells, validate_cells
from harness.running.progress import RunProgress
from harness.running.store import CellStore
from harness.running.workspace import Workspace
from systems.registry import backend_of

log = logging.getLogger("kvharness")
EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"
ENTRY_POINTS = "kvharness.experiments"


def experiment_kinds() -> list[str]:
    """Every kind under harness/experiments/ (a module, or a package holding its helpers), and installed ones."""
    here = [p.stem if p.suffix == ".py" else p.name for p in EXPERIMENTS.iterdir()
            if (p.suffix == ".py" and not p.name.startswith("_")) or (p / "__init__.py").is_file()]
    return sorted({*here, *(e.name for e in importlib.metadata.entry_points(group=ENTRY_POINTS))})


def find_experiment(kind: str) -> Experiment[Any]:
    """The EXPERIMENT of harness.experiments.<kind>, else of an installed package's `kvharness.experiments` entry
    point named `kind` (a module exposing EXPERIMENT, or the Experiment itself); a one-line error lists the kinds."""
    found: Any = None
    if kind.isidentifier() and importlib.util.find_spec(f"harness.experiments.{kind}") is not None:
        found = importlib.import_module(f"harness.experiments.{kind}")
    else:
        ep = next((e for e in importlib.metadata.entry_points(group=ENTRY_POINTS) if e.name == kind), None)
        if ep is None:
            raise UserError(f"unknown exp.kind {kind!r}; choose one of {experiment_kinds()} (harness/experiments/, "
                            f"or a package's `{ENTRY_POINTS}` entry point)")
        found = ep.load()
    experiment = found if isinstance(found, Experiment) else getattr(found, "EXPERIMENT", None)
    if not isinstance(experiment, Experiment):
        raise UserError(f"experiment kind {kind!r} exposes no EXPERIMENT (an instance of "
                        "harness.running.experiment.Experiment)")
    return experiment


def prepare(cfg: DictConfig, same_code: bool = True) -> tuple[Experiment[Any], Run[Any]]:
    """The experiment and its run context: dtype pinned, grid resolved, params parsed, everything validated."""
    out_dir = check_paths(cfg)
    check_one_model(out_dir, str(cfg.model.name))
    pin_dtype(cfg)
    experiment = find_experiment(cfg.exp.kind)
    grid = resolve_cells(cfg, experiment.system_defaults)
    check_no_extra_keys(cfg)
    check_dtype(cfg)
    try:
        params: Any = params_lib.parse(cfg, experiment.params_type)
    except params_lib.ParamsError as exc:
        raise UserError(str(exc)) from None
    validate_cells(cfg, grid)
    check_model_lengths(cfg)
    run = Run(cfg, params, grid, out_dir, Workspace(cfg), same_code)
    experiment.check(run)
    return experiment, run


def run(cfg: DictConfig) -> list[dict]:
    """Run the experiment `cfg` names; returns each cell's stored metrics, in the experiment's order."""
    try:
        quiet_libraries(cfg.get("library_log_level", "error"))
        if models.has_models(cfg):
            return run_models(cfg)
        experiment, context = prepare(cfg)
        check_writable(context.out_dir)
        return drive(experiment, context, tracker_for(cfg))
    except USER_ERRORS as exc:
        if isinstance(exc, UserError):
            raise
        raise UserError(str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)) from exc


def drive(experiment: Experiment[Any], run: Run[Any], tracker: Tracker | None = None) -> list[dict]:
    """Every cell of the experiment (complete ones skipped, the rest resumed), then its summary from disk; `tracker`
    (tracking=mlflow) logs each cell that runs and the summary."""
    metrics: dict[str, dict] = {}
    try:
        cells = experiment.cells(run)
        pending: list[tuple[Cell, CellStore, int]] = []
        set_aside: list[Callable[[], object]] = []     # moves, made only once every check below has passed
        for cell in cells:
            store = CellStore(run.out_dir / cell.key)
            move = set_aside_move(experiment, run, cell, store)
            if move is None and experiment.is_complete(run, cell, store):
                metrics[cell.key] = store.metrics()
                continue
            done = experiment.plan_cell(run, cell, store)
            if move is not None:
                set_aside.append(move)
            pending.append((cell, store, 0 if move is not None else done))
        for cell, _, _ in pending:
            if cell.system is None:
                continue
            why = backend_of(cell.system).unavailable()
            if why:
                raise UserError(f"system {cell.system.name!r}: {why}, or drop it from the systems")
            if cell.fits is not None:
                run.workspace.check_fits(cell.system, *cell.fits, policy=cell.policy)
        for move in set_aside:
            move()
        run.progress = RunProgress(len(cells), sum(c.units - done for c, _, done in pending),
                                   enabled=run.cfg.progress)
        try:
            for cell in cells:
                if cell.key in metrics:
                    run.progress.skip_cell(cell.label)
            for cell, store, done in sorted(pending, key=lambda p: not p[0].first):    # stable: plan order
                with cell_lock(run.out_dir, cell.key):
                    if experiment.is_complete(run, cell, store):      # another process ran it while this one waited
                        run.progress.skip_cell(cell.label)
                        run.advance(cell.units - done)
                        metrics[cell.key] = store.metrics()
                        continue
                    metrics[cell.key] = run_one(experiment, run, cell, store, done)
                if tracker is not None:
                    tracker.log_cell(cell.key, store.root, metrics[cell.key])
        finally:
            run.progress.close()
            run.progress = None
    finally:
        run.workspace.close()
    if not sweep_job():
        summarize(experiment, run, cells, tracker)
    return [metrics[c.key] for c in cells]


def run_models(cfg: DictConfig, same_code: bool = True, execute: bool = True) -> list[dict]:
    """exp.models (harness.running.models): every model's run (`execute`: its cells run or resume, then its summary;
    else only its summary from disk), then the experiment's report across models; returns every model's metrics."""
    pin_dtype(cfg)
    out_dir = check_paths(cfg)
    experiment = find_experiment(cfg.exp.kind)
    if type(experiment).report_models is Experiment.report_models:
        raise UserError(f"experiment kind {cfg.exp.kind!r} does not compare models: drop exp.models")
    runs = models.model_runs(cfg)
    note = models.left_out_note(runs)
    prepared = [prepare(r.cfg, same_code)[1] for r in runs]     # every model checked before any runs
    if execute:
        check_writable(out_dir)
    metrics: list[dict] = []
    for one in prepared:
        if note:
            one.notes.append(note)
        if execute:
            metrics += drive(experiment, one)
            continue
        try:
            summarize(experiment, one)
        finally:
            one.workspace.close()
    try:
        params: Any = params_lib.parse(cfg, experiment.params_type)
    except params_lib.ParamsError as exc:
        raise UserError(str(exc)) from None
    across = Run(cfg, params, [], out_dir, Workspace(cfg), same_code, notes=[note] if note else [])
    try:
        print_paths(experiment.report_models(across, prepared))
    finally:
        across.workspace.close()
    return metrics


@contextlib.contextmanager
def cell_lock(out_dir: Path, key: str) -> Iterator[None]:
    """Hold the cell's lock file while it runs: another process that needs the cell blocks here until it is done."""
    folder = Path(out_dir) / ".locks"          # a folder: git ignores it as it ignores the cells (results/*/*/)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{key}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def sweep_job() -> bool:
    """Whether this process runs one job of a Hydra multirun (the sweep summarizes after its last job)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        return HydraConfig.get().mode == RunMode.MULTIRUN
    except (ValueError, ImportError):
        return False


def set_aside_move(experiment: Experiment[Any], run: Run[Any], cell: Cell, store: CellStore
                   ) -> Callable[[], object] | None:
    """How the cell's folder is moved aside before the cell runs again (damaged, or made by other code or with
    another config), or None when it is reused or resumed; with recompute_damaged=false damage stops the run."""
    damage = experiment.damage(run, store)
    if damage:
        if not run.cfg.get("recompute_damaged", True):
            raise UserError(f"{damage.line()} (under {run.out_dir}); move that folder aside, or rerun with "
                            "recompute_damaged=true to recompute the cell")
        return lambda: store.move_aside(f"damaged-{time.strftime('%Y%m%d-%H%M%S')}", damage.line())
    if store.stale_reason(cell.config_yaml()) is not None:
        return lambda: store.retire_if_stale(cell.config_yaml())
    return None


def run_one(experiment: Experiment[Any], run: Run[Any], cell: Cell, store: CellStore, done: int) -> dict:
    """One cell: its folder opened (a stale one moved aside, a torn row cut), the work, its metrics written."""
    assert run.progress is not None
    store.open(cell.config_yaml(), env_record(run.cfg.seed))
    run.progress.start_cell(cell.label, done, cell.units)
    before = run.progress.samples_done
    result = experiment.run_cell(run, cell, store)
    run.advance(max(0, cell.units - done - (run.progress.samples_done - before)))   # work that counted nothing
    run.progress.end_cell()
    store.write_metrics(result)
    return store.metrics()


def summarize(experiment: Experiment[Any], run: Run[Any], cells: list[Cell] | None = None,
              tracker: Tracker | None = None) -> dict[str, str]:
    """The experiment's summary from the cells on disk, logged to the run's tracker (default: the one its config
    names) and printed last; returns the paths written. Damage in the results folder is stated in the summary (and
    warned about), never left out quietly."""
    cells = cells if cells is not None else experiment.cells(run)
    folders = sorted(run.out_dir.iterdir()) if run.out_dir.is_dir() else []
    unreadable = [damage for folder in folders if folder.is_dir() and not damage_lib.set_aside(folder)
                  and (damage := experiment.damage(run, CellStore(folder)))]
    for damage in unreadable:
        log.warning("%s; this summary leaves it out (a run of the experiment moves it aside and recomputes it)",
                    damage.line())
    if unreadable:
        run.notes.append("Unreadable on disk and left out of this summary: " + "; ".join(
            d.note() for d in unreadable) + ". A run of the experiment moves a damaged cell aside and recomputes it.")
    paths = experiment.report(run, cells)
    tracker = tracker if tracker is not None else tracker_for(run.cfg)
    if tracker is not None:
        tracker.log_summary(run.out_dir, paths)
    print_paths(paths)
    return paths

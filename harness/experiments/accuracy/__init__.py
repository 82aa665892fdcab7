"""The `accuracy` kind and the base of every accuracy kind: systems × tasks scored on the same samples.

Each cell is one system on one task (per-task params and budget sweeps expand the grid), run by
`cells.run_accuracy_cell`; the reference (exp.params.reference, from config) runs first and every other cell is
compared with it on the same samples (retention and teacher-forced fidelity). A grid without the reference (a job
of a sweep over systems) gets the reference's cells added (accuracy.reference): reused from disk, or run once.
Engine systems decode batch-invariantly
(`system_defaults`): a sample's tokens do not depend on which other samples share its batch, so a comparison is never
decided by how requests happened to be batched. A kind subclasses `AccuracyExperiment` and writes its summary
(`write_summary`); the `accuracy` kind itself reports any grid, with retention when it has a reference.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, TypeVar

from omegaconf import DictConfig

from harness.experiments.accuracy import compression, ratio
from harness.experiments.accuracy.cells import (
    ROW_FIELDS,
    AccuracyItem,
    cell_config,
    collect,
    fidelity_plans,
    fidelity_settings,
    run_accuracy_cell,
)
from harness.experiments.accuracy.data import AccuracyData
from harness.experiments.accuracy.params import REPORT_PARAMS, AccuracyParams
from harness.experiments.accuracy.reference import with_reference
from harness.experiments.accuracy.samples import write_samples
from harness.experiments.accuracy.sections import cells_seconds, standard_sections
from harness.measuring.fidelity import FOLDER, reference_problems
from harness.reporting import tables
from harness.reporting.summary import cell_envs
from harness.running.cells import StoredCell
from harness.running.config import UserError
from harness.running.damage import METRICS, PREDICTIONS, Damage
from harness.running.experiment import Cell, Experiment, Run
from harness.running.grid import GridCell, by_budget, with_task_params
from harness.running.store import CellStore

AP = TypeVar("AP", bound=AccuracyParams)


class AccuracyExperiment(Experiment[AP]):
    """Systems × tasks, scored per sample, compared with the reference on the same samples."""

    params_type: ClassVar[type] = AccuracyParams
    system_defaults: ClassVar[dict[str, Any]] = {"engine": {"batch_invariant": True}}
    report_params: ClassVar[frozenset[str]] = REPORT_PARAMS
    row_fields: ClassVar[tuple[str, ...]] = ROW_FIELDS

    # ---- what a kind may change ------------------------------------------------------------------------------------
    def grid(self, run: Run[AP]) -> tuple[list[GridCell], list[str]]:
        """The kind's cells and labels: per-task params, then one cell per budget when exp.params.budgets is set."""
        p = run.params
        cells = with_task_params(run.cfg, run.grid, p.task_params)
        return by_budget(run.cfg, cells, p.budgets, p.budget)

    def label_of(self, stored: StoredCell) -> str:
        """A finished cell's label in its own run (a multirun's other jobs)."""
        return str(stored.system.name)

    def write_summary(self, run: Run[AP], cells: list[Any], labels: list[str], metrics: list[dict],
                      rows_by_cell: dict[str, list[dict]]) -> dict[str, str]:
        raise NotImplementedError

    def cell_config(self, run: Run[AP], cell: GridCell) -> DictConfig:
        """What a cell's config.yaml records (its folder is reused only with the same): the resolved config, the
        fidelity settings, the compression ratio where it sets the cell's budgets, a non-default compression mode."""
        r = run.params.compression_ratio
        return cell_config(run.cfg, cell, r if ratio.applies(cell.system, r) else None)

    def compression_note(self, run: Run[AP]) -> str | None:
        """The line the summary prints about the compression mode (a kind that runs several says so itself)."""
        return compression.phrase(run.params.compression)

    # ---- the experiment interface ----------------------------------------------------------------------------------
    def check(self, run: Run[AP]) -> None:
        p = run.params
        ratio.check(p.compression_ratio, p.budget, p.budgets)
        compression.check(p.compression)
        compression.check_systems(p.compression, [c.system for c in run.grid])
        fidelity_settings(run.cfg)

    def damage(self, run: Run[AP], store: CellStore) -> Damage:
        """Also a reference cell's stored log-probs, and a finished cell holding fewer rows than its metrics count."""
        damage = super().damage(run, store)
        damage.problems += reference_problems(store.root / FOLDER)
        if damage or not (store.root / METRICS).is_file() or not store.predictions_path.is_file():
            return damage                   # a cell that stores no rows (quickstart's throughput cell) counts none
        metrics = store.metrics()
        n, rows = metrics.get("n"), len(store.rows(self.row_fields))
        if metrics.get("complete") and isinstance(n, int) and n != rows:
            damage.problems.append(f"{METRICS}: n={n}, but {PREDICTIONS} holds {rows} row(s)")
        return damage

    def cells(self, run: Run[AP]) -> list[Cell]:
        grid, labels = with_reference(run, self.grid(run), self.grid, self.system_defaults)
        mode = run.params.compression
        compression.check_systems(mode, [c.system for c in grid])        # the reference too
        # a non-default mode names every cell, the reference's included: fidelity reads the reference of its mode
        grid = [dataclasses.replace(c, key=c.key + compression.key_suffix(mode)) for c in grid]
        plans = fidelity_plans(run.cfg, grid, labels, run.params.reference, run.out_dir)
        r = run.params.compression_ratio
        # a ratio sets a budgeted policy's budget per sample: it names the cell's folder and config like a budget
        keys = [c.key + (f"__compression_ratio={r:g}" if ratio.applies(c.system, r) else "") for c in grid]
        return [Cell(key=key, config=self.cell_config(run, c),
                     label=f"{c.system.name} × {c.task.name}", system=c.system, policy=c.policy,
                     first=plan is not None and plan.role == "reference",
                     item=AccuracyItem(c, label, plan, key, compression=mode))
                for c, key, label, plan in zip(grid, keys, labels, plans)]

    def plan_cell(self, run: Run[AP], cell: Cell, store: CellStore) -> int:
        """Render the cell's prompts (bad input fails before any generation) and size its largest request."""
        if not isinstance(cell.item, AccuracyItem):           # a cell a kind adds beside its accuracy cells
            return super().plan_cell(run, cell, store)
        _, samples, prompts = run.workspace.task(cell.item.grid.task)
        cell.units = len(samples)
        r = run.params.compression_ratio
        if r is not None and ratio.applies(cell.item.grid.system, r):
            cell.item.budgets = ratio.sample_budgets(cell.item.grid.system, r, samples, prompts)
        if cell.item.compression != compression.DEFAULT:
            cell.item.context_lens = compression.context_lens(cell.item.compression, samples, prompts,
                                                              run.workspace.tokenizer, run.cfg.model.max_input_tokens)
        if prompts:
            longest = max(range(len(prompts)), key=lambda i: len(prompts[i]) + samples[i].max_new_tokens)
            cell.fits = (len(prompts[longest]), samples[longest].max_new_tokens)
        return len(samples) - len({s.id for s in samples} - store.done_ids())

    def run_cell(self, run: Run[AP], cell: Cell, store: CellStore) -> dict:
        return run_accuracy_cell(run, cell.item, store)

    def report(self, run: Run[AP], cells: list[Cell]) -> dict[str, str]:
        mine = [c.item for c in cells if isinstance(c.item, AccuracyItem)]
        found = collect(run, [i.keyed() for i in mine], [i.label for i in mine], self.label_of, self.report_params,
                        lambda g: self.cell_config(run, g))
        if not found[0]:
            raise UserError(f"no finished cells of {run.cfg.exp.name} under {run.out_dir}: run the experiment first")
        note = self.compression_note(run)
        if note and note not in run.notes:
            run.notes.append(note)
        paths = self.write_summary(run, *found)
        samples = write_samples(run.out_dir, found[0], found[1], found[3])
        return {**paths, "samples": samples} if samples else paths


class Accuracy(AccuracyExperiment[AccuracyParams]):
    """Any system × task grid (a single cell is `python -m harness`'s default run)."""

    def write_summary(self, run: Run[AccuracyParams], cells: list[Any], labels: list[str], metrics: list[dict],
                      rows_by_cell: dict[str, list[dict]]) -> dict[str, str]:
        p = run.params
        data = AccuracyData(cells, labels, rows_by_cell, p.min_reference_score)
        summary = run.summary(envs=cell_envs(metrics))
        if p.reference in data.systems and len(data.systems) > 1:
            summary.glance(f"macro retention vs `{p.reference}`: {data.ranking(p.reference)}.")
        else:
            summary.glance(", ".join(f"{s} × {u}: {data.score(s, u).fmt(1)}" for u in data.units
                                     for s in data.systems if data.n(s, u)) + " (score 0–100, 95 % CI).")
        standard_sections(summary, data, p.reference, run.out_dir)
        for cell, m in zip(cells, metrics):
            grid = tables.length_depth_table(rows_by_cell.get(cell.key, []))
            if grid:
                summary.section(f"{m['system']} × {m['task']}: score by context length (tokens) × needle depth (%)")
                summary.text(grid)
        summary.took(cells_seconds(metrics))
        return summary.write(run.out_dir)


EXPERIMENT = Accuracy()

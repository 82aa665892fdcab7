"""Compress once, ask many: each policy query-aware, query-agnostic and with k questions on one compressed context.

Each (system, task) cell of the grid runs in three modes on the same samples:

- `query_aware`: the whole prompt at once, the question inside the window a policy scores with (today's default);
- `query_agnostic`: the context prefilled and compressed alone, the question prefilled onto it (kvpress's protocol);
- `shared`: as query_agnostic, but the k questions about one context (tasks that ask several: RULER NIAH with
  `questions_per_context`, NeedleBench M-RT with `question_per_needle`; meta `context_id`) are submitted together
  and read one compressed context whose pages are counted once (GenerationRequest.shared_context).

Dense runs every mode too, and each mode's retention is against dense in the same mode. Teacher-forced fidelity is
against dense query-aware (the full-cache model as users run it). Only systems whose backend declares
`shared_context` can run the modes; others are refused before any model loads. The report is `report.py`.

exp.params: those of accuracy_retention (budget, reference, fidelity, task_params, size_reason, ...) plus `modes`
(a subset of the three, in order).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig

from harness.experiments.accuracy import AccuracyExperiment, compression
from harness.experiments.accuracy.cells import AccuracyItem, prompt_hash
from harness.experiments.accuracy.params import AccuracyParams
from harness.experiments.shared_context.report import MODES, SEP, write_summary
from harness.running.cells import StoredCell
from harness.running.config import UserError
from harness.running.experiment import Cell, Run
from harness.running.grid import GridCell
from harness.running.store import CellStore

SHARED = "shared"


@dataclass
class Params(AccuracyParams):
    modes: list[str] = field(default_factory=lambda: list(MODES))


def key_suffix(mode: str) -> str:
    return "" if mode == compression.DEFAULT else f"__compression={mode}"


class SharedContext(AccuracyExperiment[Params]):
    params_type = Params

    def check(self, run: Run[Params]) -> None:
        super().check(run)
        p = run.params
        if p.compression != compression.DEFAULT:
            raise UserError("shared_context runs every mode itself: leave exp.params.compression unset and choose "
                            f"exp.params.modes from {list(MODES)}")
        if not p.modes or any(m not in MODES for m in p.modes) or len(set(p.modes)) != len(p.modes):
            raise UserError(f"exp.params.modes={p.modes!r}: a list of distinct modes from {list(MODES)}")
        compression.check_systems("query_agnostic", [c.system for c in run.grid])

    def cell_config(self, run: Run[Params], cell: GridCell) -> DictConfig:
        """The accuracy cell's config and its mode (read back from its key, which names any but the default)."""
        node = super().cell_config(run, cell)
        mode = cell.key.rpartition("__compression=")[2] if "__compression=" in cell.key else compression.DEFAULT
        if mode != compression.DEFAULT:
            node["compression"] = mode
        return node

    def label_of(self, stored: StoredCell) -> str:
        return f"{stored.system.name}{SEP}{stored.config.get('compression') or compression.DEFAULT}"

    def cells(self, run: Run[Params]) -> list[Cell]:
        """The accuracy cells once per mode; the reference's query-aware cell runs first and is every other cell's
        fidelity reference."""
        out: list[Cell] = []
        for base in super().cells(run):
            compression.check_systems("query_agnostic", [base.system] if base.system is not None else [])
            item = base.item
            assert isinstance(item, AccuracyItem)
            for mode in run.params.modes:
                plan = item.plan and dataclasses.replace(item.plan)      # each cell loads its own reference rows
                if plan is not None and mode != compression.DEFAULT:
                    # the reference's query-aware cell writes the log-probs; its other modes compare with them (none
                    # to compare with when the query-aware mode is not run)
                    plan = dataclasses.replace(plan, role="policy") if compression.DEFAULT in run.params.modes \
                        else None
                key = base.key + key_suffix(mode)
                new = AccuracyItem(item.grid, f"{item.label}{SEP}{mode}", plan, key, budgets=item.budgets,
                                   compression="query_agnostic" if mode == SHARED else mode)
                out.append(dataclasses.replace(
                    base, key=key, config=self.cell_config(run, new.keyed()), label=f"{base.label} [{mode}]",
                    item=new, first=plan is not None and plan.role == "reference"))
        return out

    def plan_cell(self, run: Run[Params], cell: Cell, store: CellStore) -> int:
        done = super().plan_cell(run, cell, store)
        item = cell.item
        if isinstance(item, AccuracyItem) and item.label.endswith(SEP + SHARED):
            _, samples, prompts = run.workspace.task(item.grid.task)
            lens = item.context_lens or {}
            # one key per context and its rendered tokens: questions whose context parts differ do not share
            item.shared_keys = {
                s.id: f"{s.meta['context_id']}#{prompt_hash(p[:lens[s.id] or 0])[:12]}"
                for s, p in zip(samples, prompts) if (s.meta or {}).get("context_id") is not None and lens.get(s.id)}
        return done

    def compression_note(self, run: Run[Params]) -> str | None:
        return None                 # every mode is named in the tables

    def write_summary(self, run: Run[Params], cells: list[Any], labels: list[str], metrics: list[dict],
                      rows_by_cell: dict[str, list[dict]]) -> dict[str, str]:
        return write_summary(run, cells, labels, metrics, rows_by_cell)


EXPERIMENT = SharedContext()

"""The work of one accuracy cell: render a task's samples, generate, score, measure fidelity, append rows.

Every accuracy kind runs its cells through `run_accuracy_cell`, resumable sample by sample (a crash or the end of a
session loses at most the chunk in flight). Reference cells run first, because each policy cell compares its
distributions with the reference's on the same samples (harness.measuring.fidelity). Summaries read the rows back
with `collect`.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from harness.experiments.accuracy.params import FIDELITY_DEFAULTS
from harness.measuring import answer_survival, fidelity
from harness.running import cells as cells_on_disk
from harness.running.config import UserError, plain
from harness.running.experiment import Run
from harness.running.grid import GridCell
from harness.running.store import CellStore
from systems.base import GenerationRequest
from systems.registry import backend_of


@dataclass
class AccuracyItem:
    """What an accuracy cell runs: its grid cell, its label in the summary, and its fidelity role (None: off)."""

    grid: GridCell
    label: str
    plan: fidelity.FidelityPlan | None


def fidelity_settings(cfg: DictConfig) -> dict | None:
    """exp.params.fidelity: false (off), true / absent (defaults) or {steps, gold}."""
    value = cfg.exp.params.get("fidelity", True)
    if value is False or value is None:
        return None
    extra = plain(value) if isinstance(value, DictConfig) else {}
    unknown = sorted(set(extra or {}) - set(FIDELITY_DEFAULTS))
    if unknown:
        raise UserError(f"exp.params.fidelity: unknown key(s) {unknown}; valid: {sorted(FIDELITY_DEFAULTS)}")
    return {**FIDELITY_DEFAULTS, **(extra or {})}


def cell_config(cfg: DictConfig, cell: GridCell) -> DictConfig:
    """The cell's resolved config plus its fidelity settings: another setting reruns the cell."""
    node = cell.resolved(cfg)
    node["fidelity"] = fidelity_settings(cfg)
    return node


def fidelity_plans(cfg: DictConfig, cells: list[GridCell], labels: list[str], reference: str | None, out_dir: Path
                   ) -> list[fidelity.FidelityPlan | None]:
    """Per cell: the reference role, the policy role against the reference cell of the same task, or None (no
    reference cell for the task, fidelity off, or a system on either side that cannot decode under teacher
    forcing)."""
    settings = fidelity_settings(cfg)
    if settings is None or reference is None:
        return [None] * len(cells)

    def task_key(c: GridCell) -> str:
        return OmegaConf.to_yaml(c.task)
    ref_cells = {task_key(c): c for c, label in zip(cells, labels) if label == reference}
    plans: list[fidelity.FidelityPlan | None] = []
    for cell, label in zip(cells, labels):
        ref = ref_cells.get(task_key(cell))
        if ref is None or not backend_of(ref.system).forced_decoding or not backend_of(cell.system).forced_decoding:
            plans.append(None)
            continue
        role = "reference" if label == reference else "policy"
        plans.append(fidelity.FidelityPlan(role=role, steps=int(settings["steps"]), gold=bool(settings["gold"]),
                                           reference_dir=out_dir / ref.key))
    return plans


def run_accuracy_cell(run: Run[Any], item: AccuracyItem, store: CellStore) -> dict:
    """Generate, score and measure the samples not on disk yet, in chunks of the system's batch size; the metrics
    of the whole cell from its rows."""
    cfg, ws, grid = run.cfg, run.workspace, item.grid
    task, samples, prompts = ws.task(grid.task)
    done = store.done_ids()
    todo = [(s, p) for s, p in zip(samples, prompts) if s.id not in done]
    gen_seconds = fid_seconds = 0.0
    memory = None
    plan = item.plan
    if todo:
        system = ws.system(grid.system, grid.policy)
        system.reset_stats()
        if plan is not None and not fidelity.supports_forcing(system):
            plan = None
        if plan is not None and plan.role == "policy":
            plan.reference_rows = fidelity.reference_rows_of(CellStore(plan.reference_dir).rows())
        batch = grid.system.batch_size
        # samples whose gold answer sits in the context: the engine records what each head keeps of it
        layouts = {s.id: answer_survival.layout(s, ws.tokenizer, p) for s, p in todo}
        for start in range(0, len(todo), batch):
            chunk = todo[start:start + batch]
            reqs = [GenerationRequest(request_id=s.id, prompt_token_ids=p, max_new_tokens=s.max_new_tokens,
                                      stop=s.stop, seed=cfg.seed, logprob_steps=plan.steps if plan else 0,
                                      probe_positions=layouts[s.id] is not None)
                    for s, p in chunk]
            t0 = time.perf_counter()
            completions = system.generate(reqs)
            t1 = time.perf_counter()
            fid = (fidelity.run_batch(plan, system, ws.tokenizer, [s for s, _ in chunk], [p for _, p in chunk],
                                      completions) if plan else [{} for _ in chunk])
            t2 = time.perf_counter()
            gen_seconds += t1 - t0
            fid_seconds += t2 - t1
            # each row carries its share of the chunk's time, so a cell resumed after a crash or the end of a
            # session still states what all of its samples cost
            share = {"generation_s": (t1 - t0) / len(chunk), "fidelity_s": (t2 - t1) / len(chunk)}
            rows = []
            for (s, _), c, f in zip(chunk, completions, fid):
                scores = task.score(s, c.text)
                rows.append({"id": s.id, "prediction": c.text, **scores, "meta": s.meta,
                             "answers": list(s.answers), "prompt_tokens": c.prompt_tokens,
                             "output_tokens": c.output_tokens, "output_ids": list(c.token_ids), "ttft_s": c.ttft,
                             "tpot_s": c.tpot, "finish_reason": c.finish_reason, "kv_stats": c.kv_stats, **share, **f})
                lay = layouts[s.id]
                if lay is not None and c.positions is not None:
                    rows[-1]["answer_survival"] = answer_survival.survival(c.positions, lay)
            store.append(rows)
            run.advance(len(rows))
        memory = system.memory_report().as_dict()
    rows = store.rows()
    order = {s.id: i for i, s in enumerate(samples)}
    rows.sort(key=lambda r: order.get(r["id"], len(order)))
    previous = store.metrics() if (store.root / "metrics.json").is_file() else {}
    timed = all("generation_s" in r for r in rows)  # rows stored before rows carried their time do not
    return {"system": grid.system.name, "task": grid.task.name, "summary": task.summarize(rows),
            "n": len(rows), "prompt_tokens": sum(r.get("prompt_tokens") or 0 for r in rows),
            "generation_seconds": sum(r["generation_s"] for r in rows) if timed
            else previous.get("generation_seconds", 0.0) + gen_seconds,
            "fidelity_seconds": sum(r.get("fidelity_s", 0.0) for r in rows) if timed
            else previous.get("fidelity_seconds", 0.0) + fid_seconds,
            "memory": memory or previous.get("memory")}


Found = tuple[list[Any], list[str], list[dict], dict[str, list[dict]]]


def collect(run: Run[Any], cells: list[GridCell], labels: list[str],
            label_of: Callable[[cells_on_disk.StoredCell], str]) -> Found:
    """The grid's cells that are complete on disk, plus every other finished cell of the folder made with the same
    experiment block (a multirun's other jobs); returns cells, labels, metrics and rows for a summary."""
    out_dir, same_code = run.out_dir, run.same_code
    stored = {c.key: c for c in cells_on_disk.finished(out_dir, cells_on_disk.exp_block(run.cfg), same_code)}
    if not same_code:      # a report rebuilds from whatever the grid's folders hold, whichever code made them
        stored.update({c.key: c for c in cells_on_disk.finished(out_dir, None, False)
                       if c.key in {g.key for g in cells}})
    out_cells: list[Any] = []
    out_labels: list[str] = []
    for cell, label in zip(cells, labels):
        if cell.key in stored:
            out_cells.append(cell)
            out_labels.append(label)
    for key, c in stored.items():
        if key not in {x.key for x in cells} and c.config.get("task"):
            out_cells.append(c)
            out_labels.append(label_of(c))
    metrics = [{**stored[c.key].metrics, "_env": stored[c.key].env} for c in out_cells]   # _env: for provenance
    rows = {c.key: stored[c.key].rows() for c in out_cells}
    return out_cells, out_labels, metrics, rows

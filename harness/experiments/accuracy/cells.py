"""Accuracy cells: render a task's samples, generate with a system, score, measure fidelity, append to the store.

The one cell loop of the accuracy kinds (harness/experiments/): every accuracy experiment (accuracy,
accuracy_retention, needlebench, cake_ablation, quickstart, ruler, budget_sweep) runs its cells through `run_cells`.
Reference cells run first, because each policy cell compares its distributions with the reference's on the same
samples (harness.measuring.fidelity). Engine cells decode batch-invariantly
(SYSTEM_DEFAULTS): a sample's tokens do not depend on which other samples share its batch, so a comparison is never
decided by how requests happened to be batched.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from harness import accuracy_report
from harness.integrations.assets import model_dir as resolve_model_dir
from harness.measuring import fidelity
from harness.reporting.summary import print_paths
from harness.running import cells as cells_on_disk
from harness.running import grid as grid_lib
from harness.running import params as params_lib
from harness.running.envinfo import env_record
from harness.running.params import AccuracyParams
from harness.running.progress import RunProgress
from harness.running.prompts import render_all
from harness.running.runner import GridCell, UserError, dump_yaml
from harness.running.store import CellStore
from systems.base import GenerationRequest
from systems.registry import build_system
from tasks.base import load_task

# merged into every engine system of an accuracy experiment before its cell keys are made (overridable)
SYSTEM_DEFAULTS = {"engine": {"batch_invariant": True}}
FIDELITY_DEFAULTS = {"steps": 64, "gold": True}


class Workspace:
    """What cells of one run share: the model folder, its tokenizer, and one live system at a time."""

    def __init__(self, cfg: DictConfig):
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.model_dir = resolve_model_dir(cfg.model.path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self._system, self._system_key = None, None
        self._prepared: dict[str, tuple] = {}

    def task(self, cfg: DictConfig, task_cfg: DictConfig):
        """(task, samples, prompts) of a task config, built once per run: every system sees the same samples."""
        key = OmegaConf.to_yaml(task_cfg)
        if key not in self._prepared:
            task = load_task(task_cfg.family, task_cfg.name, OmegaConf.to_container(task_cfg.params), seed=cfg.seed,
                             limit=task_cfg.limit, fraction=task_cfg.fraction)
            longest = task.longest_prompt_tokens()     # before building hours of 128k prompts, not after
            if longest is not None and longest > cfg.model.max_input_tokens:
                raise UserError(f"task {task_cfg.name} builds prompts of up to {longest} tokens > model."
                                f"max_input_tokens={cfg.model.max_input_tokens}: raise model.max_input_tokens (and "
                                "model.max_model_len above it) or drop the longest task.params.lengths")
            samples = task.samples(self.tokenizer)
            prompts = render_all(samples, self.tokenizer, cfg.model.max_input_tokens, cfg.model.max_model_len)
            self._prepared[key] = (task, samples, prompts)
        return self._prepared[key]

    def check_fits(self, system_cfg: DictConfig, prompt_len: int, new_tokens: int) -> None:
        """Fail before any weights load when the system's device pool cannot hold one request of this size."""
        cells_on_disk.check_fits(self.cfg, self.model_dir, system_cfg, prompt_len, new_tokens)

    def system(self, system_cfg: DictConfig):
        key = OmegaConf.to_yaml(system_cfg)
        if key != self._system_key:
            self.close()
            self._system = build_system(system_cfg, self.model_dir, self.cfg.model)
            self._system_key = key
        return self._system

    def close(self) -> None:
        if self._system is not None:
            self._system.close()
        self._system, self._system_key = None, None


def prepare_cell(cfg: DictConfig, cell: GridCell, ws: Workspace):
    task, samples, prompts = ws.task(cfg, cell.task)
    if prompts:
        longest = max(range(len(prompts)), key=lambda i: len(prompts[i]) + samples[i].max_new_tokens)
        ws.check_fits(cell.system, len(prompts[longest]), samples[longest].max_new_tokens)
    return task, samples, prompts


def fidelity_settings(cfg: DictConfig) -> dict | None:
    """exp.params.fidelity: false (off), true / absent (defaults) or {steps, gold}."""
    value = cfg.exp.params.get("fidelity", True)
    if value is False or value is None:
        return None
    extra = OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig) else {}
    unknown = sorted(set(extra or {}) - set(FIDELITY_DEFAULTS))
    if unknown:
        raise UserError(f"exp.params.fidelity: unknown key(s) {unknown}; valid: {sorted(FIDELITY_DEFAULTS)}")
    return {**FIDELITY_DEFAULTS, **(extra or {})}


def cell_yaml(cfg: DictConfig, cell: GridCell) -> str:
    """The cell's resolved config plus its fidelity settings: another setting reruns the cell."""
    node = cell.resolved(cfg)
    node["fidelity"] = fidelity_settings(cfg)
    return dump_yaml(node)


def fidelity_plans(cfg: DictConfig, cells: list[GridCell], labels: list[str], reference: str | None, out_dir: Path
                   ) -> list[fidelity.FidelityPlan | None]:
    """Per cell: the reference role, the policy role against the reference cell of the same task, or None (no
    reference cell for the task, fidelity off, or the reference is a system without teacher forcing)."""
    settings = fidelity_settings(cfg)
    if settings is None or reference is None:
        return [None] * len(cells)
    task_key = lambda c: OmegaConf.to_yaml(c.task)  # noqa: E731
    ref_cells = {task_key(c): c for c, label in zip(cells, labels) if label == reference}
    plans: list[fidelity.FidelityPlan | None] = []
    for cell, label in zip(cells, labels):
        ref = ref_cells.get(task_key(cell))
        if ref is None or ref.system.backend == "vllm" or cell.system.backend == "vllm":
            plans.append(None)
            continue
        role = "reference" if label == reference else "policy"
        plans.append(fidelity.FidelityPlan(role=role, steps=int(settings["steps"]), gold=bool(settings["gold"]),
                                           reference_dir=out_dir / ref.key))
    return plans


def run_cell(cfg: DictConfig, cell: GridCell, out_dir: Path, ws: Workspace, progress: RunProgress,
             prepared=None, plan: fidelity.FidelityPlan | None = None) -> dict:
    store = CellStore(out_dir / cell.key)
    task, samples, prompts = prepared or prepare_cell(cfg, cell, ws)
    store.open(cell_yaml(cfg, cell), env_record(cfg.seed))
    done = store.done_ids()
    todo = [(s, p) for s, p in zip(samples, prompts) if s.id not in done]
    progress.start_cell(f"{cell.system.name} × {cell.task.name}", len(samples) - len(todo), len(samples))
    gen_seconds = fid_seconds = 0.0
    memory = None
    if todo:
        system = ws.system(cell.system)
        system.reset_stats()
        if plan is not None and not fidelity.supports_forcing(system):
            plan = None
        if plan is not None and plan.role == "policy":
            plan.reference_rows = fidelity.reference_rows_of(CellStore(plan.reference_dir).rows())
        batch = cell.system.batch_size
        for start in range(0, len(todo), batch):
            chunk = todo[start:start + batch]
            reqs = [GenerationRequest(request_id=s.id, prompt_token_ids=p, max_new_tokens=s.max_new_tokens,
                                      stop=s.stop, seed=cfg.seed, logprob_steps=plan.steps if plan else 0)
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
            store.append(rows)
            progress.advance(len(rows))
        memory = system.memory_report().as_dict()
    progress.end_cell()
    rows = store.rows()
    order = {s.id: i for i, s in enumerate(samples)}
    rows.sort(key=lambda r: order.get(r["id"], len(order)))
    previous = store.metrics() if (store.root / "metrics.json").is_file() else {}
    timed = all("generation_s" in r for r in rows)  # rows stored before rows carried their time do not
    metrics = {"system": cell.system.name, "task": cell.task.name, "summary": task.summarize(rows),
               "n": len(rows), "prompt_tokens": sum(r.get("prompt_tokens") or 0 for r in rows),
               "generation_seconds": sum(r["generation_s"] for r in rows) if timed
               else previous.get("generation_seconds", 0.0) + gen_seconds,
               "fidelity_seconds": sum(r.get("fidelity_s", 0.0) for r in rows) if timed
               else previous.get("fidelity_seconds", 0.0) + fid_seconds,
               "memory": memory or previous.get("memory")}
    store.write_metrics(metrics)
    return metrics


def plan_cells(cfg: DictConfig, cells: list[GridCell], out_dir: Path, ws: Workspace):
    """Metrics of complete cells, and the pending ones prepared (prompts rendered: bad input fails before any
    generation) with their count of samples left."""
    results: list[dict | None] = [None] * len(cells)
    pending = []
    for i, cell in enumerate(cells):
        store = CellStore(out_dir / cell.key)
        if store.is_complete(cell_yaml(cfg, cell)):
            results[i] = store.metrics()
        else:
            prepared = prepare_cell(cfg, cell, ws)
            left = len({s.id for s in prepared[1]} - store.done_ids())
            pending.append((i, cell, prepared, left))
    return results, pending


def execute_cells(cfg, cells, results, pending, out_dir: Path, ws: Workspace, progress: RunProgress,
                  plans: list | None = None) -> list[dict]:
    plans = plans or [None] * len(cells)
    for i, cell in enumerate(cells):
        if results[i] is not None:
            progress.skip_cell(f"{cell.system.name} × {cell.task.name}")
    # reference cells first: every policy cell of the same task reads the reference's distributions
    for i, cell, prepared, _ in sorted(pending, key=lambda p: (plans[p[0]] is None or plans[p[0]].role != "reference",
                                                                p[0])):
        results[i] = run_cell(cfg, cell, out_dir, ws, progress, prepared, plans[i])
    return results


def run_cells(cfg: DictConfig, cells: list[GridCell], out_dir: Path, labels: list[str] | None = None,
              reference: str | None = None) -> list[dict]:
    """Run every cell (skipping complete ones) with one progress display; returns each cell's metrics."""
    labels = labels or [c.system.name for c in cells]
    plans = fidelity_plans(cfg, cells, labels, reference, out_dir)
    ws = Workspace(cfg)
    try:
        results, pending = plan_cells(cfg, cells, out_dir, ws)
        progress = RunProgress(len(cells), sum(p[3] for p in pending), enabled=cfg.progress)
        try:
            return execute_cells(cfg, cells, results, pending, out_dir, ws, progress, plans)
        finally:
            progress.close()
    finally:
        ws.close()


def collect(cfg: DictConfig, cells: list, labels: list[str], out_dir: Path, same_code: bool = True,
            label_of=None) -> tuple[list, list[str], list[dict], dict[str, list[dict]]]:
    """The grid's cells that are complete on disk, plus every other finished cell of the folder made with the same
    experiment block (a multirun's other jobs); returns cells, labels, metrics and rows for a summary."""
    stored = {c.key: c for c in cells_on_disk.finished(out_dir, cells_on_disk.exp_block(cfg), same_code)}
    if not same_code:      # a report rebuilds from whatever the grid's folders hold, whichever code made them
        stored.update({c.key: c for c in cells_on_disk.finished(out_dir, None, False)
                       if c.key in {g.key for g in cells}})
    out_cells, out_labels = [], []
    for cell, label in zip(cells, labels):
        if cell.key in stored:
            out_cells.append(cell)
            out_labels.append(label)
    for key, c in stored.items():
        if key not in {x.key for x in cells} and c.config.get("task"):
            out_cells.append(c)
            out_labels.append(label_of(c) if label_of else c.system.name)
    metrics = [{**stored[c.key].metrics, "_env": stored[c.key].env} for c in out_cells]   # _env: for provenance
    rows = {c.key: stored[c.key].rows() for c in out_cells}
    return out_cells, out_labels, metrics, rows


def reference_of(p, labels: list[str]) -> str | None:
    return p.reference or accuracy_report.reference_label(None, labels)


def grid(cfg: DictConfig, cells: list[GridCell], p: AccuracyParams) -> tuple[list[GridCell], list[str]]:
    """The kind's cells and labels: per-task params, then one cell per budget when exp.params.budgets is set."""
    cells = grid_lib.with_task_params(cfg, cells, p.task_params)
    return grid_lib.by_budget(cfg, cells, p.budgets, p.budget)


def run_kind(module, cfg: DictConfig, cells: list[GridCell], out_dir: Path) -> Any:
    """Run an accuracy kind: its grid, every cell (reference first), then its summary from the cells on disk."""
    p = params_lib.parse(cfg, module.Params)
    cells, labels = module.grid(cfg, cells, p)
    metrics = run_cells(cfg, cells, out_dir, labels, reference_of(p, labels))
    summarize_kind(module, cfg, cells, out_dir, p=p, grid_done=(cells, labels))
    return metrics


def summarize_kind(module, cfg: DictConfig, cells: list[GridCell], out_dir: Path, same_code: bool = True, p=None,
                   grid_done=None) -> dict[str, str]:
    p = p or params_lib.parse(cfg, module.Params)
    cells, labels = grid_done or module.grid(cfg, cells, p)
    found = collect(cfg, cells, labels, out_dir, same_code, getattr(module, "label_of", None))
    if not found[0]:
        raise UserError(f"no finished cells of {cfg.exp.name} under {out_dir}: run the experiment first")
    paths = module.write_summary(cfg, p, *found, out_dir)
    print_paths(paths)
    return paths

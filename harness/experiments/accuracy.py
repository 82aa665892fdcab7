"""Accuracy cells: render a task's samples, generate with a system, score, append to the store, summarize."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from harness import report
from harness.assets import model_dir as resolve_model_dir
from harness.envinfo import env_record
from harness.progress import RunProgress
from harness.prompts import render_all
from harness.runner import Cell, dump_yaml
from harness.store import Cell as StoreCell
from systems.base import GenerationRequest
from systems.hf import resolve_dtype
from systems.registry import build_system, check_capacity
from tasks.base import load_task


class Workspace:
    """What cells of one run share: the model folder, its tokenizer, and one live system at a time."""

    def __init__(self, cfg: DictConfig):
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.model_dir = resolve_model_dir(cfg.model.path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self._system, self._system_key = None, None

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


def prepare_cell(cfg: DictConfig, cell: Cell, ws: Workspace):
    t = cell.task
    task = load_task(t.family, t.name, OmegaConf.to_container(t.params), seed=cfg.seed, limit=t.limit,
                     fraction=t.fraction)
    samples = task.samples(ws.tokenizer)
    prompts = render_all(samples, ws.tokenizer, cfg.model.max_input_tokens, cfg.model.max_model_len)
    if prompts:
        longest = max(range(len(prompts)), key=lambda i: len(prompts[i]) + samples[i].max_new_tokens)
        check_capacity(cell.system, ws.model_dir, 2 if resolve_dtype(cfg.model.dtype) != torch.float32 else 4,
                       len(prompts[longest]), samples[longest].max_new_tokens, cfg.model.max_model_len)
    return task, samples, prompts


def run_cell(cfg: DictConfig, cell: Cell, out_dir: Path, ws: Workspace, progress: RunProgress,
             prepared=None) -> dict:
    store = StoreCell(out_dir / cell.key)
    task, samples, prompts = prepared or prepare_cell(cfg, cell, ws)
    store.open(dump_yaml(cell.resolved(cfg)), env_record(cfg.seed))
    done = store.done_ids()
    todo = [(s, p) for s, p in zip(samples, prompts) if s.id not in done]
    progress.start_cell(f"{cell.system.name} × {cell.task.name}", len(samples) - len(todo), len(samples))
    gen_seconds = 0.0
    if todo:
        system = ws.system(cell.system)
        system.reset_stats()
        batch = cell.system.batch_size
        for start in range(0, len(todo), batch):
            chunk = todo[start:start + batch]
            reqs = [GenerationRequest(request_id=s.id, prompt_token_ids=p, max_new_tokens=s.max_new_tokens,
                                      stop=s.stop, seed=cfg.seed) for s, p in chunk]
            t0 = time.perf_counter()
            completions = system.generate(reqs)
            gen_seconds += time.perf_counter() - t0
            rows = []
            for (s, _), c in zip(chunk, completions):
                scores = task.score(s, c.text)
                rows.append({"id": s.id, "prediction": c.text, **scores, "meta": s.meta,
                             "answers": list(s.answers), "prompt_tokens": c.prompt_tokens,
                             "output_tokens": c.output_tokens, "ttft_s": c.ttft, "tpot_s": c.tpot,
                             "finish_reason": c.finish_reason, "kv_stats": c.kv_stats})
            store.append(rows)
            progress.advance(len(rows))
        memory = system.memory_report().as_dict()
    else:
        memory = None
    progress.end_cell()
    rows = store.rows()
    order = {s.id: i for i, s in enumerate(samples)}
    rows.sort(key=lambda r: order.get(r["id"], len(order)))
    metrics = {"system": cell.system.name, "task": cell.task.name, "summary": task.summarize(rows),
               "n": len(rows), "generation_seconds_last_session": gen_seconds, "memory": memory}
    store.write_metrics(metrics)
    return metrics


def plan_cells(cfg: DictConfig, cells: list[Cell], out_dir: Path, ws: Workspace):
    """Metrics of complete cells, and the pending ones prepared (prompts rendered: bad input fails before any
    generation) with their count of samples left."""
    results: list[dict | None] = [None] * len(cells)
    pending = []
    for i, cell in enumerate(cells):
        store = StoreCell(out_dir / cell.key)
        if store.is_complete():
            results[i] = store.metrics()
        else:
            prepared = prepare_cell(cfg, cell, ws)
            left = len({s.id for s in prepared[1]} - store.done_ids())
            pending.append((i, cell, prepared, left))
    return results, pending


def execute_cells(cfg, cells, results, pending, out_dir: Path, ws: Workspace, progress: RunProgress) -> list[dict]:
    for i, cell in enumerate(cells):
        if results[i] is not None:
            progress.skip_cell(f"{cell.system.name} × {cell.task.name}")
    for i, cell, prepared, _ in pending:
        results[i] = run_cell(cfg, cell, out_dir, ws, progress, prepared)
    return results


def run_cells(cfg: DictConfig, cells: list[Cell], out_dir: Path) -> list[dict]:
    """Run every cell (skipping complete ones) with one progress display; returns each cell's metrics."""
    ws = Workspace(cfg)
    try:
        results, pending = plan_cells(cfg, cells, out_dir, ws)
        progress = RunProgress(len(cells), sum(p[3] for p in pending), enabled=cfg.progress)
        try:
            return execute_cells(cfg, cells, results, pending, out_dir, ws, progress)
        finally:
            progress.close()
    finally:
        ws.close()


def run(cfg: DictConfig, cells: list[Cell], out_dir: Path) -> Any:
    metrics = run_cells(cfg, cells, out_dir)
    rows_by_cell = {c.key: StoreCell(out_dir / c.key).rows() for c in cells}
    paths = report.write_accuracy_summary(cfg, cells, metrics, rows_by_cell, out_dir)
    print(Path(paths["md"]).read_text())
    for kind, path in paths.items():
        print(f"[{kind}] {path}")
    return metrics

"""The work of one accuracy cell: render a task's samples, generate, score, measure fidelity, append rows.

Every accuracy kind runs its cells through `run_accuracy_cell`, resumable sample by sample (a crash or the end of a
session loses at most the chunk in flight). Reference cells run first, because each policy cell compares its
distributions with the reference's on the same samples (harness.measuring.fidelity). Summaries read the rows back
with `collect`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from harness.experiments.accuracy import compression
from harness.experiments.accuracy.params import FIDELITY_DEFAULTS
from harness.measuring import answer_survival, fidelity
from harness.running import cells as cells_on_disk
from harness.running.config import UserError, dump_yaml, plain
from harness.running.experiment import Run
from harness.running.grid import GridCell
from harness.running.store import CellStore, same_cell
from systems.base import GenerationRequest
from systems.registry import backend_of

ROW_FIELDS = ("id", "prediction", "score", "meta", "answers")     # what every accuracy row holds (summaries read)


@dataclass
class AccuracyItem:
    """What an accuracy cell runs: its grid cell, its label in the summary, its fidelity role (None: off), its
    folder key (the grid's, or with the compression ratio that sets its budgets) and its budget per sample."""

    grid: GridCell
    label: str
    plan: fidelity.FidelityPlan | None
    key: str | None = None
    budgets: dict[str, int] | None = None       # sample id -> KV budget (exp.params.compression_ratio)
    context_lens: dict[str, int | None] | None = None   # sample id -> context_len (exp.params.compression)
    compression: str = compression.DEFAULT      # the cell's compression mode (sets context_lens when planned)
    shared_keys: dict[str, str] | None = None   # sample id -> shared_context: its questions read one context

    def keyed(self) -> GridCell:
        """The grid cell under the key its folder has."""
        return self.grid if self.key in (None, self.grid.key) else dataclasses.replace(self.grid, key=str(self.key))


def fidelity_settings(cfg: DictConfig) -> dict | None:
    """exp.params.fidelity: false (off), true / absent (defaults) or {steps, gold}: steps a positive integer, gold a
    boolean. Anything else is refused: a number or zero steps once read as "on" or as "off" without a word."""
    value = cfg.exp.params.get("fidelity", True)
    if value is False or value is None:
        return None
    if value is True:
        return dict(FIDELITY_DEFAULTS)
    if not isinstance(value, DictConfig):
        raise UserError(f"exp.params.fidelity={value!r}: use true, false or {{steps: N, gold: true|false}} "
                        "(steps: how many reference positions are compared)")
    extra = plain(value)
    unknown = sorted(set(extra) - set(FIDELITY_DEFAULTS))
    if unknown:
        raise UserError(f"exp.params.fidelity: unknown key(s) {unknown}; valid: {sorted(FIDELITY_DEFAULTS)}")
    settings = {**FIDELITY_DEFAULTS, **extra}
    if type(settings["steps"]) is not int or settings["steps"] < 1:
        raise UserError(f"exp.params.fidelity.steps={settings['steps']!r} must be a positive integer (reference "
                        "positions compared); to turn fidelity off, set exp.params.fidelity=false")
    if not isinstance(settings["gold"], bool):
        raise UserError(f"exp.params.fidelity.gold={settings['gold']!r} must be true or false")
    return settings


def cell_config(cfg: DictConfig, cell: GridCell, compression_ratio: float | None = None) -> DictConfig:
    """The cell's resolved config plus its fidelity settings, the compression ratio that sets its budgets and a
    non-default compression mode: another setting reruns the cell."""
    node = cell.resolved(cfg)
    node["fidelity"] = fidelity_settings(cfg)
    if compression_ratio is not None:
        node["compression_ratio"] = float(compression_ratio)
    mode = (cfg.exp.get("params") or {}).get("compression") or compression.DEFAULT
    if mode != compression.DEFAULT:
        node["compression"] = str(mode)
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


def prompt_hash(token_ids: list[int]) -> str:
    """sha256 of a rendered prompt's token ids (lm-eval's log_samples hash the prompt text; ours is token ids)."""
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()


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
        for chunk in chunks(todo, batch, item.shared_keys or {}):
            budgets = [item.budgets.get(s.id) for s, _ in chunk] if item.budgets else None
            # what a forced pass of the sample must share with its generation: the budget and the compression mode
            fields: list[dict[str, Any]] = [{"kv_budget": budgets[i] if budgets else None,
                                             "context_len": (item.context_lens or {}).get(s.id)}
                                            for i, (s, _) in enumerate(chunk)]
            # the forced passes do not share: each equals its own query-agnostic run (what reading a shared
            # context gives, token for token), so fidelity does not depend on which questions went together
            shared = {s.id: key for s, _ in chunk if (key := (item.shared_keys or {}).get(s.id))}
            keeps = kept_prefills(system, plan, chunk, shared)
            reqs = [GenerationRequest(request_id=s.id, prompt_token_ids=p, max_new_tokens=s.max_new_tokens,
                                      stop=s.stop, seed=cfg.seed, logprob_steps=plan.steps if plan else 0,
                                      probe_positions=layouts[s.id] is not None, shared_context=shared.get(s.id),
                                      keep_prefill=keeps.get(s.id), **fields[i])
                    for i, (s, p) in enumerate(chunk)]
            t0 = time.perf_counter()
            completions = system.generate(reqs)
            t1 = time.perf_counter()
            # a forced pass reads its generation's kept prefill (the prompt as the policy left it) instead of
            # prefilling again; read as its generation's query-agnostic split, or whole
            forced = [{**fields[i], "shared_context": keeps[s.id], "context_len": fields[i]["context_len"] or len(p)}
                      if s.id in keeps else fields[i] for i, (s, p) in enumerate(chunk)]
            try:
                fid = (fidelity.run_batch(plan, system, ws.tokenizer, [s for s, _ in chunk], [p for _, p in chunk],
                                          completions, forced) if plan else [{} for _ in chunk])
            finally:
                release = getattr(system, "release_prefix", None)   # systems that keep prefixes (kept_prefills)
                for key in keeps.values():
                    if release is not None:
                        release(key)
            t2 = time.perf_counter()
            # what each reuse saved: the sample's share of its generation's prefill, estimated as the chunk's last
            # first token (every prompt of the chunk prefilled by then) spread over the chunk's samples
            prefill_share = max((c.ttft or 0.0 for c in completions), default=0.0) / len(chunk)
            for f in fid:
                if f.get("fid_reused_prefills"):
                    f["fidelity_prefill_saved_s"] = f["fid_reused_prefills"] * prefill_share
            gen_seconds += t1 - t0
            fid_seconds += t2 - t1
            # each row carries its share of the chunk's time, so a cell resumed after a crash or the end of a
            # session still states what all of its samples cost
            share = {"generation_s": (t1 - t0) / len(chunk), "fidelity_s": (t2 - t1) / len(chunk)}
            rows = []
            for (s, prompt), c, f in zip(chunk, completions, fid):
                scores = task.score(s, c.text)
                rows.append({"id": s.id, "prediction": c.text, **scores, "meta": s.meta,
                             "prompt_hash": prompt_hash(prompt),
                             **({"kv_budget": item.budgets.get(s.id)} if item.budgets else {}),
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
            # forced passes that read their generation's kept prefill, and the prefill time that saved (estimated)
            "fidelity_prefills_reused": sum(r.get("fid_reused_prefills", 0) for r in rows),
            "fidelity_prefill_saved_seconds": sum(r.get("fidelity_prefill_saved_s", 0.0) for r in rows),
            "memory": memory or previous.get("memory")}


def kept_prefills(system: Any, plan: fidelity.FidelityPlan | None, chunk: list[tuple[Any, list[int]]],
                  shared: dict[str, str]) -> dict[str, str]:
    """{sample id: keep_prefill key} for the samples whose forced fidelity passes will read their generation's
    prefill: with a fidelity plan, on a system that keeps prefixes, and not reading a shared context."""
    if plan is None or not getattr(system, "supports_shared_context", False):
        return {}
    return {s.id: f"{s.id}#prefill" for s, _ in chunk if s.id not in shared}


def chunks(todo: list[tuple[Any, list[int]]], batch: int, shared_keys: dict[str, str]
           ) -> Iterable[list[tuple[Any, list[int]]]]:
    """`todo` in chunks of `batch` samples, a context's questions (same shared key) never split across chunks: a
    shared context lives while one of its readers runs, so readers submitted later would rebuild it."""
    chunk: list[tuple[Any, list[int]]] = []
    for i, (sample, prompt) in enumerate(todo):
        chunk.append((sample, prompt))
        key = shared_keys.get(sample.id)
        follows = i + 1 < len(todo) and key is not None and shared_keys.get(todo[i + 1][0].id) == key
        if len(chunk) >= batch and not follows:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


Found = tuple[list[Any], list[str], list[dict], dict[str, list[dict]]]


def collect(run: Run[Any], cells: list[GridCell], labels: list[str],
            label_of: Callable[[cells_on_disk.StoredCell], str], report_params: Iterable[str] = (),
            config_of: Callable[[GridCell], DictConfig] | None = None) -> Found:
    """The grid's cells that are complete on disk, plus every other finished cell of the folder made with the same
    experiment block, `report_params` aside (a multirun's other jobs); returns cells, labels, metrics and rows for a
    summary. A grid cell is the folder of its key made with its config, whatever the experiment block said when it
    ran: a grid extended by a system or a budget, or a summary asked for differently, reuses every cell it had."""
    out_dir, same_code = run.out_dir, run.same_code
    config_of = config_of or (lambda g: cell_config(run.cfg, g))
    grid = {c.key: c for c in cells}
    stored = {c.key: c for c in cells_on_disk.finished(out_dir, None, same_code) if c.key in grid and (
        not same_code or same_cell(dump_yaml(config_of(grid[c.key])), c.config))}
    for c in cells_on_disk.finished(out_dir, cells_on_disk.exp_block(run.cfg, report_params), same_code,
                                    report_params):
        stored.setdefault(c.key, c)
    out_cells: list[Any] = []
    out_labels: list[str] = []
    for cell, label in zip(cells, labels):
        if cell.key in stored:
            out_cells.append(cell)
            out_labels.append(label)
    for key, c in stored.items():
        if key not in grid and c.config.get("task"):
            out_cells.append(c)
            out_labels.append(label_of(c))
    metrics = [{**stored[c.key].metrics, "_env": stored[c.key].env} for c in out_cells]   # _env: for provenance
    rows = {c.key: fidelity_against(run, stored[c.key], stored[c.key].rows(ROW_FIELDS)) for c in out_cells}
    return out_cells, out_labels, metrics, rows


def fidelity_against(run: Run[Any], stored: cells_on_disk.StoredCell, rows: list[dict]) -> list[dict]:
    """The rows, without their fidelity when it was measured against another reference than the summary's (the
    summary would label it wrongly); the summary says so and how to see it."""
    measured = ((stored.config.get("exp") or {}).get("params") or {}).get("reference")
    reference = getattr(run.params, "reference", None)
    if measured == reference or not any(k.startswith("fid_") for r in rows for k in r):
        return rows
    note = (f"Fidelity (top-1 agreement, KL) was measured against `{measured}` when the cells ran, so it is not "
            f"shown against `{reference}`: rebuild with exp.params.reference={measured} to see it.")
    if note not in run.notes:
        run.notes.append(note)
    return [{k: v for k, v in r.items() if not k.startswith("fid_")} for r in rows]

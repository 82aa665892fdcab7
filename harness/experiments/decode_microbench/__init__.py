"""Per-layer decode attention latency (selection + attention) vs batch size at a fixed context (FlexiCache F7, F8).

For each system of exp.params.systems (conf/system names; else those of exp.systems) and each batch size, `layers`
layers of the engine's paged KV storage are filled with `context` random tokens per sequence and the system's
policy prepares them as after a real prefill (FlexiCache offloads stable heads and frees their non-top-K blocks).
Then `steps` decode steps run the engine's own per-layer decode step (ModelRunner.decode_layer: append, the
policy's select_pages, the engine ops' sparse or dense paged attention, the policy's after_append), timed by
phase; the append is the same for every system and left out of the total.

Synthetic inputs, on purpose: keys and values are N(0, 1); each sequence's decode queries are a fixed direction plus
small noise (`query_noise`), so consecutive top-K sets overlap as they do for stable heads. A policy that needs a
profile of the model runs with the parameters it names for a profile-free run (Policy.profile_free_params: only
how many heads play each role matters for latency). Every point lives in one cell, so the ratios in summary.md come
from one run; a finished cell made by the same code and config is reused (delete `points/` to time again).
"""
from __future__ import annotations

import copy
import logging
import math

import torch
from omegaconf import DictConfig

from harness.experiments.decode_microbench.bench import bench_point
from harness.experiments.decode_microbench.params import Params
from harness.integrations.assets import MODEL_NAME
from harness.integrations.assets import model_dir as resolve_model_dir
from harness.reporting import plots
from harness.reporting.summary import cell_envs
from harness.running.cells import cell_config
from harness.running.config import UserError, plain
from harness.running.experiment import Cell, Experiment, Run
from harness.running.grid import GridCell, apply_budget, system_config
from harness.running.store import CellStore
from systems.hardware import resolve_dtype
from systems.policies import policy_class
from systems.registry import SystemConfigError, backend_of, check_system

log = logging.getLogger("kvharness")
KEY = "points"      # one cell holds every point of one run, so the ratios always come from one run


def model_dims(cfg: DictConfig, p: Params) -> dict[str, int]:
    """The attention shape: exp.params when all three are set (no model folder read), else the model's config."""
    if p.num_q_heads and p.num_kv_heads and p.head_dim:
        return {"num_q_heads": p.num_q_heads, "num_kv_heads": p.num_kv_heads, "head_dim": p.head_dim}
    from systems.engine.models.spec import ModelSpec

    try:        # through the spec: a multimodal checkpoint keeps its decoder's shape in a nested text_config
        spec = ModelSpec.from_dir(resolve_model_dir(cfg.model.path, cfg.model.get("name") or MODEL_NAME))
    except (ValueError, FileNotFoundError) as exc:
        raise UserError(str(exc)) from None
    return {"num_q_heads": spec.num_q_heads, "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim}


def bench_systems(cells: list[GridCell], p: Params, num_layers: int, num_kv_heads: int) -> list[DictConfig]:
    """The systems to time, the shared budget applied, with the parameters each policy names for a profile-free run."""
    loaded = [system_config(name) for name in p.systems] or [c.system for c in cells]
    out = []
    for s in {s.name: copy.deepcopy(s) for s in loaded}.values():
        s.merge_with(p.system_overrides or {})
        if p.budget is not None:
            apply_budget(s, p.budget)
        cls = policy_class(s.policy)
        if cls is not None:
            s.params = {**plain(s.params),
                        **cls.profile_free_params(num_layers, num_kv_heads)}
        check_system(s)
        out.append(s)
    bad = [s.name for s in out if not backend_of(s).runs_policies]
    if bad:
        raise UserError(f"decode_microbench times the engine's ops and policies; remove {bad} (systems whose backend "
                        "runs no KV policy) from the systems")
    return out


class DecodeMicrobench(Experiment[Params]):
    params_type = Params

    def check(self, run: Run[Params]) -> None:
        p = run.params
        if p.steps < 1 or p.context < 16 or not p.batch_sizes or min(p.batch_sizes) < 1:
            raise UserError("exp.params needs steps >= 1, context >= 16 and positive batch_sizes")
        if any(len(pair) != 2 for pair in p.pairs):
            raise UserError("exp.params.pairs lists [a, b] system-name pairs (time a ÷ b), "
                            "e.g. [[engine-quest, engine-dense]]")

    def cells(self, run: Run[Params]) -> list[Cell]:
        p = run.params
        dims = model_dims(run.cfg, p)
        try:
            systems = bench_systems(run.grid, p, p.layer + p.layers, dims["num_kv_heads"])
        except SystemConfigError as exc:
            raise UserError(str(exc)) from None
        run.extra_systems = systems
        points = len(systems) * len(p.batch_sizes)
        return [Cell(key=KEY, config=cell_config(run.cfg, systems=systems), label=f"decode microbenchmark ({points} "
                     "points)", units=points, item=(systems, dims))]

    def run_cell(self, run: Run[Params], cell: Cell, store: CellStore) -> dict:
        p, (systems, dims) = run.params, cell.item
        device = torch.device(p.device if p.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = resolve_dtype(run.cfg.model.dtype, device)
        results = []
        for system in systems:
            for batch in p.batch_sizes:
                r = bench_point(system, dims, batch, p, device, dtype)
                log.info("%s batch %d: %.2f ms/step (select %.2f, attention %.2f, after_append %.2f)", r["system"],
                         batch, r["total_ms"], r["select_ms"], r["attention_ms"], r["after_append_ms"])
                results.append(r)
                run.advance(1)
        return {"points": results}

    def report(self, run: Run[Params], cells: list[Cell]) -> dict[str, str]:
        stored = run.stored(KEY)
        if stored is None:
            raise UserError(f"no measured points under {run.out_dir}: run the experiment first")
        return write_summary(run, stored["points"], cell_envs([stored]))


def _ratio(a: float | None, b: float | None) -> float:
    return a / b if a and b else math.nan


def write_summary(run: Run[Params], results: list[dict], envs: list[dict]) -> dict[str, str]:
    p, out_dir = run.params, run.out_dir
    systems = list(dict.fromkeys(r["system"] for r in results))
    at = {(r["system"], r["batch"]): r for r in results}
    batches = sorted({r["batch"] for r in results})
    ref = p.reference if p.reference in systems else systems[0]
    big = batches[-1]
    glance = f"per-layer decode attention at {p.context} tokens, batch {big}: " + ", ".join(
        f"{ref} ÷ {s} = {_ratio(at[(ref, big)]['total_ms'], at[(s, big)]['total_ms']):.2f}×"
        for s in systems if s != ref)
    for a, b in p.pairs:
        if (a, big) in at and (b, big) in at:
            glance += f"; {a} ÷ {b} = {_ratio(at[(a, big)]['total_ms'], at[(b, big)]['total_ms']):.2f}×"
    summary = run.summary(envs=envs)
    summary.glance(glance + " (one run, ratios > 1 = faster than the reference).")
    summary.table(["system", "granularity", "batch", "select ms", "attention ms", "after_append ms", "total ms",
                   f"{ref} ÷ system", "pages read / KV head", "H2D KiB / step", "cores busy", "busy threads"],
                  [[r["system"], r.get("granularity") or "—", r["batch"], r["select_ms"], r["attention_ms"],
                    r["after_append_ms"], r["total_ms"], _ratio(at[(ref, r["batch"])]["total_ms"], r["total_ms"]),
                    r["pages_read_per_head_step"], r["h2d_bytes_per_step"] / 1024, r.get("cores_busy"),
                    r.get("busy_threads")] for r in results], 2)
    r0 = results[0]
    summary.text(f"{r0['layers']} distinct layers timed per step (a real step's dense KV outgrows the CPU's last-level "
                 f"cache; one layer alone would sit in it), {r0['num_q_heads']} query / {r0['num_kv_heads']} KV heads, "
                 f"head_dim {r0['head_dim']}, {r0['dtype']} on {r0['device']}, {p.context} tokens per sequence "
                 f"({r0['pages_per_head']} pages per head), {p.steps} timed decode steps after {p.warmup}; times are "
                 "per layer and decode step, from the engine's own decode step. select = the policy's page selection; "
                 "attention = paged decode attention over the selected pages, read in place (all pages for dense; "
                 "per-query-head sets read the union of their group's pages); after_append = the policy's "
                 "post-attention work (FlexiCache's host → device promotions). Cores busy (CPU seconds ÷ wall time) "
                 f"and busy threads are read from /proc over the timed steps; CPUs allowed: "
                 f"{r0.get('cpus_allowed') or '?'}.")
    summary.csv([{**r, "speedup_vs_reference": _ratio(at[(ref, r["batch"])]["total_ms"], r["total_ms"]),
                  "reference": ref} for r in results], "points")
    n = f"n = {p.steps} timed decode steps per point (mean)"
    summary.image("png_latency", plots.line_plot(
        out_dir / "latency_vs_batch.png", {s: [(b, at[(s, b)]["total_ms"]) for b in batches] for s in systems},
        "batch size (sequences)", "decode attention per layer and step (ms)",
        f"Decode attention latency at {p.context} tokens (selection + attention)", logx=True, ymin=0.0,
        note=summary.figure_note(n)), "latency vs batch")
    summary.image("png_speedup", plots.line_plot(
        out_dir / "speedup_vs_batch.png",
        {s: [(b, _ratio(at[(ref, b)]["total_ms"], at[(s, b)]["total_ms"])) for b in batches] for s in systems
         if s != ref}, "batch size (sequences)", f"speedup over {ref} (×)", "Decode attention speedup over dense",
        logx=True, hline=1.0, note=summary.figure_note(n)), "speedup vs batch")
    return summary.write(out_dir)


EXPERIMENT = DecodeMicrobench()

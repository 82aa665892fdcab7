"""Head-stability profiling (FlexiCache's TopK-Analysis): dense top-K traces -> RCO / TS per head -> head profiles.

Per task of the grid (the cell's system lends only its engine settings: decoding runs the `topk_trace` policy, which
is dense), every sample decodes `decode_steps` steps (EOS ignored; the first token comes from prefill) while each
(layer, KV head)'s top-K page set is recorded; analysis.py turns the traces into the unstable set and the
statistics. The same pass measures LServe's streaming-head proxy (attention mass outside sink + local window). Per
cell: the FlexiCache and LServe profile JSONs and metrics.json; with `ship: true` the profiles are also written
to systems/policy_support/profiles/, where the policies find them by (model, task).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from omegaconf import DictConfig

from harness.experiments.head_stability.analysis import analyse, overlap_table
from harness.reporting import plots
from harness.reporting.summary import cell_envs
from harness.running.cells import cell_config
from harness.running.config import UserError
from harness.running.envinfo import command_line
from harness.running.experiment import Cell, Experiment, Run
from harness.running.grid import GridCell
from harness.running.params import GridParams
from harness.running.store import CellStore, atomic_write_json
from harness.running.workspace import Workspace
from systems.base import GenerationRequest
from systems.policies import policy_class
from systems.policy_support import profiles
from systems.registry import backend_of

TRACER = "topk_trace"       # the dense policy that records each step's top-K page sets


@dataclass
class Params(GridParams):
    top_k: int = 64                   # pages per set (FlexiCache's --topK-budget with 16-token pages)
    window: int = 16                  # W
    unstable_fraction: float = 0.25   # FlexiCache: 25 % of the KV heads
    unstable_count: Optional[int] = None
    decode_steps: int = 64
    sink_tokens: int = 128            # LServe proxy window
    local_tokens: int = 256
    ship: bool = False


def trace_system(cell: GridCell, p: Params) -> DictConfig:
    """The cell's system (its backend and engine settings) decoding densely with the tracing policy."""
    sys_cfg = cell.system.copy()
    sys_cfg.name, sys_cfg.policy = "engine-topk-trace", TRACER
    sys_cfg.params = {"top_k": p.top_k, "sink_tokens": p.sink_tokens, "local_tokens": p.local_tokens}
    return sys_cfg


def collect(cfg: DictConfig, cell: GridCell, ws: Workspace, p: Params) -> list[dict]:
    """Dense decode of every sample with tracing; returns one trace per sample."""
    _, samples, prompts = ws.task(cell.task)
    system = ws.system(trace_system(cell, p))
    policy, traces, batch = system.engine.policy, [], cell.system.batch_size     # type: ignore[attr-defined]
    for start in range(0, len(samples), batch):
        chunk = list(zip(samples, prompts))[start:start + batch]
        system.generate([GenerationRequest(request_id=s.id, prompt_token_ids=q, max_new_tokens=p.decode_steps + 1,
                                           ignore_eos=True, seed=cfg.seed) for s, q in chunk])
        traces += [policy.finished.pop(s.id) for s, _ in chunk]
    return traces


def save_profile(path: object, profile: dict) -> None:
    """A profile checked against the schema its policy declares (its `kind` names the policy)."""
    cls = policy_class(profile["kind"])
    profiles.save_profile(path, profile, cls.profile_schema if cls is not None else ())   # type: ignore[arg-type]


def profile(cfg: DictConfig, cell: GridCell, ws: Workspace, p: Params, store: CellStore) -> dict:
    """The traces of one task turned into FlexiCache's and LServe's profiles, written beside the cell."""
    traces = collect(cfg, cell, ws, p)
    engine = ws.system(trace_system(cell, p)).engine                              # type: ignore[attr-defined]
    spec = engine.model.spec
    # the layers the policies manage: on a hybrid model the full-attention ones (the trace skips windowed layers)
    result = analyse(traces, p, spec.num_layers, spec.num_kv_heads, engine.policy.managed_layers)
    common = {"model": cfg.model.name, "task": cell.task.name, "num_layers": spec.num_layers,
              "num_kv_heads": spec.num_kv_heads, "page_size": int(cell.system.engine.page_size),
              "samples": result["samples"], "decode_steps": p.decode_steps, "made_by": command_line(cfg)}
    flexi = {"kind": "flexicache", **common, "K": p.top_k, "W": p.window,
             **{key: result[key] for key in ("unstable_heads", "unstable_count", "head_stats", "windows",
                                             "consensus_recall", "random_baseline", "promoted_share_stable")}}
    lserve = {"kind": "lserve", **common, "sink_tokens": p.sink_tokens, "local_tokens": p.local_tokens,
              "proxy": "per KV head: share of decode softmax mass outside the first sink_tokens and last "
                       "local_tokens keys (max over the query group, mean over steps with more keys than the "
                       "window); high = retrieval head", "head_scores": result["outside_mass"]}
    for prof in (flexi, lserve):
        save_profile(store.root / f"profile_{prof['kind']}.json", prof)
    return {"task": cell.task.name, "system": cell.system.name, "flexicache": flexi, "lserve": lserve,
            "rco_by_offset": result["rco_by_offset"]}


class HeadStability(Experiment[Params]):
    params_type = Params

    def check(self, run: Run[Params]) -> None:
        p = run.params
        if p.decode_steps < p.window or p.window < 2 or p.top_k < 1:
            raise UserError("exp.params: need decode_steps >= window >= 2 and top_k >= 1")
        bad = sorted({c.system.name for c in run.grid if not backend_of(c.system).runs_policies})
        if bad:
            raise UserError(f"head_stability traces with a KV policy; remove {bad} (systems whose backend runs no "
                            "KV policy) from exp.systems")

    def cells(self, run: Run[Params]) -> list[Cell]:
        """One profile per task: the systems only lend their engine settings."""
        return [Cell(key=c.key, config=cell_config(run.cfg, system=c.system, task=c.task),
                     label=f"profile × {c.task.name}", item=c)
                for c in {c.task.name: c for c in run.grid}.values()]

    def run_cell(self, run: Run[Params], cell: Cell, store: CellStore) -> dict:
        return profile(run.cfg, cell.item, run.workspace, run.params, store)

    def report(self, run: Run[Params], cells: list[Cell]) -> dict[str, str]:
        results = [m for c in cells if (m := run.stored(c.key))]
        if run.params.ship:       # where the policies find them by (model, task)
            for m in results:
                for kind in ("flexicache", "lserve"):
                    save_profile(profiles.profile_path(kind, run.cfg.model.name, m["task"]), m[kind])
        atomic_write_json(run.out_dir / "profiles.json",
                          {m["task"]: m["flexicache"]["unstable_heads"] for m in results})
        return write_summary(run, results)


def write_summary(run: Run[Params], results: list[dict]) -> dict[str, str]:
    out_dir = run.out_dir
    summary = run.summary(envs=cell_envs(results))
    summary.glance("; ".join(
        f"{m['task']}: {m['flexicache']['unstable_count']} unstable heads, consensus recall "
        f"{m['flexicache']['consensus_recall']:.2f} vs {m['flexicache']['random_baseline']:.2f} random, a stable "
        f"head's rerank promotes {m['flexicache']['promoted_share_stable']:.0%} of its top-K" for m in results
        if m["flexicache"].get("promoted_share_stable") is not None) + ".")
    summary.table(["task", "samples", "windows", "K", "W", "unstable", "consensus recall", "random",
                   "promoted share / rerank (stable)"],
                  [[f[k] for k in ("task", "samples", "windows", "K", "W", "unstable_count", "consensus_recall",
                                   "random_baseline", "promoted_share_stable")]
                   for f in (m["flexicache"] for m in results)], 3)
    summary.text("The unstable set is FlexiCache's final set: the heads most often among a window's least stable on a "
                 "seeded half of the windows; consensus recall is how well that set recalls the other half's "
                 "per-window sets (random = the set's share of all heads).")
    if len(results) > 1:
        names, matrix = overlap_table({m["task"]: m["flexicache"]["unstable_heads"] for m in results})
        summary.section("Cross-task overlap of unstable sets |A_i ∩ A_j| / |A|").table(
            ["task", *names], [[n, *row] for n, row in zip(names, matrix)], 2)
    for m in results:
        per_layer: dict[int, int] = {}
        for layer, _ in m["flexicache"]["unstable_heads"]:
            per_layer[layer] = per_layer.get(layer, 0) + 1
        summary.section(f"{m['task']}: unstable heads per layer").text(
            ", ".join(f"L{layer}: {n}" for layer, n in sorted(per_layer.items())))
    head_columns = ("layer", "head", "ts_mean", "ts_std", "ts_min", "bottom_frequency", "unstable")
    summary.csv([{"task": m["task"], **{k: hs[k] for k in head_columns}}
                 for m in results for hs in m["flexicache"]["head_stats"]], "heads")
    panels = []
    for m in results:
        if not m.get("rco_by_offset"):
            continue
        rco = torch.tensor(m["rco_by_offset"])                                  # [W-1, H]
        unstable = torch.tensor([hs["unstable"] for hs in m["flexicache"]["head_stats"]])
        offsets = range(1, rco.shape[0] + 1)
        series = {"stable heads (mean)": list(zip(offsets, torch.nanmean(rco[:, ~unstable], 1).tolist())),
                  "unstable heads (mean)": list(zip(offsets, torch.nanmean(rco[:, unstable], 1).tolist()))}
        panels.append(dict(series=series,
                           colours={"stable heads (mean)": "tab:blue", "unstable heads (mean)": "tab:red"},
                           ylabel="RCO(S_s, S_s+Δ) (0 = chance, 1 = identical)",
                           title=f"{m['task']}: top-{m['flexicache']['K']} overlap vs offset"))
    n = "n = " + ", ".join(f"{m['flexicache']['samples']} samples × {m['flexicache']['windows']} windows "
                           f"({m['task']})" for m in results)
    if panels:
        summary.image("png_rco", plots.line_panels(out_dir / "rco_vs_offset.png", panels,
                                                   "offset Δ from the window start (decode steps)",
                                                   "Top-K page-set stability (FlexiCache F1)",
                                                   note=summary.figure_note(n)), "RCO vs offset")
    shares = [m["flexicache"] for m in results if m["flexicache"].get("promoted_share_stable") is not None]
    if shares:
        summary.image("png_promoted", plots.bar_plot(
            out_dir / "promoted_share.png", [f["task"] for f in shares],
            {"promoted share": [100 * f["promoted_share_stable"] for f in shares]}, xlabel="profiling task",
            ylabel="pages promoted per rerank (% of top-K)", title="Host→device traffic per rerank (stable heads)",
            note=summary.figure_note(n)), "promoted share")
    return summary.write(out_dir)


EXPERIMENT = HeadStability()

"""Head-stability profiling (FlexiCache's TopK-Analysis): dense top-K traces -> RCO / TS per head -> head profiles.

Per task of the grid (the cell's system lends only its engine settings: decoding runs the `topk_trace` policy, which
is dense), every sample decodes `decode_steps` steps (EOS ignored; the first token comes from prefill) while each
(layer, KV head)'s top-K page set is recorded; harness.stability turns the traces into the unstable set and the
statistics. The same pass measures LServe's streaming-head proxy (attention mass outside sink + local window).
Per cell: the FlexiCache and LServe profile JSONs and metrics.json; with `ship: true` the profiles are also written
to systems/policy_support/profiles/, where the policies find them by (model, task).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig

from harness import stability
from harness.accuracy_cells import Workspace, prepare_cell
from harness.reporting import plots
from harness.reporting.summary import Summary, cell_envs, print_paths
from harness.running import params as params_lib
from harness.running.cells import cell_config, run_cell, stored_metrics
from harness.running.envinfo import command_line
from harness.running.params import GridParams
from harness.running.progress import RunProgress
from harness.running.runner import GridCell, UserError
from harness.running.store import atomic_write_json
from systems.base import GenerationRequest
from systems.policy_support import profiles


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
    sys_cfg = cell.system.copy()
    sys_cfg.name, sys_cfg.backend, sys_cfg.policy = "engine-topk-trace", "engine", "topk_trace"
    sys_cfg.params = {"top_k": p.top_k, "sink_tokens": p.sink_tokens, "local_tokens": p.local_tokens}
    return sys_cfg


def collect(cfg: DictConfig, cell: GridCell, ws: Workspace, p: Params) -> list[dict]:
    """Dense decode of every sample with tracing; returns one trace per sample."""
    _, samples, prompts = prepare_cell(cfg, cell, ws)
    system = ws.system(trace_system(cell, p))
    policy, traces, batch = system.engine.policy, [], cell.system.batch_size
    for start in range(0, len(samples), batch):
        chunk = list(zip(samples, prompts))[start:start + batch]
        system.generate([GenerationRequest(request_id=s.id, prompt_token_ids=q, max_new_tokens=p.decode_steps + 1,
                                           ignore_eos=True, seed=cfg.seed) for s, q in chunk])
        traces += [policy.finished.pop(s.id) for s, _ in chunk]
    return traces


def profile_work(cfg: DictConfig, cell: GridCell, ws: Workspace, p: Params):
    def work(store) -> dict:
        traces = collect(cfg, cell, ws, p)
        spec = ws.system(trace_system(cell, p)).engine.model.spec
        result = stability.analyse(traces, p, spec.num_layers, spec.num_kv_heads)
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
            profiles.save_profile(store.root / f"profile_{prof['kind']}.json", prof)
        return {"task": cell.task.name, "system": cell.system.name, "flexicache": flexi, "lserve": lserve,
                "rco_by_offset": result["rco_by_offset"]}
    return work


def tasks_of(cells: list[GridCell]) -> list[GridCell]:
    """One profile per task: the systems only lend their engine settings."""
    return list({c.task.name: c for c in cells}.values())


def run(cfg: DictConfig, cells: list[GridCell], out_dir: Path) -> Any:
    p = params_lib.parse(cfg, Params)
    if p.decode_steps < p.window or p.window < 2 or p.top_k < 1:
        raise UserError("exp.params: need decode_steps >= window >= 2 and top_k >= 1")
    ws, todo = Workspace(cfg), tasks_of(cells)
    progress = RunProgress(len(todo), len(todo), enabled=cfg.progress)
    try:
        results = [run_cell(cfg, c.key, cell_config(cfg, system=c.system, task=c.task), out_dir,
                            profile_work(cfg, c, ws, p), progress, f"profile × {c.task.name}") for c in todo]
    finally:
        progress.close()
        ws.close()
    if p.ship:
        for m in results:
            for kind in ("flexicache", "lserve"):
                profiles.save_profile(profiles.profile_path(kind, cfg.model.name, m["task"]), m[kind])
    summarize(cfg, cells, out_dir)
    return results


def summarize(cfg: DictConfig, cells: list[GridCell], out_dir: Path, same_code: bool = True) -> dict[str, str]:
    results = [m for c in tasks_of(cells) if (m := stored_metrics(out_dir, c.key))]
    atomic_write_json(out_dir / "profiles.json", {m["task"]: m["flexicache"]["unstable_heads"] for m in results})
    paths = write_summary(cfg, results, out_dir)
    print_paths(paths)
    return paths


def write_summary(cfg: DictConfig, results: list[dict], out_dir: Path) -> dict[str, str]:
    summary = Summary(cfg, envs=cell_envs(results))
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
        names, matrix = stability.overlap_table({m["task"]: m["flexicache"]["unstable_heads"] for m in results})
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
                 for m in results for hs in m["flexicache"]["head_stats"]])
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
    if panels:
        summary.image("png_rco", plots.line_panels(out_dir / "rco_vs_offset.png", panels,
                                                   "offset Δ from the window start (decode steps)",
                                                   "Top-K page-set stability (FlexiCache F1)"), "RCO vs offset")
    shares = [m["flexicache"] for m in results if m["flexicache"].get("promoted_share_stable") is not None]
    if shares:
        summary.image("png_promoted", plots.bar_plot(
            out_dir / "promoted_share.png", [f["task"] for f in shares],
            {"promoted share": [100 * f["promoted_share_stable"] for f in shares]}, xlabel="profiling task",
            ylabel="pages promoted per rerank (% of top-K)", title="Host→device traffic per rerank (stable heads)"),
            "promoted share")
    return summary.write(out_dir)

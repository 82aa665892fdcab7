"""Head-stability profiling (FlexiCache §12.1): dense top-K traces -> RCO / TS per head -> head profiles.

Per task of the grid (the cell's system lends only its engine settings: decoding runs the `topk_trace` policy, which
is dense), every sample decodes `decode_steps` steps (EOS ignored; the first token comes from prefill) while each
(layer, KV head)'s top-K page set is recorded. TS per non-overlapping window of W steps ranks the heads; the
unstable set is the heads most often in a window's bottom `unstable_fraction` (FlexiCache: 25 %). The same pass
measures LServe's streaming-head proxy (attention mass outside sink + local window). Outputs under
results/<exp>/<cell>/: the FlexiCache and LServe profile JSONs and metrics.json (a complete cell is reloaded, not
recomputed); results/<exp>/summary.{md,csv} with the cross-task overlap of the unstable sets. With `ship: true` the
profiles are also written to systems/policies/profiles/, where the policies find them by (model, task).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from harness import report
from harness.envinfo import env_record
from harness.experiments.accuracy import Workspace, prepare_cell
from harness.runner import Cell, UserError, dump_yaml
from harness.store import Cell as StoreCell, atomic_write_json, atomic_write_text
from systems.base import GenerationRequest
from systems.policies import profiles, selection

DEFAULTS = dict(top_k=64, window=16, unstable_fraction=0.25, unstable_count=None, decode_steps=64, ship=False,
                sink_tokens=128, local_tokens=256, system_overrides=None, task_overrides=None, reference=None)


def knobs(cfg: DictConfig) -> dict[str, Any]:
    params = dict(OmegaConf.to_container(cfg.exp.params, resolve=True) or {})
    unknown = sorted(set(params) - set(DEFAULTS))
    if unknown:
        raise UserError(f"exp.params: unknown {unknown}; head_stability knows {sorted(DEFAULTS)}")
    out = {**DEFAULTS, **params}
    if out["decode_steps"] < out["window"] or out["window"] < 2 or out["top_k"] < 1:
        raise UserError(f"exp.params: need decode_steps >= window >= 2 and top_k >= 1, got {out}")
    return out


def trace_system(cell: Cell, k: dict) -> DictConfig:
    sys_cfg = cell.system.copy()
    sys_cfg.name, sys_cfg.backend, sys_cfg.policy = "engine-topk-trace", "engine", "topk_trace"
    sys_cfg.params = {"top_k": k["top_k"], "page_size": sys_cfg.engine.page_size, "sink_tokens": k["sink_tokens"],
                      "local_tokens": k["local_tokens"]}
    return sys_cfg


def collect(cfg: DictConfig, cell: Cell, ws: Workspace, k: dict) -> list[dict]:
    """Dense decode of every sample with tracing; returns one trace per sample."""
    _, samples, prompts = prepare_cell(cfg, cell, ws)
    system = ws.system(trace_system(cell, k))
    policy = system.engine.policy
    traces = []
    batch = cell.system.batch_size
    for start in range(0, len(samples), batch):
        chunk = list(zip(samples, prompts))[start:start + batch]
        reqs = [GenerationRequest(request_id=s.id, prompt_token_ids=p, max_new_tokens=k["decode_steps"] + 1,
                                  ignore_eos=True, seed=cfg.seed) for s, p in chunk]
        system.generate(reqs)
        traces += [policy.finished.pop(r.request_id) for r in reqs]
    return traces


def analyse(traces: list[dict], k: dict, num_layers: int, num_kv_heads: int) -> dict[str, Any]:
    """TS windows of all samples, the unstable set, per-head statistics, promoted share, LServe proxy scores."""
    H, K, W = num_layers * num_kv_heads, k["top_k"], k["window"]
    ts_all, promoted = [], []
    for tr in traces:
        sets = tr["sets"].long().view(-1, H, K)
        n = tr["num_pages"]
        ts_all.append(selection.temporal_stability(sets, n, K, W))
        # a stable head's rerank every W steps promotes the pages new in its top-K
        starts = torch.arange(0, sets.shape[0] - W, W)
        for s in starts.tolist():
            if int(n[s]) > K and int(n[s + W]) > K:
                M = int(n[s + W])
                promoted.append(1 - selection.overlap(sets[s], sets[s + W], M).double() / K)
    rco_by_offset = rco_offsets(traces, H, K, W)
    ts = torch.cat(ts_all) if ts_all else torch.empty(0, H, dtype=torch.float64)
    count = k["unstable_count"] or int(math.floor(k["unstable_fraction"] * H + 0.5))
    # the official final set: most frequent in the bottom share on a random half of the windows, whose recall of
    # the other half's bottom sets is the consensus check
    heads, recall, baseline = selection.consensus_split(ts, count)
    _, freq = selection.unstable_by_frequency(ts, count)
    valid = ts[~torch.isnan(ts).any(-1)]
    unstable = torch.zeros(H, dtype=torch.bool)
    unstable[heads] = True
    share = torch.stack(promoted) if promoted else torch.empty(0, H, dtype=torch.float64)
    mass = torch.cat([tr["outside_mass"] for tr in traces]).view(-1, H).double()
    head_stats = []
    for h in range(H):
        col = valid[:, h]
        head_stats.append({"layer": h // num_kv_heads, "head": h % num_kv_heads, "ts_mean": float(col.mean()),
                           "ts_std": float(col.std()) if col.numel() > 1 else 0.0, "ts_min": float(col.min()),
                           "bottom_frequency": int(freq[h]), "unstable": bool(unstable[h])})
    stable_share = share[:, ~unstable] if share.numel() else share
    return {
        "unstable_heads": [[h // num_kv_heads, h % num_kv_heads] for h in heads], "unstable_count": count,
        "head_stats": head_stats, "windows": int(valid.shape[0]), "samples": len(traces),
        "consensus_recall": recall, "random_baseline": baseline,
        "promoted_share_stable": float(stable_share[~torch.isnan(stable_share)].mean()) if stable_share.numel()
        else None,
        "outside_mass": torch.nanmean(mass, 0).view(num_layers, num_kv_heads).nan_to_num(0.0).tolist(),
        "rco_by_offset": rco_by_offset,
    }


def rco_offsets(traces: list[dict], H: int, K: int, W: int) -> list[list[float]]:
    """Mean RCO(S_s, S_{s+d}) per head for d = 1 .. W-1 over all window starts (FlexiCache F1): [W-1][H]."""
    sums = torch.zeros(W - 1, H, dtype=torch.float64)
    counts = torch.zeros(W - 1, H, dtype=torch.float64)
    for tr in traces:
        sets = tr["sets"].long().view(-1, H, K)
        n = tr["num_pages"]
        for s in range(0, sets.shape[0] - W + 1, W):
            for d in range(1, W):
                M = int(n[s + d])
                value = selection.rco(selection.overlap(sets[s], sets[s + d], M), K, n[s + d].expand(H))
                ok = ~torch.isnan(value)
                sums[d - 1] += value.nan_to_num(0.0)
                counts[d - 1] += ok.double()
    return (sums / counts.clamp(min=1)).masked_fill(counts == 0, float("nan")).tolist()


def profile_cell(cfg: DictConfig, cell: Cell, out_dir: Path, ws: Workspace, k: dict) -> dict:
    store = StoreCell(out_dir / cell.key)
    if store.is_complete():
        metrics = store.metrics()
        if k["ship"]:
            for kind in ("flexicache", "lserve"):
                profiles.save_profile(profiles.profile_path(kind, cfg.model.name, cell.task.name), metrics[kind])
        return metrics
    store.open(dump_yaml(cell.resolved(cfg)), env_record(cfg.seed))
    traces = collect(cfg, cell, ws, k)
    spec = ws.system(trace_system(cell, k)).engine.model.spec
    result = analyse(traces, k, spec.num_layers, spec.num_kv_heads)
    common = {"model": cfg.model.name, "task": cell.task.name, "num_layers": spec.num_layers,
              "num_kv_heads": spec.num_kv_heads, "page_size": int(cell.system.engine.page_size),
              "samples": result["samples"], "decode_steps": k["decode_steps"], "made_by": report.command_line(cfg)}
    flexi = {"kind": "flexicache", **common, "K": k["top_k"], "W": k["window"],
             **{key: result[key] for key in ("unstable_heads", "unstable_count", "head_stats", "windows",
                                             "consensus_recall", "random_baseline", "promoted_share_stable")}}
    lserve = {"kind": "lserve", **common, "sink_tokens": k["sink_tokens"], "local_tokens": k["local_tokens"],
              "proxy": "per KV head: share of decode softmax mass outside the first sink_tokens and last "
                       "local_tokens keys (max over the query group, mean over steps with more keys than the window); "
                       "high = retrieval head", "head_scores": result["outside_mass"]}
    for prof in (flexi, lserve):
        profiles.save_profile(store.root / f"profile_{prof['kind']}.json", prof)
        if k["ship"]:
            profiles.save_profile(profiles.profile_path(prof["kind"], cfg.model.name, cell.task.name), prof)
    metrics = {"task": cell.task.name, "system": cell.system.name, "flexicache": flexi, "lserve": lserve,
               "rco_by_offset": result["rco_by_offset"]}
    store.write_metrics(metrics)
    return metrics


def overlap_table(named_sets: dict[str, list]) -> tuple[list[str], list[list[float]]]:
    """|A_i ∩ A_j| / |A| between the unstable sets of every pair of tasks (|A| the set size, equal across tasks)."""
    names = list(named_sets)
    sets = {n: {tuple(h) for h in named_sets[n]} for n in names}
    return names, [[len(sets[a] & sets[b]) / max(len(sets[a]), 1) for b in names] for a in names]


def write_summary(cfg: DictConfig, results: list[dict], out_dir: Path) -> Path:
    rows, csv_rows = [], []
    for m in results:
        f = m["flexicache"]
        rows.append([f["task"], f["samples"], f["windows"], f["K"], f["W"], f["unstable_count"],
                     f["consensus_recall"], f["random_baseline"], f["promoted_share_stable"]])
        csv_rows += [{"task": f["task"], **hs} for hs in f["head_stats"]]
    glance = "; ".join(f"{m['flexicache']['task']}: {m['flexicache']['unstable_count']} unstable heads, consensus "
                       f"recall {m['flexicache']['consensus_recall']:.2f} vs {m['flexicache']['random_baseline']:.2f} "
                       f"random, a stable head's rerank promotes {m['flexicache']['promoted_share_stable']:.0%} of its "
                       f"top-K" for m in results if m["flexicache"].get("promoted_share_stable") is not None)
    pngs = plot_results(results, out_dir)
    parts = [f"# {cfg.exp.name}", "", f"**At a glance:** {glance}." if glance else "", "",
             md_table_or_none(["task", "samples", "windows", "K", "W", "unstable", "consensus recall",
                               "random", "promoted share / rerank (stable)"], rows), ""]
    if len(results) > 1:
        names, matrix = overlap_table({m["task"]: m["flexicache"]["unstable_heads"] for m in results})
        parts += ["## Cross-task overlap of unstable sets |A_i ∩ A_j| / |A|", "",
                  report.md_table(["task", *names], [[n, *row] for n, row in zip(names, matrix)], 2), ""]
    for m in results:
        f = m["flexicache"]
        per_layer: dict[int, int] = {}
        for layer, _ in f["unstable_heads"]:
            per_layer[layer] = per_layer.get(layer, 0) + 1
        parts += [f"## {f['task']}: unstable heads per layer", "",
                  ", ".join(f"L{layer}: {n}" for layer, n in sorted(per_layer.items())), ""]
    parts += [f"![{p.stem}]({p.name})" for p in pngs] + [""]
    parts += [f"Regenerate: `{report.command_line(cfg)}`.", "", report.provenance(cfg), ""]
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "summary.md", "\n".join(parts))
    atomic_write_text(out_dir / "summary.csv", report.to_csv(csv_rows))
    return out_dir / "summary.md"


def plot_results(results: list[dict], out_dir: Path) -> list[Path]:
    """F1: RCO against offset (unstable heads vs stable ones, and the extremes); T7: promoted share per task."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    with_rco = [m for m in results if m.get("rco_by_offset")]
    if with_rco:
        fig, axes = plt.subplots(1, len(with_rco), figsize=(5.5 * len(with_rco), 4), squeeze=False)
        for ax, m in zip(axes[0], with_rco):
            f = m["flexicache"]
            rco = torch.tensor(m["rco_by_offset"])                       # [W-1, H]
            unstable = torch.tensor([hs["unstable"] for hs in f["head_stats"]])
            offsets = list(range(1, rco.shape[0] + 1))
            ax.plot(offsets, torch.nanmean(rco[:, ~unstable], 1), lw=2.5, color="tab:blue", label="stable heads (mean)")
            ax.plot(offsets, torch.nanmean(rco[:, unstable], 1), lw=2.5, color="tab:red", label="unstable heads (mean)")
            order = torch.argsort(torch.nanmean(rco, 0).nan_to_num(-1.0))
            for h in order[:3].tolist() + order[-3:].tolist():
                hs = f["head_stats"][h]
                ax.plot(offsets, rco[:, h], lw=0.8, alpha=0.6, color="tab:red" if hs["unstable"] else "tab:blue")
            ax.set_xlabel("offset Δ from the window start (decode steps)")
            ax.set_ylabel("RCO(S_s, S_s+Δ) (0 = chance, 1 = identical)")
            ax.set_title(f"{f['task']}: top-{f['K']} page overlap vs offset")
            ax.set_ylim(0, 1.02)
            ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out_dir / "rco_vs_offset.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    shares = [(m["flexicache"]["task"], m["flexicache"]["promoted_share_stable"]) for m in results
              if m["flexicache"].get("promoted_share_stable") is not None]
    if shares:
        fig, ax = plt.subplots(figsize=(4 + len(shares), 3.6))
        ax.bar([t for t, _ in shares], [100 * v for _, v in shares], color="tab:green")
        ax.set_ylabel("pages promoted per rerank (% of a stable head's top-K)")
        ax.set_title("Host→device traffic per rerank")
        fig.tight_layout()
        paths.append(out_dir / "promoted_share.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def md_table_or_none(header, rows) -> str:
    return report.md_table(header, rows, 3) if rows else "No cells."


def run(cfg: DictConfig, cells: list[Cell], out_dir: Path) -> Any:
    k = knobs(cfg)
    seen, unique = set(), []
    for cell in cells:                          # one profile per task: the systems only lend engine settings
        if cell.task.name not in seen:
            seen.add(cell.task.name)
            unique.append(cell)
    ws = Workspace(cfg)
    try:
        results = [profile_cell(cfg, cell, out_dir, ws, k) for cell in unique]
    finally:
        ws.close()
    md = write_summary(cfg, results, out_dir)
    atomic_write_json(out_dir / "profiles.json", {m["task"]: m["flexicache"]["unstable_heads"] for m in results})
    print(md.read_text())
    return results

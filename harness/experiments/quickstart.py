"""The front door (`make run`): every headline policy at one shared budget — accuracy retention beside what it buys.

Part 1 scores each system on a small NeedleBench grid (S-RT, M-RT) and a few long-generation recall samples and
divides by engine-dense on the same samples. Part 2 runs one short offline-throughput cell per system on the same
requests with the engine's device pool capped, and measures each system's device-tier KV for one request.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from harness import report
from harness.envinfo import env_record
from harness.experiments import accuracy
from harness.experiments.offline_throughput import build_requests, measure
from harness.progress import RunProgress
from harness.runner import Cell, apply_budget, dump_yaml, load_group
from harness.schema import SystemConfig
from harness.store import Cell as StoreCell
from systems.base import GenerationRequest

REFERENCE = "engine-dense"


def throughput_cells(cfg: DictConfig) -> list[tuple[DictConfig, str]]:
    tp = cfg.exp.params.throughput
    out = []
    for name in tp.systems:
        system = load_group("system", name, SystemConfig)
        if cfg.exp.params.get("budget") is not None:
            apply_budget(system, cfg.exp.params.budget)
        if system.backend == "engine":
            system.engine.device_memory_gb = tp.device_memory_gb
        key = f"throughput__{system.name}__n{tp.num_requests}_in{tp.input_len}_out{tp.output_len}"
        out.append((system, key))
    return out


def run_throughput(cfg, system_cfg, key, out_dir: Path, ws, progress: RunProgress) -> dict:
    tp = cfg.exp.params.throughput
    store = StoreCell(out_dir / key)
    if store.is_complete():
        progress.skip_cell(key)
        return store.metrics()
    resolved = OmegaConf.create({"model": cfg.model, "system": system_cfg, "exp": cfg.exp, "seed": cfg.seed})
    store.open(dump_yaml(resolved), env_record(cfg.seed))
    progress.start_cell(f"{system_cfg.name} × offline throughput", 0, tp.num_requests)
    reqs = build_requests(ws.tokenizer, tp.num_requests, tp.input_len, tp.output_len, cfg.seed)
    system = ws.system(system_cfg)
    system.generate([GenerationRequest("warmup", reqs[0].prompt_token_ids[:64], 4, ignore_eos=True)])
    single = measure(system, reqs[:1])  # what one request holds on the device tier
    batch = measure(system, reqs)
    progress.advance(tp.num_requests)
    progress.end_cell()
    m = {"system": system_cfg.name, **batch, "device_kv_bytes_per_request": single["device_kv_peak_bytes"],
         "device_kv_capacity_bytes": batch["memory"].get("device_kv_capacity_bytes")}
    store.write_metrics(m)
    return m


def run(cfg: DictConfig, cells: list[Cell], out_dir: Path) -> Any:
    tcells = throughput_cells(cfg)
    ws = accuracy.Workspace(cfg)
    try:
        results, pending = accuracy.plan_cells(cfg, cells, out_dir, ws)
        tp_left = sum(cfg.exp.params.throughput.num_requests for _, k in tcells
                      if not StoreCell(out_dir / k).is_complete())
        progress = RunProgress(len(cells) + len(tcells), sum(p[3] for p in pending) + tp_left,
                               enabled=cfg.progress)
        try:
            acc = accuracy.execute_cells(cfg, cells, results, pending, out_dir, ws, progress)
            tput = [run_throughput(cfg, s, k, out_dir, ws, progress) for s, k in tcells]
        finally:
            progress.close()
    finally:
        ws.close()
    paths = write_summary(cfg, cells, acc, tput, out_dir)
    print(Path(paths["md"]).read_text())
    for kind, path in paths.items():
        print(f"[{kind}] {path}")
    return {"accuracy": acc, "throughput": tput}


def retention_rows(cells: list[Cell], metrics: list[dict]) -> tuple[list[str], list[dict]]:
    tasks = list(dict.fromkeys(c.task.name for c in cells))
    score = {(m["system"], m["task"]): m["summary"]["score"] for m in metrics}
    rows = []
    for system in dict.fromkeys(c.system.name for c in cells):
        row = {"system": system}
        ratios = []
        for t in tasks:
            s, d = score.get((system, t)), score.get((REFERENCE, t))
            r = s / d if s is not None and d else None
            row[f"{t}.score"], row[f"{t}.retention"] = s, r
            if r is not None:
                ratios.append(r)
        row["mean_retention"] = sum(ratios) / len(ratios) if ratios else None
        rows.append(row)
    return tasks, rows


def write_summary(cfg, cells, acc: list[dict], tput: list[dict], out_dir: Path) -> dict[str, str]:
    tasks, rows = retention_rows(cells, acc)
    budget = cfg.exp.params.get("budget")
    ref_tp = next((t for t in tput if t["system"] == REFERENCE), None)
    for t in tput:
        t["tok_s_ratio"] = t["output_tok_s"] / ref_tp["output_tok_s"] if ref_tp else None
        t["kv_ratio"] = (t["device_kv_bytes_per_request"] / ref_tp["device_kv_bytes_per_request"]
                         if ref_tp and ref_tp["device_kv_bytes_per_request"] and t["device_kv_bytes_per_request"]
                         else None)
    acc_table = [[r["system"], *[f"{report.fmt(r[f'{t}.retention'], 2)} ({report.fmt(r[f'{t}.score'])})"
                                 for t in tasks], r["mean_retention"]] for r in rows]
    tp_table = [[t["system"], t["output_tok_s"], t["total_tok_s"], (t["device_kv_bytes_per_request"] or 0) / 2**20,
                 t["tok_s_ratio"], t["kv_ratio"], t["mode"]] for t in tput]
    tp = cfg.exp.params.throughput
    ranked = sorted((r for r in rows if r["system"] != REFERENCE and r["mean_retention"] is not None),
                    key=lambda r: -r["mean_retention"])
    glance = [f"**At a glance:** at a shared budget of {budget} tokens per layer and KV head"]
    if ranked:
        glance.append(f", {ranked[0]['system']} keeps the most of dense accuracy ({ranked[0]['mean_retention']:.2f}) "
                      f"and {ranked[-1]['system']} the least ({ranked[-1]['mean_retention']:.2f})")
    for t in tput:
        if t["system"] != REFERENCE and t["kv_ratio"] is not None and t["tok_s_ratio"] is not None:
            glance.append(f"; {t['system']} holds {t['kv_ratio']:.2f}× dense's device KV per request at "
                          f"{t['tok_s_ratio']:.2f}× its output tokens/s")
    parts = [f"# {cfg.exp.name}: KV policies at one shared budget on SmolLM2-135M-Instruct", "",
             "".join(glance) + ".", "",
             f"**Why {budget} tokens:** {cfg.exp.params.get('budget_reason', '')}", "",
             "## Accuracy retention: score ÷ engine-dense on the same samples (absolute score, 0–100, in parentheses)",
             "", report.md_table(["system", *tasks, "mean retention"], acc_table, 2), "",
             f"## Offline throughput: {tp.num_requests} requests × ({tp.input_len} in + {tp.output_len} out), "
             f"engine device pool capped at {tp.device_memory_gb} GB", "",
             report.md_table(["system", "output tok/s", "total tok/s", "device KV per request (MiB)",
                              "tok/s ÷ dense", "KV ÷ dense", "mode"], tp_table, 2), "",
             "Device KV per request is the device-tier peak of one request run alone (prompt + output); "
             "throughput times only `generate()` after a warm-up call, EOS ignored.", "",
             "![quickstart](quickstart.png)", "",
             f"Regenerate: `{report.command_line(cfg)}` (or `make run`).", "", report.provenance(cfg), ""]
    csv_rows = [{"part": "accuracy", **r} for r in rows] + [
        {"part": "throughput", "system": t["system"], "output_tok_s": t["output_tok_s"],
         "total_tok_s": t["total_tok_s"], "device_kv_bytes_per_request": t["device_kv_bytes_per_request"],
         "tok_s_ratio": t["tok_s_ratio"], "kv_ratio": t["kv_ratio"], "mode": t["mode"]} for t in tput]
    out_dir.mkdir(parents=True, exist_ok=True)
    md, csv_path, png = out_dir / "summary.md", out_dir / "summary.csv", out_dir / "quickstart.png"
    report.atomic_write_text(md, "\n".join(parts))
    report.atomic_write_text(csv_path, report.to_csv(csv_rows))
    plot(tasks, rows, tput, png, budget)
    return {"md": str(md), "csv": str(csv_path), "png": str(png)}


def plot(tasks, rows, tput, path: Path, budget) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), gridspec_kw={"width_ratios": [2.2, 1, 1]})
    ax = axes[0]
    width = 0.8 / max(1, len(tasks))
    xs = range(len(rows))
    for j, t in enumerate(tasks):
        ax.bar([x + j * width for x in xs], [r[f"{t}.retention"] or 0 for r in rows], width, label=t)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks([x + width * (len(tasks) - 1) / 2 for x in xs], [r["system"] for r in rows], rotation=30,
                  ha="right")
    ax.set_ylabel("accuracy retention (score ÷ dense)")
    ax.set_title(f"Accuracy at a budget of {budget} tokens")
    ax.legend(fontsize=8)
    names = [t["system"] for t in tput]
    axes[1].bar(names, [t["output_tok_s"] for t in tput], color="tab:green")
    axes[1].set_ylabel("output throughput (tokens/s)")
    axes[1].set_title("Offline throughput")
    axes[2].bar(names, [(t["device_kv_bytes_per_request"] or 0) / 2**20 for t in tput], color="tab:purple")
    axes[2].set_ylabel("device-tier KV per request (MiB)")
    axes[2].set_title("Device memory")
    for a in axes[1:]:
        a.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

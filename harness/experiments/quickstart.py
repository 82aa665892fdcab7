"""The front door (`make run`): every headline policy at one shared budget — accuracy retention beside what it buys.

Part 1 scores each system on a small NeedleBench grid (S-RT, M-RT) and a few long-generation recall samples and
divides by engine-dense on the same samples. Part 2 runs one short offline-throughput cell per system on the same
requests with the engine's device pool capped, and measures each system's device-tier KV for one request.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from harness import accuracy_report
from harness.accuracy_report import AccuracyData
from harness.envinfo import env_record
from harness.experiments import accuracy
from harness.experiments.offline_throughput import build_requests, measure
from harness.progress import RunProgress
from harness.runner import Cell, apply_budget, dump_yaml, load_group
from harness.schema import SystemConfig
from harness.store import Cell as StoreCell
from harness.summary import Summary, print_paths
from systems.base import GenerationRequest

REFERENCE = "engine-dense"
SYSTEM_DEFAULTS = accuracy.SYSTEM_DEFAULTS


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
    labels = [c.system.name for c in cells]
    plans = accuracy.fidelity_plans(cfg, cells, labels, REFERENCE, out_dir)
    ws = accuracy.Workspace(cfg)
    try:
        results, pending = accuracy.plan_cells(cfg, cells, out_dir, ws)
        tp_left = sum(cfg.exp.params.throughput.num_requests for _, k in tcells
                      if not StoreCell(out_dir / k).is_complete())
        progress = RunProgress(len(cells) + len(tcells), sum(p[3] for p in pending) + tp_left,
                               enabled=cfg.progress)
        try:
            acc = accuracy.execute_cells(cfg, cells, results, pending, out_dir, ws, progress, plans)
            tput = [run_throughput(cfg, s, k, out_dir, ws, progress) for s, k in tcells]
        finally:
            progress.close()
    finally:
        ws.close()
    rows_by_cell = {c.key: StoreCell(out_dir / c.key).rows() for c in cells}
    print_paths(write_summary(cfg, cells, acc, rows_by_cell, tput, out_dir))
    return {"accuracy": acc, "throughput": tput}


def write_summary(cfg, cells, acc: list[dict], rows_by_cell: dict, tput: list[dict], out_dir: Path) -> dict[str, str]:
    data = AccuracyData(cells, [c.system.name for c in cells], rows_by_cell)
    budget = cfg.exp.params.get("budget")
    ref_tp = next((t for t in tput if t["system"] == REFERENCE), None)
    for t in tput:
        t["tok_s_ratio"] = t["output_tok_s"] / ref_tp["output_tok_s"] if ref_tp else None
        t["kv_ratio"] = (t["device_kv_bytes_per_request"] / ref_tp["device_kv_bytes_per_request"]
                         if ref_tp and ref_tp["device_kv_bytes_per_request"] and t["device_kv_bytes_per_request"]
                         else None)
    tp = cfg.exp.params.throughput
    bullets = [f"accuracy retention vs {REFERENCE} (macro mean over {len(data.usable(REFERENCE))} task units): "
               f"{data.ranking(REFERENCE)}"]
    if data.has("fid_top1"):
        bullets.append(f"teacher-forced top-1 agreement with {REFERENCE}: {data.fidelity_ranking('fid_top1', REFERENCE)}")
    for t in tput:
        if t["system"] != REFERENCE and t["kv_ratio"] is not None and t["tok_s_ratio"] is not None:
            bullets.append(f"{t['system']} holds {t['kv_ratio']:.2f}× {REFERENCE}'s device KV per request at "
                           f"{t['tok_s_ratio']:.2f}× its output tokens/s")
    summary = Summary(cfg, f"{cfg.exp.name}: KV policies at one shared budget on SmolLM2-135M-Instruct")
    summary.glance(f"at a shared budget of {budget} tokens per layer and KV head (`>`: the paired 95 % interval of "
                   "the difference excludes 0; `≈`: indistinguishable at this n):", bullets)
    summary.text(f"**Why this size:** {cfg.exp.params.get('size_reason', '')}")
    summary.text(f"**Why {budget} tokens:** {cfg.exp.params.get('budget_reason', '')}")
    accuracy_report.standard_sections(summary, data, REFERENCE, out_dir, plot_name="quickstart_retention.png")
    tp_table = [[t["system"], t["output_tok_s"], t["total_tok_s"], (t["device_kv_bytes_per_request"] or 0) / 2**20,
                 t["tok_s_ratio"], t["kv_ratio"], t["mode"]] for t in tput]
    summary.section(f"Offline throughput: {tp.num_requests} requests × ({tp.input_len} in + {tp.output_len} out), "
                    f"engine device pool capped at {tp.device_memory_gb} GB")
    summary.table(["system", "output tok/s", "total tok/s", "device KV per request (MiB)", "tok/s ÷ dense",
                   "KV ÷ dense", "mode"], tp_table, 2)
    summary.text("Device KV per request is the device-tier peak of one request run alone (prompt + output); "
                 "throughput times only `generate()` after a warm-up call, EOS ignored.")
    summary.csv([{"part": "throughput", "system": t["system"], "output_tok_s": t["output_tok_s"],
                  "total_tok_s": t["total_tok_s"], "device_kv_bytes_per_request": t["device_kv_bytes_per_request"],
                  "tok_s_ratio": t["tok_s_ratio"], "kv_ratio": t["kv_ratio"], "mode": t["mode"]} for t in tput])
    summary.took(sum(m.get("generation_seconds", 0) + m.get("fidelity_seconds", 0) for m in acc)
                 + sum(t.get("wall_s", 0) for t in tput), "accuracy cells + timed throughput")
    return summary.write(out_dir)

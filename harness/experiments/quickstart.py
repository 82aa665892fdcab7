"""The front door (`make run`): every headline policy at one shared budget — accuracy retention beside what it buys.

Part 1 scores each system on a NeedleBench S-RT grid sized for narrow intervals and divides by engine-dense on the
same samples, with teacher-forced fidelity beside. Part 2 runs one short offline-throughput cell per system on the same
requests with the engine's device pool capped, and measures each system's device-tier KV for one request.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from harness import accuracy_cells as accuracy
from harness import accuracy_report
from harness.accuracy_report import AccuracyData
from harness.experiments.offline_throughput import build_requests, measure
from harness.reporting.summary import Summary, cell_envs
from harness.running import params as params_lib
from harness.running.cells import cell_config, run_cell
from harness.running.params import AccuracyParams
from harness.running.progress import RunProgress
from harness.running.runner import GridCell, apply_budget, load_group
from harness.running.schema import SystemConfig
from harness.running.store import CellStore
from systems.base import GenerationRequest

REFERENCE = "engine-dense"
SYSTEM_DEFAULTS = accuracy.SYSTEM_DEFAULTS


@dataclass
class Throughput:
    systems: list[str] = field(default_factory=lambda: ["dense", "flexicache", "vllm"])
    num_requests: int = 8
    input_len: int = 2000
    output_len: int = 64
    device_memory_gb: float = 0.25        # every system's device KV capacity (engine pool, vLLM's KV cache), capped


@dataclass
class Params(AccuracyParams):
    throughput: Throughput = field(default_factory=Throughput)


grid = accuracy.grid


def throughput_cells(cfg: DictConfig, p: Params) -> list[tuple[DictConfig, str]]:
    tp, out = p.throughput, []
    for name in tp.systems:
        system = load_group("system", name, SystemConfig)
        if p.budget is not None:
            apply_budget(system, p.budget)
        system.engine.device_memory_gb = tp.device_memory_gb     # the engines' pools and vLLM's KV cache alike
        out.append((system, f"throughput__{system.name}__n{tp.num_requests}_in{tp.input_len}_out{tp.output_len}"))
    return out


def throughput_work(cfg, p: Params, system_cfg, ws):
    def work(store) -> dict:
        tp = p.throughput
        reqs = build_requests(ws.tokenizer, tp.num_requests, tp.input_len, tp.output_len, cfg.seed)
        system = ws.system(system_cfg)
        system.generate([GenerationRequest("warmup", reqs[0].prompt_token_ids[:64], 4, ignore_eos=True)])
        single = measure(system, reqs[:1])  # what one request holds on the device tier
        batch = measure(system, reqs)
        return {"system": system_cfg.name, **batch, "device_kv_bytes_per_request": single["device_kv_peak_bytes"],
                "device_kv_capacity_bytes": batch["memory"].get("device_kv_capacity_bytes")}
    return work


def run(cfg: DictConfig, cells: list[GridCell], out_dir: Path) -> Any:
    p = params_lib.parse(cfg, Params)
    cells, labels = grid(cfg, cells, p)
    tcells = throughput_cells(cfg, p)
    plans = accuracy.fidelity_plans(cfg, cells, labels, REFERENCE, out_dir)
    ws = accuracy.Workspace(cfg)
    try:
        for s, _ in tcells:
            ws.check_fits(s, p.throughput.input_len, p.throughput.output_len)
        results, pending = accuracy.plan_cells(cfg, cells, out_dir, ws)
        tp_left = sum(p.throughput.num_requests for _, k in tcells if not CellStore(out_dir / k).is_complete())
        progress = RunProgress(len(cells) + len(tcells), sum(x[3] for x in pending) + tp_left, enabled=cfg.progress)
        try:
            acc = accuracy.execute_cells(cfg, cells, results, pending, out_dir, ws, progress, plans)
            tput = [run_cell(cfg, key, cell_config(cfg, system=s), out_dir, throughput_work(cfg, p, s, ws), progress,
                             f"{s.name} × offline throughput", p.throughput.num_requests) for s, key in tcells]
        finally:
            progress.close()
    finally:
        ws.close()
    summarize(cfg, cells, out_dir, p=p, grid_done=(cells, labels))
    return {"accuracy": acc, "throughput": tput}


def summarize(cfg: DictConfig, cells: list[GridCell], out_dir: Path, same_code: bool = True, p=None,
              grid_done=None) -> dict[str, str]:
    return accuracy.summarize_kind(sys.modules[__name__], cfg, cells, out_dir, same_code, p, grid_done)


def write_summary(cfg, p: Params, cells, labels, acc, rows_by_cell, out_dir: Path) -> dict[str, str]:
    data = AccuracyData(cells, labels, rows_by_cell, p.min_reference_score)
    tput = [CellStore(out_dir / key).metrics() for _, key in throughput_cells(cfg, p)
            if (out_dir / key / "metrics.json").is_file()]
    budget = p.budget
    ref_tp = next((t for t in tput if t["system"] == REFERENCE), None)
    for t in tput:
        t["tok_s_ratio"] = t["output_tok_s"] / ref_tp["output_tok_s"] if ref_tp else None
        t["kv_ratio"] = (t["device_kv_bytes_per_request"] / ref_tp["device_kv_bytes_per_request"]
                         if ref_tp and ref_tp["device_kv_bytes_per_request"] and t["device_kv_bytes_per_request"]
                         else None)
    tp = p.throughput
    units = len(data.usable(REFERENCE))
    bullets = [f"accuracy retention vs {REFERENCE} (macro mean over {units} task unit{'s' * (units != 1)}): "
               f"{data.ranking(REFERENCE)}"]
    if data.has("fid_top1"):
        bullets.append(f"teacher-forced top-1 agreement with {REFERENCE}: "
                       f"{data.fidelity_ranking('fid_top1', REFERENCE)}")
    for t in tput:
        if t["system"] != REFERENCE and t["kv_ratio"] is not None and t["tok_s_ratio"] is not None:
            bullets.append(f"{t['system']} holds {t['kv_ratio']:.2f}× {REFERENCE}'s device KV per request at "
                           f"{t['tok_s_ratio']:.2f}× its output tokens/s")
    summary = Summary(cfg, f"{cfg.exp.name}: KV policies at one shared budget on SmolLM2-135M-Instruct",
                      envs=cell_envs(acc))
    summary.glance(f"at a shared budget of {budget} tokens per layer and KV head (`>`: the paired 95 % interval of "
                   "the difference excludes 0; `≈`: indistinguishable at this n):", bullets)
    summary.reasons(p.size_reason, p.budget_reason, budget)
    accuracy_report.standard_sections(summary, data, REFERENCE, out_dir, plot_name="quickstart_retention.png")
    tp_table = [[t["system"], t["output_tok_s"], t["total_tok_s"], (t["device_kv_bytes_per_request"] or 0) / 2**20,
                 t["tok_s_ratio"], t["kv_ratio"], t["mode"], t.get("cores_busy"), t.get("busy_threads"),
                 t.get("cpus_allowed")] for t in tput]
    summary.section(f"Offline throughput: {tp.num_requests} requests × ({tp.input_len} in + {tp.output_len} out), "
                    f"device KV capacity capped at {tp.device_memory_gb} GB for every system")
    summary.table(["system", "output tok/s", "total tok/s", "device KV per request (MiB)", "tok/s ÷ dense",
                   "KV ÷ dense", "mode", "cores busy", "busy threads", "CPUs"], tp_table, 2)
    summary.text("Device KV per request is the device-tier peak of one request run alone (prompt + output); "
                 "throughput times only `generate()` after a warm-up call, EOS ignored. Every system gets the same "
                 "cores and KV capacity (vLLM's kv_cache_memory_bytes = the engine's device pool); cores busy = CPU "
                 "seconds ÷ wall time of this process and its children, busy threads ran ≥ 10 % of the time, CPUs "
                 "= the cores they may use, all from /proc.")
    summary.csv([{"part": "throughput", "system": t["system"], "output_tok_s": t["output_tok_s"],
                  "total_tok_s": t["total_tok_s"], "device_kv_bytes_per_request": t["device_kv_bytes_per_request"],
                  "tok_s_ratio": t["tok_s_ratio"], "kv_ratio": t["kv_ratio"], "mode": t["mode"],
                  "cores_busy": t.get("cores_busy"), "busy_threads": t.get("busy_threads"),
                  "cpus_allowed": t.get("cpus_allowed")} for t in tput])
    summary.took(accuracy_report.cells_seconds(acc)
                 + sum(t.get("wall_s", 0) for t in tput), "accuracy cells + timed throughput")
    return summary.write(out_dir)

"""The front door (`make run`): every headline policy at one shared budget — accuracy retention beside what it buys.

Part 1 scores each system on a NeedleBench S-RT grid sized for narrow intervals and divides by engine-dense on the
same samples, with teacher-forced fidelity beside. Part 2 runs one short offline-throughput cell per system on the same
requests with the engine's device pool capped, and measures each system's device-tier KV for one request.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harness.experiments.accuracy import AccuracyExperiment, ratio
from harness.experiments.accuracy.cells import AccuracyItem
from harness.experiments.accuracy.data import AccuracyData
from harness.experiments.accuracy.params import AccuracyParams
from harness.experiments.accuracy.sections import cells_seconds, standard_sections
from harness.measuring.offline import build_requests, measure
from harness.reporting.summary import cell_envs
from harness.running.cells import cell_config
from harness.running.experiment import Cell, Run
from harness.running.grid import apply_budget, check_one_system, system_config
from harness.running.store import CellStore
from systems.base import GenerationRequest


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


def throughput_cells(run: Run[Params]) -> list[Cell]:
    """One timed cell per throughput system, the shared budget applied and every device pool capped alike."""
    cfg, p = run.cfg, run.params
    tp, out = p.throughput, []
    for name in tp.systems:
        system = system_config(name)
        if p.budget is not None:
            apply_budget(system, p.budget)
        elif p.compression_ratio is not None and ratio.applies(system, p.compression_ratio):
            apply_budget(system, ratio.budget_for(system, p.compression_ratio, tp.input_len))   # fixed prompt length
        system.engine.device_memory_gb = tp.device_memory_gb     # the engines' pools and vLLM's KV cache alike
        out.append(Cell(key=f"throughput__{system.name}__n{tp.num_requests}_in{tp.input_len}_out{tp.output_len}",
                        config=cell_config(cfg, system=system), label=f"{system.name} × offline throughput",
                        units=tp.num_requests, system=system, policy=check_one_system(cfg, system),
                        fits=(tp.input_len, tp.output_len)))
    return out


class Quickstart(AccuracyExperiment[Params]):
    params_type = Params

    def cells(self, run: Run[Params]) -> list[Cell]:
        throughput = throughput_cells(run)
        run.extra_systems = [c.system for c in throughput if c.system is not None]
        return super().cells(run) + throughput

    def run_cell(self, run: Run[Params], cell: Cell, store: CellStore) -> dict:
        if isinstance(cell.item, AccuracyItem):
            return super().run_cell(run, cell, store)
        assert cell.system is not None
        tp, ws = run.params.throughput, run.workspace
        reqs = build_requests(ws.tokenizer, tp.num_requests, tp.input_len, tp.output_len, run.cfg.seed)
        system = ws.system(cell.system, cell.policy)
        system.generate([GenerationRequest("warmup", reqs[0].prompt_token_ids[:64], 4, ignore_eos=True)])
        single = measure(system, reqs[:1])  # what one request holds on the device tier
        batch = measure(system, reqs)
        return {"system": cell.system.name, **batch, "device_kv_bytes_per_request": single["device_kv_peak_bytes"],
                "device_kv_capacity_bytes": batch["memory"].get("device_kv_capacity_bytes")}

    def write_summary(self, run: Run[Params], cells: list[Any], labels: list[str], metrics: list[dict],
                      rows_by_cell: dict[str, list[dict]]) -> dict[str, str]:
        return write_summary(run, cells, labels, metrics, rows_by_cell)


def write_summary(run: Run[Params], cells: list[Any], labels: list[str], acc: list[dict],
                  rows_by_cell: dict[str, list[dict]]) -> dict[str, str]:
    cfg, p, out_dir = run.cfg, run.params, run.out_dir
    reference = p.reference or labels[0]
    data = AccuracyData(cells, labels, rows_by_cell, p.min_reference_score)
    # a damaged throughput cell is left out here and named by the summary's damage note
    tput = [{k: v for k, v in m.items() if k != "_env"} for c in throughput_cells(run) if (m := run.stored(c.key))]
    budget = p.budget
    ref_tp = next((t for t in tput if t["system"] == reference), None)
    for t in tput:
        t["tok_s_ratio"] = t["output_tok_s"] / ref_tp["output_tok_s"] if ref_tp else None
        t["kv_ratio"] = (t["device_kv_bytes_per_request"] / ref_tp["device_kv_bytes_per_request"]
                         if ref_tp and ref_tp["device_kv_bytes_per_request"] and t["device_kv_bytes_per_request"]
                         else None)
    tp = p.throughput
    units = len(data.usable(reference))
    bullets = [f"accuracy retention vs {reference} (macro mean over {units} task unit{'s' * (units != 1)}): "
               f"{data.ranking(reference)}"]
    if data.has("fid_top1"):
        bullets.append(f"teacher-forced top-1 agreement with {reference}: "
                       f"{data.fidelity_ranking('fid_top1', reference)}")
    for t in tput:
        if t["system"] != reference and t["kv_ratio"] is not None and t["tok_s_ratio"] is not None:
            bullets.append(f"{t['system']} holds {t['kv_ratio']:.2f}× {reference}'s device KV per request at "
                           f"{t['tok_s_ratio']:.2f}× its output tokens/s")
    summary = run.summary(f"{cfg.exp.name}: KV policies at one shared budget on SmolLM2-135M-Instruct",
                          envs=cell_envs(acc))
    at = ratio.phrase(p.compression_ratio, None, None) if p.compression_ratio is not None else \
        f" at a shared budget of {budget} tokens per layer and KV head"
    summary.glance(f"{at.strip()} (`>`: the paired 95 % interval of the difference excludes 0; `≈`: "
                   "indistinguishable at this n):", bullets)
    summary.reasons(p.size_reason, p.budget_reason, budget)
    standard_sections(summary, data, reference, out_dir, plot_name="quickstart_retention.png")
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
    summary.csv([{"system": t["system"], "output_tok_s": t["output_tok_s"],
                  "total_tok_s": t["total_tok_s"], "device_kv_bytes_per_request": t["device_kv_bytes_per_request"],
                  "tok_s_ratio": t["tok_s_ratio"], "kv_ratio": t["kv_ratio"], "mode": t["mode"],
                  "cores_busy": t.get("cores_busy"), "busy_threads": t.get("busy_threads"),
                  "cpus_allowed": t.get("cpus_allowed")} for t in tput], "throughput")
    summary.took(cells_seconds(acc)
                 + sum(t.get("wall_s", 0) for t in tput), "accuracy cells + timed throughput")
    return summary.write(out_dir)


EXPERIMENT = Quickstart()

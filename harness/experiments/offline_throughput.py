"""Offline throughput: one fixed request set (essay text, fixed lengths, EOS ignored) through each system.

Definitions follow `vllm bench throughput`: only `generate()` is timed (one short warm-up call per system first,
excluded), token counts come from the returned ids, and total tok/s = (prompt + output tokens) / elapsed, output
tok/s = output tokens / elapsed, req/s = N / elapsed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from harness.measuring.offline import build_requests, measure
from harness.reporting import plots
from harness.reporting.summary import cell_envs
from harness.running.cells import cell_config
from harness.running.envinfo import machine_class
from harness.running.experiment import Cell, Experiment, Run
from harness.running.params import GridParams
from harness.running.store import CellStore
from systems.base import GenerationRequest


@dataclass
class Params(GridParams):
    num_requests: int = 16
    input_len: int = 4000
    output_lens: list[int] = field(default_factory=lambda: [256])
    seed: int = 0
    warmup: bool = True
    reference: Optional[str] = None           # ratios are to this system (conf/exp sets it)


class OfflineThroughput(Experiment[Params]):
    params_type = Params

    def cells(self, run: Run[Params]) -> list[Cell]:
        """One cell per system and output length: throughput has no task."""
        p = run.params
        systems = list({c.system.name: c for c in run.grid}.values())
        return [Cell(key=f"{c.system.name}__in{p.input_len}_out{out}_n{p.num_requests}",
                     config=cell_config(run.cfg, system=c.system, output_len=out),
                     label=f"{c.system.name} × {p.num_requests} × ({p.input_len} + {out})", units=p.num_requests,
                     system=c.system, policy=c.policy, fits=(p.input_len, out), item=out)
                for c in systems for out in p.output_lens]

    def run_cell(self, run: Run[Params], cell: Cell, store: CellStore) -> dict:
        p, ws, out_len = run.params, run.workspace, cell.item
        reqs = build_requests(ws.tokenizer, p.num_requests, p.input_len, out_len, p.seed)
        assert cell.system is not None
        system = ws.system(cell.system, cell.policy)
        if p.warmup:
            system.generate([GenerationRequest("warmup", reqs[0].prompt_token_ids[:64], 4, ignore_eos=True)])
        return {"system": cell.system.name, "input_len": p.input_len, "output_len": out_len,
                **measure(system, reqs)}

    def report(self, run: Run[Params], cells: list[Cell]) -> dict[str, str]:
        return write_summary(run, [m for c in cells if (m := run.stored(c.key))])


def ratio_lines(results: list[dict], reference: str) -> list[str]:
    lines = []
    for out_len in sorted({r["output_len"] for r in results}):
        rows = {r["system"]: r for r in results if r["output_len"] == out_len}
        ref = rows.get(reference)
        for name, r in rows.items():
            if ref and name != reference:
                lines.append(f"output {out_len}: **{name} ÷ {reference} = "
                             f"{r['total_tok_s'] / ref['total_tok_s']:.2f}×** "
                             f"total tok/s ({r['total_tok_s']:.1f} vs {ref['total_tok_s']:.1f})")
    return lines


def write_summary(run: Run[Params], results: list[dict]) -> dict[str, str]:
    p, out_dir = run.params, run.out_dir
    ref = str(p.reference if p.reference in {r["system"] for r in results} else
              (results[0]["system"] if results else ""))
    summary = run.summary(envs=cell_envs(results))
    summary.glance(f"tokens/s of each system on the same requests, ratios to `{ref}`:", ratio_lines(results, ref))
    summary.table(["system", "in", "out", "requests", "total tok/s", "output tok/s", "req/s", "wall s",
                   "device KV peak MiB", "mode", "execution", "cores busy", "busy threads", "CPUs", "tok per CPU-s"],
                  [[r["system"], r["input_len"], r["output_len"], r["num_requests"], r["total_tok_s"],
                    r["output_tok_s"], r["req_s"], r["wall_s"], (r["device_kv_peak_bytes"] or 0) / 2**20, r["mode"],
                    r.get("execution") or "—",
                    r.get("cores_busy"), r.get("busy_threads"), r.get("cpus_allowed"),
                    (r["prompt_tokens"] + r["output_tokens"]) / r["cpu_s"] if r.get("cpu_s") else None]
                   for r in results], 2)
    summary.text("Only `generate()` is timed (after one short warm-up call); EOS is ignored so every request produces "
                 "exactly its output length; device KV peak is the block manager's peak for the engine, the padded "
                 "cache for hf, and peak KV usage × block bytes for vLLM. Cores busy = CPU seconds of this process "
                 "and its children (vLLM's engine core) ÷ wall time, busy threads ran ≥ 10 % of it, CPUs = the "
                 "cores they may use, all read from /proc; vLLM binds its worker to every core the run may use "
                 "(`system.omp_threads_bind`), the engine runs one thread per core, and both get the same KV "
                 "capacity (`engine.device_memory_gb`).")
    summary.csv([{k: r.get(k) for k in ("system", "input_len", "output_len", "num_requests", "total_tok_s",
                                        "output_tok_s", "req_s", "wall_s", "device_kv_peak_bytes",
                                        "device_kv_peak_bytes_per_request", "mode", "execution", "cores_busy", "cpu_s",
                                        "busy_threads", "cpus_allowed")} for r in results], "throughput")
    systems = list(dict.fromkeys(r["system"] for r in results))
    out_lens = sorted({r["output_len"] for r in results})
    at = {(r["system"], r["output_len"]): r for r in results}
    summary.image("png_throughput", plots.bar_plot(
        out_dir / "throughput.png", systems,
        {f"output {o}": [at[(s, o)]["total_tok_s"] if (s, o) in at else float("nan") for s in systems]
         for o in out_lens},
        xlabel="system (cores busy per bar)", ylabel="total tokens/s (prompt + output)", colour_by="group",
        title=f"Offline throughput: {p.num_requests} requests × ({p.input_len} in + out) each, same cores and KV "
              f"capacity; {machine_class(next(iter(cell_envs(results)), None))}",
        notes={f"output {o}": [f"{at[(s, o)].get('cores_busy') or 0:.2f} cores" if (s, o) in at else ""
                               for s in systems] for o in out_lens},
        note=summary.figure_note(f"n = {p.num_requests} requests per bar")), "throughput per system")
    if len(out_lens) > 1:
        summary.image("png", plots.line_plot(
            out_dir / "throughput_vs_output_len.png",
            {s: [(r["output_len"], r["output_tok_s"]) for r in results if r["system"] == s]
             for s in dict.fromkeys(r["system"] for r in results)},
            "output length (tokens)", "output throughput (tokens/s)", "Offline throughput vs output length",
            ymin=0.0, note=summary.figure_note(f"n = {p.num_requests} requests per point")))
    summary.took(sum(r.get("wall_s", 0) for r in results), "timed generate() calls")
    return summary.write(out_dir)


EXPERIMENT = OfflineThroughput()

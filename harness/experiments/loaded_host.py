"""Speed on a shared host: each system at 1 and at every allowed core, on an idle machine and beside CPU burners.

A benchmark a user can rerun on their own machine: the same offline requests through engine-dense (torch threads)
and vLLM (its worker bound to the same cores), first alone, then while `background` busy-loop processes compete for
the cores. It answers whether more threads ever lose to fewer when the machine is busy (every parallel region
waits for its slowest thread, and the thread that shares a core with the other process is slow; OpenMP barriers
that spin make it worse), and prints what each run actually used from /proc.
"""
from __future__ import annotations

import copy
import multiprocessing as mp
import time
from dataclasses import dataclass, field

from omegaconf import DictConfig

from harness.measuring.offline import build_requests, measure
from harness.reporting.summary import cell_envs
from harness.running.cells import cell_config
from harness.running.config import UserError
from harness.running.experiment import Cell, Experiment, Run
from harness.running.grid import GridCell
from harness.running.params import GridParams
from harness.running.store import CellStore
from systems.base import GenerationRequest
from systems.hardware import allowed_cpus
from systems.registry import backend_of


@dataclass
class Params(GridParams):
    threads: list[int] = field(default_factory=lambda: [1, 0])       # 0 = every core this run may use
    background: list[int] = field(default_factory=lambda: [0, 1, 2])  # CPU-burning processes beside the run
    num_requests: int = 4
    input_len: int = 1500
    output_len: int = 32
    repeats: int = 3              # timed generate() calls per point; the median one is reported, all are kept
    settle_s: float = 2.0         # the burners run this long before timing: the host is busy when requests come


def _burn(stop_at: float) -> None:
    while time.time() < stop_at:
        pass


def with_threads(system: DictConfig, threads: int) -> DictConfig:
    """The system on its first `threads` allowed cores, bound the way its backend binds (torch threads, or a
    worker's core list)."""
    out = copy.deepcopy(system)
    backend_of(out).on_cores(out, allowed_cpus()[:threads])
    return out


def points(cells: list[GridCell], p: Params) -> list[tuple[DictConfig, int, int, str]]:
    """(system, threads, burners, cell key) per measurement."""
    n_cores = len(allowed_cpus())
    out = []
    for cell in {c.system.name: c for c in cells}.values():
        for t in p.threads:
            threads = t or n_cores
            for bg in p.background:
                key = f"{cell.system.name}__t{threads}_bg{bg}__n{p.num_requests}_in{p.input_len}_out{p.output_len}"
                out.append((with_threads(cell.system, threads), threads, bg, key))
    return out


class LoadedHost(Experiment[Params]):
    params_type = Params

    def check(self, run: Run[Params]) -> None:
        p = run.params
        if p.repeats < 1 or p.settle_s < 0:
            raise UserError(f"exp.params.repeats must be >= 1 and settle_s >= 0, got {p.repeats} and {p.settle_s}")

    def cells(self, run: Run[Params]) -> list[Cell]:
        p = run.params
        return [Cell(key=key, config=cell_config(run.cfg, system=system, background=bg),
                     label=f"{system.name} × {threads} thread(s), {bg} burner(s)", units=p.num_requests,
                     system=system, fits=(p.input_len, p.output_len), item=(threads, bg))
                for system, threads, bg, key in points(run.grid, p)]

    def run_cell(self, run: Run[Params], cell: Cell, store: CellStore) -> dict:
        p, ws, (threads, bg) = run.params, run.workspace, cell.item
        assert cell.system is not None
        reqs = build_requests(ws.tokenizer, p.num_requests, p.input_len, p.output_len, run.cfg.seed)
        sut = ws.system(cell.system)
        sut.generate([GenerationRequest("warmup", reqs[0].prompt_token_ids[:64], 4, ignore_eos=True)])
        burners = [mp.get_context("spawn").Process(target=_burn, args=(time.time() + 3600,), daemon=True)
                   for _ in range(bg)]
        for b in burners:
            b.start()
        try:
            if burners:
                time.sleep(p.settle_s)
            runs = [measure(sut, reqs, exclude=frozenset(b.pid for b in burners if b.pid)) for _ in range(p.repeats)]
            median = sorted(runs, key=lambda m: m["total_tok_s"])[(len(runs) - 1) // 2]
            return {"system": cell.system.name, "threads": threads, "background": bg, **median,
                    "total_tok_s_runs": [m["total_tok_s"] for m in runs]}
        finally:
            for b in burners:
                b.kill()
                b.join()

    def report(self, run: Run[Params], cells: list[Cell]) -> dict[str, str]:
        return write_summary(run, [m for c in cells if (m := run.stored(c.key))])


def _runs(row: dict) -> str:
    return "/".join(f"{x:.0f}" for x in row.get("total_tok_s_runs") or [row["total_tok_s"]])


def write_summary(run: Run[Params], rows: list[dict]) -> dict[str, str]:
    cfg, p, out_dir = run.cfg, run.params, run.out_dir
    summary = run.summary(f"{cfg.exp.name}: throughput on an idle and on a busy host", envs=cell_envs(rows))
    verdicts = []
    for system in dict.fromkeys(r["system"] for r in rows):
        for bg in sorted({r["background"] for r in rows}):
            runs = sorted((r for r in rows if r["system"] == system and r["background"] == bg),
                          key=lambda r: r["threads"])
            if len(runs) > 1:
                few, many = runs[0], runs[-1]
                verdicts.append(f"`{system}` with {bg} burner(s): {many['threads']} threads "
                                f"{many['total_tok_s'] / few['total_tok_s']:.2f}× the tok/s of {few['threads']} "
                                f"({many['total_tok_s']:.0f} vs {few['total_tok_s']:.0f}; runs {_runs(many)} vs "
                                f"{_runs(few)})")
    summary.glance(f"more threads vs fewer, per system and background load (median of {p.repeats} timed runs each; "
                   "> 1 = more threads faster):", verdicts)
    summary.table(["system", "threads", "burners", "total tok/s", "output tok/s", "wall s", "cores busy",
                   "busy threads", "CPUs"],
                  [[r["system"], r["threads"], r["background"], r["total_tok_s"], r["output_tok_s"], r["wall_s"],
                    r.get("cores_busy"), r.get("busy_threads"), r.get("cpus_allowed")] for r in rows], 2)
    summary.text(f"{p.num_requests} requests × ({p.input_len} + {p.output_len} tokens, EOS ignored), timed as "
                 f"offline_throughput times them, {p.repeats} times per row (the row is the median run). A burner is "
                 f"a busy-looping process started after the warm-up, {p.settle_s:g} s before the first timed run, and "
                 "killed after the last; cores busy counts only the system's own processes (CPU seconds ÷ wall), "
                 "read from /proc.")
    summary.csv([{k: r.get(k) for k in ("system", "threads", "background", "total_tok_s", "output_tok_s",
                                        "wall_s", "cores_busy", "cpu_s", "busy_threads", "cpus_allowed",
                                        "total_tok_s_runs")} for r in rows], "throughput")
    summary.took(sum(r.get("wall_s", 0) * len(r.get("total_tok_s_runs") or [0]) for r in rows),
                 "timed generate() calls")
    return summary.write(out_dir)


EXPERIMENT = LoadedHost()

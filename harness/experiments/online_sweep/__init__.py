"""Online sweep: each system behind its HTTP server, streamed requests at a list of arrival rates (FlexiCache F6).

Per system one server is started (harness.measuring.servers: the one its backend serves, e.g. the engine's or `vllm
serve`) and kept for all its rates (rates.py). Per rate the same prompts (distinct essay windows, exact token counts
sent as token ids, EOS ignored) arrive by the configured process (harness.measuring.loadgen) and are measured as
`vllm bench serve` measures them (harness.measuring.serving_stats).
Each rate is bounded by `num_prompts` and `max_seconds` and written as one JSON file, so a rerun resumes at the
first missing rate. Prefix caching: vLLM runs with --no-enable-prefix-caching and the engine has none; warm-up
requests use their own windows and are excluded from every duration.
"""
from __future__ import annotations

import importlib.util

from omegaconf import DictConfig

from harness.experiments.online_sweep.params import Params
from harness.experiments.online_sweep.rates import CLIENTS, essay_windows, key_of, measurements, rate_path, sweep
from harness.experiments.online_sweep.report import focus_line as focus_line  # re-export: tests read it here
from harness.experiments.online_sweep.report import write_summary
from harness.measuring.loadgen import PROCESSES, arrival_times
from harness.measuring.serving_stats import parse_goodput
from harness.reporting.summary import cell_envs
from harness.running.cells import cell_config
from harness.running.config import UserError
from harness.running.experiment import Cell, Experiment, Run
from harness.running.grid import GridCell
from harness.running.store import CellStore
from systems.registry import backend_of


def check(cfg: DictConfig, cells: list[GridCell], p: Params) -> None:
    """Everything checkable without a model or a server; raises UserError naming the fix."""
    try:
        if not p.rates:
            raise ValueError("exp.params.rates is an empty list")
        for r in p.rates:
            arrival_times(1, r, p.process, p.burstiness, cfg.seed)
        p.goodput = parse_goodput(p.goodput)
    except (TypeError, ValueError) as exc:
        raise UserError(f"online_sweep: {exc} (exp.params.rates/process/burstiness/goodput)") from None
    if p.process not in PROCESSES:
        raise UserError(f"online_sweep: process {p.process!r} unknown; use one of {list(PROCESSES)}")
    for key in ("num_prompts", "input_len", "output_len", "max_seconds", "repeats"):
        if getattr(p, key) <= 0:
            raise UserError(f"online_sweep: exp.params.{key}={getattr(p, key)!r} must be a positive number")
    if p.input_len + p.output_len > cfg.model.max_model_len:
        raise UserError(f"online_sweep: input_len + output_len = {p.input_len + p.output_len} exceeds "
                        f"model.max_model_len={cfg.model.max_model_len}; lower exp.params.input_len")
    unknown = sorted(set(p.clients) - set(CLIENTS))
    if not p.clients or unknown:
        raise UserError(f"online_sweep: exp.params.clients must list some of {list(CLIENTS)}, got {p.clients}")
    if "vllm_bench" in p.clients and importlib.util.find_spec("vllm") is None:
        raise UserError("online_sweep: the vllm_bench client runs `vllm bench serve`, and vLLM is not installed; "
                        "run `make setup-vllm` or drop vllm_bench from exp.params.clients")
    if p.endpoint != "completions":
        raise UserError("online_sweep: prompts are exact token-id windows, so exp.params.endpoint must be completions")
    for cell in cells:
        if not backend_of(cell.system).serves:
            raise UserError(f"online_sweep: system {cell.system.name!r} (backend {cell.system.backend}) has no HTTP "
                            "server; sweep systems whose backend serves")


class OnlineSweep(Experiment[Params]):
    params_type = Params

    def check(self, run: Run[Params]) -> None:
        check(run.cfg, run.grid, run.params)

    def cells(self, run: Run[Params]) -> list[Cell]:
        """One cell per system (the sweep has no task), its rates resumed one by one."""
        p = run.params
        return [Cell(key=key_of(c, p), config=cell_config(run.cfg, system=c.system),
                     label=f"{c.system.name} × {len(p.rates)} rates", units=len(p.rates), system=c.system,
                     policy=c.policy, fits=(p.input_len, p.output_len), item=c)
                for c in {c.system.name: c for c in run.grid}.values()]

    def is_complete(self, run: Run[Params], cell: Cell, store: CellStore) -> bool:
        """Complete when its metrics list exactly these rates and every rate's measurements are on disk."""
        p = run.params
        return (store.is_complete(cell.config_yaml()) and store.metrics().get("rates") == p.rates
                and store.metrics().get("repeats", 1) == p.repeats
                and all(rate_path(store, r, c, k).is_file() for r, k, c in measurements(p)))

    def plan_cell(self, run: Run[Params], cell: Cell, store: CellStore) -> int:
        p = run.params
        return sum(all(rate_path(store, at, c, k).is_file() for at, k, c in measurements(p) if at == r)
                   for r in p.rates)

    def run_cell(self, run: Run[Params], cell: Cell, store: CellStore) -> dict:
        p, ws = run.params, run.workspace
        windows = ws.memo("online:windows", lambda: essay_windows(ws.tokenizer, p.num_prompts + p.warmups,
                                                                  p.input_len, run.cfg.seed))
        return sweep(run, cell.item, windows, store)

    def report(self, run: Run[Params], cells: list[Cell]) -> dict[str, str]:
        done = [m for c in cells if (m := run.stored(c.key))]
        return write_summary(run, [r for m in done for r in m["rows"]], cell_envs(done))


EXPERIMENT = OnlineSweep()

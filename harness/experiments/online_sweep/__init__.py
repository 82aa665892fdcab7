"""Online sweep: each system behind its HTTP server, streamed requests at a list of arrival rates (FlexiCache F6).

Per system one server is started (harness.measuring.servers: the engine's, or `vllm serve`) and kept for all its rates. Per
rate the same prompts (distinct essay windows, exact token counts sent as token ids, EOS ignored) arrive by the
configured process (harness/loadgen.py) and are measured as `vllm bench serve` measures them (harness/stats.py).
Each rate is bounded by `num_prompts` and `max_seconds` and written as one JSON file, so a rerun resumes at the
first missing rate. Prefix caching: vLLM runs with --no-enable-prefix-caching and the engine has none; warm-up
requests use their own windows and are excluded from every duration.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig

from harness.integrations.assets import model_dir as resolve_model_dir
from harness.measuring.loadgen import PROCESSES, arrival_times
from harness.measuring.serving_stats import parse_goodput
from harness.online_cells import essay_windows, key_of, sweep_system
from harness.reporting import plots
from harness.reporting.summary import Summary, cell_envs, print_paths
from harness.reporting.tables import fmt
from harness.running import params as params_lib
from harness.running.cells import check_fits, stored_metrics
from harness.running.params import GridParams
from harness.running.runner import GridCell, UserError

STAT_KEYS = [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "std", "p99")]
CSV_KEYS = ["system", "request_rate", "burstiness", "num_prompts", "input_len", "output_len", "completed", "failed",
            "rejected", "duration", "request_throughput", "request_goodput", "output_throughput",
            "total_token_throughput", "total_input_tokens", "total_output_tokens", *STAT_KEYS,
            "max_output_tokens_per_s", "max_concurrent_requests", "cores_busy", "busy_threads", "cpus_allowed"]


@dataclass
class Params(GridParams):
    rates: list[float] = field(default_factory=lambda: [1.0, 2.0, 4.0])   # requests/s; .inf sends all at t=0
    process: str = "poisson"              # poisson | gamma (uses burstiness) | constant
    burstiness: float = 1.0
    num_prompts: int = 16
    max_seconds: float = 300              # per rate: later arrivals are not sent, requests in flight are cancelled
    input_len: int = 512
    output_len: int = 64
    warmups: int = 1
    endpoint: str = "completions"
    max_concurrency: Optional[int] = None
    goodput: dict[str, float] = field(default_factory=dict)   # SLOs in ms, e.g. {ttft: 2000, tpot: 200}
    percentiles: list[float] = field(default_factory=lambda: [99.0])
    max_queue: int = 1024                 # engine server: waiting requests beyond its running slots before 503
    startup_timeout_s: float = 600
    # the at-a-glance comparison: `focus`'s TPOT against each of `versus` at the highest rate versus[0] sustains
    focus: Optional[str] = None
    versus: list[str] = field(default_factory=list)


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
    for key in ("num_prompts", "input_len", "output_len", "max_seconds"):
        if getattr(p, key) <= 0:
            raise UserError(f"online_sweep: exp.params.{key}={getattr(p, key)!r} must be a positive number")
    if p.input_len + p.output_len > cfg.model.max_model_len:
        raise UserError(f"online_sweep: input_len + output_len = {p.input_len + p.output_len} exceeds "
                        f"model.max_model_len={cfg.model.max_model_len}; lower exp.params.input_len")
    if p.endpoint != "completions":
        raise UserError("online_sweep: prompts are exact token-id windows, so exp.params.endpoint must be completions")
    for cell in cells:
        if cell.system.backend not in ("engine", "vllm"):
            raise UserError(f"online_sweep: system {cell.system.name!r} (backend {cell.system.backend}) has no HTTP "
                            "server; sweep backend=engine or backend=vllm systems")
        if cell.system.backend == "vllm":
            import importlib.util

            from systems.vllm import INSTALL_HINT
            if importlib.util.find_spec("vllm") is None:
                raise UserError(f"online_sweep: system {cell.system.name!r} needs vLLM, which is not installed; "
                                f"{INSTALL_HINT}, or drop it from exp.systems")


def systems_of(cells: list[GridCell]) -> list[GridCell]:
    return list({c.system.name: c for c in cells}.values())      # the sweep has no task: one cell per system


def run(cfg: DictConfig, cells: list[GridCell], out_dir: Path) -> Any:
    p = params_lib.parse(cfg, Params)
    check(cfg, cells, p)
    from transformers import AutoTokenizer

    model_dir = Path(resolve_model_dir(cfg.model.path)).resolve()
    for cell in systems_of(cells):
        check_fits(cfg, model_dir, cell.system, p.input_len, p.output_len)
    windows = essay_windows(AutoTokenizer.from_pretrained(model_dir), p.num_prompts + p.warmups, p.input_len, cfg.seed)
    rows = [r for cell in systems_of(cells) for r in sweep_system(cfg, cell, p, windows, model_dir, out_dir)]
    summarize(cfg, cells, out_dir)
    return rows


def summarize(cfg: DictConfig, cells: list[GridCell], out_dir: Path, same_code: bool = True) -> dict[str, str]:
    p = params_lib.parse(cfg, Params)
    cells_done = [m for c in systems_of(cells) if (m := stored_metrics(out_dir, key_of(c, p)))]
    paths = write_summary(cfg, p, [r for m in cells_done for r in m["rows"]], cell_envs(cells_done), out_dir)
    print_paths(paths)
    return paths


SUSTAINED = ("every request done, the last within 1/0.9 of the time a queue-free run needs: the last arrival plus "
             "the system's mean E2EL at its lowest rate")


def sustains(r: dict, rows: list[dict]) -> bool:
    """The system kept up with rate r: every request completed, and the run ended within 1/0.9 of the time it would
    take with no queue (the last arrival, at num_prompts / rate, plus the system's mean E2EL at its lowest rate).

    Requests served at the pace they arrive finish one service time after the last arrival; a growing queue pushes
    the end further out. Completed ÷ duration ≥ 0.9 × rate (vLLM bench's throughput against the offered rate)
    counts that service time as lost throughput, so long requests never pass it at any rate."""
    own = [x for x in rows if x["system"] == r["system"] and x.get("mean_e2el_ms")]
    if r["completed"] != r["num_prompts"] or not own or not r.get("duration"):
        return False
    service_s = min(own, key=lambda x: x["request_rate"])["mean_e2el_ms"] / 1e3
    return r["duration"] <= (r["num_prompts"] / r["request_rate"] + service_s) / 0.9


def focus_line(rows: list[dict], focus: str, versus: list[str]) -> str | None:
    """`focus`'s mean TPOT ratio to each system of `versus`, at the highest rate versus[0] sustains."""
    base = [r for r in rows if r["system"] == versus[0] and sustains(r, rows)]
    if base:
        rate = max(r["request_rate"] for r in base)
        where = f"at {rate:g} req/s, the highest rate `{versus[0]}` sustains ({SUSTAINED})"
    else:       # still state the ratio, at the least loaded point, and say that no rate is sustained
        rate = min((r["request_rate"] for r in rows if r["system"] == versus[0]), default=None)
        if rate is None:
            return None
        where = f"`{versus[0]}` sustains none of the rates ({SUSTAINED}); at the lowest, {rate:g} req/s"
    at = {r["system"]: r for r in rows if r["request_rate"] == rate}
    if focus not in at or not at[focus]["mean_tpot_ms"]:
        return None
    parts = [f"{at[v]['mean_tpot_ms'] / at[focus]['mean_tpot_ms']:.2f}× lower than `{v}`'s "
             f"({at[v]['mean_tpot_ms']:.0f} ms)" for v in versus if v in at]
    return (f"{where}, `{focus}`'s mean TPOT ({at[focus]['mean_tpot_ms']:.0f} ms) is " + " and ".join(parts)
            + " (below 1×: higher).")


def write_summary(cfg, p: Params, rows: list[dict], envs: list[dict], out_dir: Path) -> dict[str, str]:
    summary = Summary(cfg, envs=envs)
    if rows:
        top = max(r["request_rate"] for r in rows)
        summary.glance(f"at {top:g} req/s (the highest rate) mean " + "; ".join(
            f"`{r['system']}` TPOT {fmt(r['mean_tpot_ms'])} ms, TTFT {fmt(r['mean_ttft_ms'])} ms (p99 "
            f"{fmt(r['p99_ttft_ms'])}), {r['completed']}/{r['num_prompts']} completed"
            for r in rows if r["request_rate"] == top) + ".",
            [line] if p.focus and p.versus and (line := focus_line(rows, p.focus, p.versus)) else ())
    arrivals = p.process + (f" (burstiness {p.burstiness:g})" if p.process == "gamma" else "")
    summary.text(f"{p.num_prompts} requests per rate × ({p.input_len} prompt tokens + {p.output_len} output tokens, "
                 f"EOS ignored, greedy), {arrivals} arrivals rescaled so the last lands at N/rate, each rate capped "
                 f"at {p.max_seconds:g} s. Latencies in ms.")
    keys = ["system", "request_rate", "completed", "failed", "request_throughput", "output_throughput",
            "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
            "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms", "max_concurrent_requests", "cores_busy", "busy_threads",
            "cpus_allowed"]
    summary.table(["system", "rate req/s", "done", "failed", "req/s", "out tok/s", "mean TTFT", "median TTFT",
                   "p99 TTFT", "mean TPOT", "median TPOT", "p99 TPOT", "mean ITL", "p99 ITL", "mean E2EL",
                   "peak concurrency", "cores busy", "busy threads", "CPUs"], [[r.get(k) for k in keys] for r in rows],
                  1)
    summary.text("Cores busy = the server process tree's CPU seconds ÷ the rate's wall time; busy threads ran for at "
                 "least 10 % of it; CPUs = the cores its processes may use (all from /proc). Both servers get the "
                 "same cores, device KV capacity (`engine.device_memory_gb`; vLLM's kv_cache_memory_bytes), "
                 "max_num_seqs and max_num_batched_tokens.")
    summary.text("Definitions (`vllm bench serve`): TTFT = first token chunk − request start; TPOT = (E2EL − TTFT) / "
                 "(output tokens − 1) per request; ITL = gaps between consecutive token chunks pooled over requests; "
                 "E2EL = last token chunk − start; req/s and tok/s over the rate's wall time; peak concurrency = the "
                 "most requests in flight in any second. Every server streams one chunk per token.")
    if p.goodput:
        summary.text(f"Goodput SLOs (ms): {p.goodput}; see `request_goodput` in summary.csv.")
    summary.csv([{k: r.get(k) for k in CSV_KEYS} for r in rows])
    if rows:
        by = {s: sorted((r for r in rows if r["system"] == s), key=lambda r: r["request_rate"])
              for s in dict.fromkeys(r["system"] for r in rows)}
        summary.image("tpot_png", plots.line_plot(
            out_dir / "tpot_vs_rate.png",
            {s: [(r["request_rate"], r["mean_tpot_ms"]) for r in rs] for s, rs in by.items()},
            "request rate (requests/s)", "mean TPOT (ms)", "Mean TPOT vs request rate"), "TPOT vs rate")
        summary.image("ttft_png", plots.line_plot(
            out_dir / "ttft_vs_rate.png",
            {s: [(r["request_rate"], r["mean_ttft_ms"]) for r in rs] for s, rs in by.items()},
            "request rate (requests/s)", "mean TTFT (ms)", "Mean TTFT vs request rate",
            dashed={s: [(r["request_rate"], r["p99_ttft_ms"]) for r in rs] for s, rs in by.items()},
            dashed_label="p99 (dashed)"), "TTFT vs rate")
    return summary.write(out_dir)

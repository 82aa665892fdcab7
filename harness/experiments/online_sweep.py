"""Online sweep: each system behind its HTTP server, streamed requests at a list of arrival rates (FlexiCache F6).

Per system one server is started (`python -m systems.server` for engine policies, `vllm serve` through
systems.vllm.serve for vllm) on a free loopback port and kept for all its rates. Per rate the same prompts
(distinct essay windows, exact token counts sent as token ids, EOS ignored) arrive by the configured process
(harness/loadgen.py) and are measured as `vllm bench serve` measures them (harness/stats.py). Each rate is
bounded by `num_prompts` and `max_seconds`; it is written as one JSON file, so a rerun resumes at the first
missing rate. Prefix caching: vLLM runs with --no-enable-prefix-caching and the engine has none, so no cell
measures another's cache; warm-up requests use their own windows and are excluded from every duration.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from harness import report
from harness.assets import model_dir as resolve_model_dir
from harness.envinfo import env_record
from harness.loadgen import PROCESSES, Prompt, arrival_times, run_load
from harness.runner import Cell, UserError, dump_yaml
from harness.stats import parse_goodput, summarize
from harness.store import Cell as StoreCell
from harness.store import atomic_write_json

REPO = Path(__file__).resolve().parents[2]
DEFAULTS: dict[str, Any] = {
    "rates": [1.0, 2.0, 4.0], "process": "poisson", "burstiness": 1.0, "num_prompts": 16, "max_seconds": 300,
    "input_len": 512, "output_len": 64, "warmups": 1, "endpoint": "completions", "max_concurrency": None,
    "goodput": {}, "percentiles": [99], "max_queue": 1024, "startup_timeout_s": 600, "vllm_max_num_seqs": 128,
}
STAT_KEYS = [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "std", "p99")]
CSV_KEYS = ["system", "request_rate", "burstiness", "num_prompts", "input_len", "output_len", "completed", "failed",
            "rejected", "duration", "request_throughput", "request_goodput", "output_throughput",
            "total_token_throughput", "total_input_tokens", "total_output_tokens", *STAT_KEYS,
            "max_output_tokens_per_s", "max_concurrent_requests"]


def check_params(cfg: DictConfig, cells: list[Cell]) -> dict[str, Any]:
    """Everything checkable without a model or a server; raises UserError naming the fix."""
    raw = OmegaConf.to_container(cfg.exp.params, resolve=True)
    unknown = sorted(set(raw) - set(DEFAULTS) - {"system_overrides", "task_overrides"})
    if unknown:
        raise UserError(f"online_sweep: unknown exp.params {unknown}; valid: {sorted(DEFAULTS)}")
    p = {**DEFAULTS, **{k: v for k, v in raw.items() if k in DEFAULTS}}
    rates = p["rates"] if isinstance(p["rates"], list) else [p["rates"]]
    try:
        p["rates"] = [float(r) for r in rates]
        if not p["rates"]:
            raise ValueError("an empty list")
        for r in p["rates"]:
            arrival_times(1, r, p["process"], float(p["burstiness"]), cfg.seed)
        p["goodput"] = parse_goodput(p["goodput"])
    except (TypeError, ValueError) as exc:
        raise UserError(f"online_sweep: {exc} (exp.params.rates/process/burstiness/goodput)") from None
    if p["process"] not in PROCESSES:
        raise UserError(f"online_sweep: process {p['process']!r} unknown; use one of {list(PROCESSES)}")
    for key in ("num_prompts", "input_len", "output_len", "max_seconds"):
        if not isinstance(p[key], (int, float)) or p[key] <= 0:
            raise UserError(f"online_sweep: exp.params.{key}={p[key]!r} must be a positive number")
    if p["input_len"] + p["output_len"] > cfg.model.max_model_len:
        raise UserError(f"online_sweep: input_len + output_len = {p['input_len'] + p['output_len']} exceeds "
                        f"model.max_model_len={cfg.model.max_model_len}; lower exp.params.input_len")
    if p["endpoint"] != "completions":
        raise UserError("online_sweep: prompts are exact token-id windows, so exp.params.endpoint must be completions")
    for cell in cells:
        backend = cell.system.backend
        if backend not in ("engine", "vllm"):
            raise UserError(f"online_sweep: system {cell.system.name!r} (backend {backend}) has no HTTP server; "
                            "sweep backend=engine or backend=vllm systems")
        if backend == "vllm":
            import importlib.util

            from systems.vllm import INSTALL_HINT
            if importlib.util.find_spec("vllm") is None:
                raise UserError(f"online_sweep: system {cell.system.name!r} needs vLLM, which is not installed; "
                                f"{INSTALL_HINT}, or drop it from exp.systems")
    return p


def essay_windows(tokenizer, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` windows of essay tokens starting at distinct offsets, so no two prompts share a prefix."""
    from harness.assets import essay_files

    text = "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in essay_files())
    base = tokenizer.encode(text, add_special_tokens=False)
    while len(base) <= length:
        base = base + base
    # Disjoint windows while they fit; beyond that, overlapping ones at distinct starts (wrapping around).
    stride = length if count * length <= len(base) else max(1, len(base) // count)
    ring = base + base[:length]
    starts = [(seed * 7919 + i * stride) % len(base) for i in range(count)]
    return [ring[s:s + length] for s in starts]


@dataclass
class ServerProcess:
    url: str
    model: str
    process: subprocess.Popen
    log_path: Path

    def close(self, timeout_s: float = 30.0) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return json.loads(resp.read() or b"{}")
    except (OSError, ValueError):
        return None


def start_engine_server(cell: Cell, model_dir: Path, cfg: DictConfig, p: dict, log_dir: Path) -> ServerProcess:
    s, eng = cell.system, cell.system.engine
    name = model_dir.name
    cmd = [sys.executable, "-m", "systems.server", "--model", str(model_dir), "--served-model-name", name,
           "--policy", s.policy, "--params", json.dumps(OmegaConf.to_container(s.params, resolve=True)),
           "--host", "127.0.0.1", "--port", str(free_port()), "--dtype", cfg.model.dtype,
           "--max-model-len", str(cfg.model.max_model_len), "--max-queue", str(p["max_queue"]),
           "--page-size", str(eng.page_size), "--device-memory-gb", str(eng.device_memory_gb),
           "--host-memory-gb", str(eng.host_memory_gb), "--max-num-seqs", str(eng.max_num_seqs),
           "--max-num-batched-tokens", str(eng.max_num_batched_tokens)]
    if eng.threads:
        cmd += ["--threads", str(eng.threads)]
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / "server.log"
    with open(log, "wb") as sink:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
    server = ServerProcess(f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}", name, proc, log)
    deadline = time.monotonic() + p["startup_timeout_s"]
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-1500:]
            raise RuntimeError(f"engine server exited with code {proc.returncode}; log {log}:\n{tail}")
        if _get_json(server.url + "/health"):
            return server
        time.sleep(0.5)
    server.close()
    raise TimeoutError(f"engine server did not answer /health within {p['startup_timeout_s']} s; see {log}")


def start_server(cell: Cell, model_dir: Path, cfg: DictConfig, p: dict, log_dir: Path):
    if cell.system.backend == "engine":
        return start_engine_server(cell, model_dir, cfg, p, log_dir)
    from systems.vllm import serve
    log_dir.mkdir(parents=True, exist_ok=True)
    return serve(model_dir, free_port(), dtype=cfg.model.dtype, max_model_len=cfg.model.max_model_len,
                 max_num_seqs=p["vllm_max_num_seqs"], served_model_name=model_dir.name,
                 startup_timeout_s=p["startup_timeout_s"], log_path=log_dir / "server.log")


def wait_idle(server, timeout_s: float = 60.0) -> None:
    """Let requests cancelled at a cell's time limit drain before the next cell starts (engine: /health counts)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        snap = _get_json(server.url + "/health")
        if not snap or "running" not in snap:      # vLLM's /health has no body: give it a moment
            time.sleep(1.0)
            return
        if snap["running"] == 0 and snap["waiting"] == 0:
            return
        time.sleep(0.2)


def run_rate(server, prompts: list[Prompt], rate: float, p: dict, seed: int) -> dict[str, Any]:
    arrivals = arrival_times(len(prompts), rate, p["process"], float(p["burstiness"]), seed)
    outputs, duration = asyncio.run(run_load(
        server.url, server.model, prompts, list(arrivals), max_tokens=int(p["output_len"]), endpoint=p["endpoint"],
        temperature=0.0, ignore_eos=True, max_concurrency=p["max_concurrency"], max_seconds=float(p["max_seconds"])))
    summary = summarize(outputs, duration, goodput=p["goodput"] or None, percentiles=p["percentiles"])
    detail = {"ttfts": [o.ttft for o in outputs], "itls": [o.itl for o in outputs],
              "output_lens": [o.output_tokens for o in outputs], "start_times": [o.start_time for o in outputs],
              "latencies": [o.latency for o in outputs], "errors": [o.error for o in outputs],
              "statuses": [o.status for o in outputs], "arrivals": list(map(float, arrivals))}
    return {"summary": summary, "detail": detail}


def run(cfg: DictConfig, cells: list[Cell], out_dir: Path) -> Any:
    p = check_params(cfg, cells)
    systems = list({c.system.name: c for c in cells}.values())     # the sweep has no task: one cell per system
    from transformers import AutoTokenizer

    model_dir = Path(resolve_model_dir(cfg.model.path)).resolve()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    n, in_len = int(p["num_prompts"]), int(p["input_len"])
    windows = essay_windows(tokenizer, n + int(p["warmups"]), in_len, cfg.seed)
    prompts = [Prompt(w, len(w)) for w in windows[:n]]
    tag = f"{p['process']}" + (f"{p['burstiness']:g}" if p["process"] == "gamma" else "")
    rows = []
    for cell in systems:
        key = cell.key.replace(f"__{cell.task.name}", "", 1) + f"__{tag}_in{in_len}_out{p['output_len']}_n{n}"
        store = StoreCell(out_dir / key)
        store.retire_if_stale(dump_yaml(cell.resolved(cfg)))            # rates measured by other code run again
        todo = [r for r in p["rates"] if not (store.root / f"rate_{r:g}.json").is_file()]
        server = None
        try:
            if todo:
                store.open(dump_yaml(cell.resolved(cfg)), env_record(cfg.seed))
                print(f"[start] {cell.system.name}: server for rates {todo}", flush=True)
                server = start_server(cell, model_dir, cfg, p, store.root)
                for w in windows[n:]:
                    asyncio.run(run_load(server.url, server.model, [Prompt(w, len(w))], [0.0], max_tokens=4,
                                         max_seconds=float(p["max_seconds"])))
            for rate in p["rates"]:
                path = store.root / f"rate_{rate:g}.json"
                if rate in todo:
                    wait_idle(server)
                    result = run_rate(server, prompts, rate, p, cfg.seed)
                    atomic_write_json(path, result)
                    s = result["summary"]
                    print(f"[rate {rate:g}] {cell.system.name}: {s['completed']}/{n} completed, "
                          f"mean TTFT {s['mean_ttft_ms']:.1f} ms, mean TPOT {s['mean_tpot_ms']:.1f} ms", flush=True)
                summary = json.loads(path.read_text())["summary"]
                rows.append({"system": cell.system.name, "request_rate": rate, "burstiness": p["burstiness"],
                             "num_prompts": n, "input_len": in_len, "output_len": p["output_len"], **summary})
        finally:
            if server is not None:
                server.close()
        store.write_metrics({"system": cell.system.name, "rates": p["rates"],
                             "rows": [r for r in rows if r["system"] == cell.system.name]})
    paths = write_summary(cfg, p, rows, out_dir)
    print(Path(paths["md"]).read_text())
    for kind, path in paths.items():
        print(f"[{kind}] {path}")
    return rows


def glance(rows: list[dict]) -> str:
    top = max(r["request_rate"] for r in rows)
    at_top = [r for r in rows if r["request_rate"] == top]
    parts = [f"`{r['system']}` TPOT {report.fmt(r['mean_tpot_ms'])} ms, TTFT {report.fmt(r['mean_ttft_ms'])} ms "
             f"(p99 {report.fmt(r['p99_ttft_ms'])}), {r['completed']}/{r['num_prompts']} completed" for r in at_top]
    return f"**At a glance:** at {top:g} req/s (the highest rate) mean " + "; ".join(parts) + "."


def write_summary(cfg, p: dict, rows: list[dict], out_dir: Path) -> dict[str, str]:
    header = ["system", "rate req/s", "done", "failed", "req/s", "out tok/s", "mean TTFT", "median TTFT", "p99 TTFT",
              "mean TPOT", "median TPOT", "p99 TPOT", "mean ITL", "p99 ITL", "mean E2EL"]
    keys = ["system", "request_rate", "completed", "failed", "request_throughput", "output_throughput",
            "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
            "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms"]
    arrivals = p["process"] + (f" (burstiness {p['burstiness']:g})" if p["process"] == "gamma" else "")
    parts = [f"# {cfg.exp.name}", "", glance(rows) if rows else "No rows.", "",
             f"{p['num_prompts']} requests per rate × ({p['input_len']} prompt tokens + {p['output_len']} output "
             f"tokens, EOS ignored, greedy), {arrivals} arrivals rescaled so the last lands at N/rate, each rate "
             f"capped at {p['max_seconds']} s. Latencies in ms.", "",
             report.md_table(header, [[r[k] for k in keys] for r in rows], 1), "",
             "Definitions (`vllm bench serve`): TTFT = first token chunk − request start; TPOT = (E2EL − TTFT) / "
             "(output tokens − 1) per request; ITL = gaps between consecutive token chunks pooled over requests; "
             "E2EL = last token chunk − start; req/s and tok/s over the rate's wall time. Every server streams "
             "one chunk per token.", ""]
    if p["goodput"]:
        parts += [f"Goodput SLOs (ms): {p['goodput']}; see `request_goodput` in summary.csv.", ""]
    parts += [f"Regenerate: `{report.command_line(cfg)}`.", "", report.provenance(cfg), ""]
    out_dir.mkdir(parents=True, exist_ok=True)
    md, csv_path = out_dir / "summary.md", out_dir / "summary.csv"
    report.atomic_write_text(md, "\n".join(parts))
    report.atomic_write_text(csv_path, report.to_csv([{k: r.get(k) for k in CSV_KEYS} for r in rows]))
    paths = {"md": str(md), "csv": str(csv_path)}
    if rows:
        paths["tpot_png"] = plot(rows, [("mean_tpot_ms", "mean", "-")], "mean TPOT (ms)",
                                 "Mean TPOT vs request rate", out_dir / "tpot_vs_rate.png")
        paths["ttft_png"] = plot(rows, [("mean_ttft_ms", "mean", "-"), ("p99_ttft_ms", "p99", "--")], "TTFT (ms)",
                                 "TTFT (mean, p99) vs request rate", out_dir / "ttft_vs_rate.png")
    return paths


def plot(rows: list[dict], series: list[tuple[str, str, str]], ylabel: str, title: str, path: Path) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, name in enumerate(dict.fromkeys(r["system"] for r in rows)):
        mine = sorted((r for r in rows if r["system"] == name), key=lambda r: r["request_rate"])
        for key, label, style in series:
            pts = [(r["request_rate"], r[key]) for r in mine if r[key] is not None and not math.isnan(r[key])]
            ax.plot([x for x, _ in pts], [y for _, y in pts], style, marker="o", color=f"C{i}",
                    label=f"{name} ({label})" if len(series) > 1 else name)
    ax.set_xlabel("request rate (requests/s)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)

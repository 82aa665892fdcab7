"""The online sweep's store-backed cells: per system one server, per arrival rate one stored JSON of measurements."""
from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.measuring.cpu_usage import CpuMeter
from harness.measuring.loadgen import Prompt, arrival_times, run_load
from harness.measuring.servers import start_server, wait_idle
from harness.measuring.serving_stats import summarize as serving_stats
from harness.running.cells import cell_config
from harness.running.envinfo import env_record
from harness.running.runner import GridCell, dump_yaml
from harness.running.store import CellStore, atomic_write_json

if TYPE_CHECKING:
    from harness.experiments.online_sweep import Params

log = logging.getLogger("kvharness")


def essay_windows(tokenizer, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` windows of essay tokens starting at distinct offsets, so no two prompts share a prefix."""
    from harness.integrations.assets import essay_files

    text = "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in essay_files())
    base = tokenizer.encode(text, add_special_tokens=False)
    while len(base) <= length:
        base = base + base
    # Disjoint windows while they fit; beyond that, overlapping ones at distinct starts (wrapping around).
    stride = length if count * length <= len(base) else max(1, len(base) // count)
    ring = base + base[:length]
    return [ring[s:s + length] for s in ((seed * 7919 + i * stride) % len(base) for i in range(count))]


def run_rate(server, prompts: list[Prompt], rate: float, p: Params, seed: int) -> dict[str, Any]:
    arrivals = arrival_times(len(prompts), rate, p.process, p.burstiness, seed)
    outputs, duration = asyncio.run(run_load(
        server.url, server.model, prompts, list(arrivals), max_tokens=p.output_len, endpoint=p.endpoint,
        temperature=0.0, ignore_eos=True, max_concurrency=p.max_concurrency, max_seconds=float(p.max_seconds)))
    detail = {"ttfts": [o.ttft for o in outputs], "itls": [o.itl for o in outputs],
              "output_lens": [o.output_tokens for o in outputs], "start_times": [o.start_time for o in outputs],
              "latencies": [o.latency for o in outputs], "errors": [o.error for o in outputs],
              "statuses": [o.status for o in outputs], "arrivals": list(map(float, arrivals))}
    return {"summary": serving_stats(outputs, duration, goodput=p.goodput or None, percentiles=p.percentiles),
            "detail": detail}


def _with_cpu(result: dict) -> dict:
    cpu = result.get("cpu") or {}
    return {**result["summary"], "cores_busy": cpu.get("cores_busy"), "busy_threads": cpu.get("busy_threads"),
            "cpus_allowed": cpu.get("cpus_allowed")}


def key_of(cell: GridCell, p: Params) -> str:
    tag = p.process + (f"{p.burstiness:g}" if p.process == "gamma" else "")
    return (cell.key.replace(f"__{cell.task.name}", "", 1)
            + f"__{tag}_in{p.input_len}_out{p.output_len}_n{p.num_prompts}")


def sweep_system(cfg, cell: GridCell, p: Params, windows, model_dir: Path, out_dir: Path) -> list[dict]:
    """One system's rows: the rates not on disk yet measured behind one server started for them all."""
    n, store = p.num_prompts, CellStore(out_dir / key_of(cell, p))
    config = dump_yaml(cell_config(cfg, system=cell.system))
    store.retire_if_stale(config)                                # rates measured by other code run again
    todo = [r for r in p.rates if not (store.root / f"rate_{r:g}.json").is_file()]
    server, rows = None, []
    try:
        if todo:
            store.open(config, env_record(cfg.seed))
            log.info("%s: starting its server for rates %s", cell.system.name, todo)
            server = start_server(cell, model_dir, cfg, p, store.root)
            for w in windows[n:]:
                asyncio.run(run_load(server.url, server.model, [Prompt(w, len(w))], [0.0], max_tokens=4,
                                     max_seconds=float(p.max_seconds)))
        for rate in p.rates:
            path = store.root / f"rate_{rate:g}.json"
            if rate in todo:
                wait_idle(server)
                with CpuMeter(server.process.pid) as meter:      # the server's whole process tree
                    result = run_rate(server, [Prompt(w, len(w)) for w in windows[:n]], rate, p, cfg.seed)
                result["cpu"] = meter.usage.as_dict() if meter.usage else None
                atomic_write_json(path, result)
                s = result["summary"]
                log.info("rate %g, %s: %d/%d completed, mean TTFT %.1f ms, mean TPOT %.1f ms", rate, cell.system.name,
                         s["completed"], n, s["mean_ttft_ms"], s["mean_tpot_ms"])
            rows.append({"system": cell.system.name, "request_rate": rate, "burstiness": p.burstiness,
                         "num_prompts": n, "input_len": p.input_len, "output_len": p.output_len,
                         **_with_cpu(json.loads(path.read_text()))})
    finally:
        if server is not None:
            server.close()
    store.write_metrics({"system": cell.system.name, "rates": p.rates, "rows": rows})
    return rows

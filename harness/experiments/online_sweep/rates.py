"""The work of one online-sweep cell: one server per system, one stored JSON of measurements per arrival rate."""
from __future__ import annotations

import asyncio
import json
import logging
import math
from pathlib import Path
from typing import Any

from harness.experiments.online_sweep.params import Params
from harness.integrations.assets import essay_files
from harness.measuring.cpu_usage import CpuTrace
from harness.measuring.loadgen import Prompt, arrival_times, run_load
from harness.measuring.servers import Server, engine_steps, start_server, wait_idle
from harness.measuring.serving_stats import summarize as serving_stats
from harness.measuring.vllm_bench import bench_serve
from harness.running.experiment import Run
from harness.running.grid import GridCell
from harness.running.store import CellStore, atomic_write_json

log = logging.getLogger("kvharness")


def essay_windows(tokenizer: Any, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` windows of essay tokens starting at distinct offsets, so no two prompts share a prefix."""
    text = "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in essay_files())
    base = tokenizer.encode(text, add_special_tokens=False)
    while len(base) <= length:
        base = base + base
    # Disjoint windows while they fit; beyond that, overlapping ones at distinct starts (wrapping around).
    stride = length if count * length <= len(base) else max(1, len(base) // count)
    ring = base + base[:length]
    return [ring[s:s + length] for s in ((seed * 7919 + i * stride) % len(base) for i in range(count))]


def run_rate(server: Server, prompts: list[Prompt], rate: float, p: Params, seed: int) -> dict[str, Any]:
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
            "cpus_allowed": cpu.get("cpus_allowed"), "cpu_window": cpu.get("window", "client's load"),
            "steps": result.get("steps"), **step_split(result.get("steps"))}


STEP_KEYS = ("decode_rows", "beside_prompt_share", "mixed_steps", "mixed_step_ms", "mixed_rows_per_step",
             "decode_steps", "decode_step_ms", "decode_rows_per_step", "prompt_steps", "prompt_step_ms")


def step_split(steps: dict | None) -> dict[str, float | None]:
    """Where an engine server's decode rows ran during one measurement (the difference of its step tallies before
    and after, or their sum over rounds): how many shared their step with a prompt chunk, and what each kind of step
    cost. Empty for a server without tallies."""
    if not steps:
        return {}
    rows = steps["mixed_rows"] + steps["decode_rows"]

    def per(total: float, count: float, scale: float = 1.0) -> float | None:
        return scale * total / count if count else None
    return {"decode_rows": rows, "beside_prompt_share": per(steps["mixed_rows"], rows),
            "mixed_steps": steps["mixed_steps"], "mixed_step_ms": per(steps["mixed_s"], steps["mixed_steps"], 1e3),
            "mixed_rows_per_step": per(steps["mixed_rows"], steps["mixed_steps"]),
            "decode_steps": steps["decode_steps"], "decode_step_ms": per(steps["decode_s"], steps["decode_steps"], 1e3),
            "decode_rows_per_step": per(steps["decode_rows"], steps["decode_steps"]),
            "prompt_steps": steps["prompt_steps"], "prompt_step_ms": per(steps["prompt_s"], steps["prompt_steps"], 1e3)}


def key_of(cell: GridCell, p: Params) -> str:
    tag = p.process + (f"{p.burstiness:g}" if p.process == "gamma" else "")
    return (cell.key.replace(f"__{cell.task.name}", "", 1)
            + f"__{tag}_in{p.input_len}_out{p.output_len}_n{p.num_prompts}")


CLIENTS = {"harness": "harness client", "vllm_bench": "vllm bench serve"}


def rate_path(store: CellStore, rate: float, client: str = "harness", round_: int = 1) -> Path:
    """One round of one rate measured by one client (round 1 keeps the name a sweep without repeats writes)."""
    tail = ("" if client == "harness" else f"_{client}") + ("" if round_ == 1 else f"_round{round_}")
    return store.root / f"rate_{rate:g}{tail}.json"


def measurements(p: Params) -> list[tuple[float, int, str]]:
    """(rate, round, client) in the order they run: per rate, its rounds, each round every client in turn, so a
    drift of the shared host lands on both clients alike and the repeats show how much one client's figures move."""
    return [(r, k, c) for r in p.rates for k in range(1, p.repeats + 1) for c in p.clients]


def in_flight(summary: dict, detail: dict) -> tuple[float, float] | None:
    """(first request sent, last response ended) on the monotonic clock both clients time with (perf_counter), or
    None when no request completed."""
    latencies = detail.get("latencies") or summary.get("latencies") or []
    spans = [(s, s + lat) for s, lat, err in zip(detail.get("start_times") or [], latencies,
                                                 detail.get("errors") or [""] * len(latencies))
             if not err and lat and lat > 0]
    return (min(s for s, _ in spans), max(e for _, e in spans)) if spans else None


def request_tpots_ms(detail: dict) -> list[float]:
    """Per completed request of the harness client, (E2EL − TTFT) / (output tokens − 1) in ms."""
    return [1e3 * (lat - ttft) / (n - 1) for lat, ttft, n, err in zip(
        detail["latencies"], detail["ttfts"], detail["output_lens"], detail["errors"]) if not err and n and n > 1]


def run_vllm_bench(server: Server, run: Run[Params], rate: float, store: CellStore, round_: int = 1
                   ) -> dict[str, Any]:
    """One rate measured by `vllm bench serve` against `server`; the stored record in the harness client's shape."""
    p = run.params
    record = bench_serve(server.url, server.model, run.workspace.model_dir.resolve(), rate=rate,
                         num_prompts=p.num_prompts, input_len=p.input_len, output_len=p.output_len,
                         burstiness=math.inf if p.process == "constant" else p.burstiness, seed=run.cfg.seed,
                         work_dir=store.root / "vllm_bench", percentiles=p.percentiles,
                         timeout_s=p.max_seconds + 600, max_concurrency=p.max_concurrency,
                         name=None if round_ == 1 else f"vllm_bench_rate_{rate:g}_round{round_}")
    detail = {k: record.pop(k) for k in ("ttfts", "itls", "output_lens", "errors", "tpots_ms", "input_lens",
                                          "start_times", "generated_texts") if k in record}
    return {"summary": record, "detail": detail}


def sweep(run: Run[Params], cell: GridCell, windows: list[list[int]], store: CellStore) -> dict:
    """One system's rows: the measurements not on disk yet taken behind one server started for them all."""
    p, cfg, n = run.params, run.cfg, run.params.num_prompts
    todo = [(r, k, c) for r, k, c in measurements(p) if not rate_path(store, r, c, k).is_file()]
    server, rows = None, []
    try:
        if todo:
            log.info("%s: starting its server for rates %s", cell.system.name, sorted({r for r, _, _ in todo}))
            server = start_server(cell.system, run.workspace.model_dir.resolve(), cfg.model, store.root,
                                  p.startup_timeout_s, p.max_queue)
            for w in windows[n:]:
                asyncio.run(run_load(server.url, server.model, [Prompt(w, len(w))], [0.0], max_tokens=4,
                                     max_seconds=float(p.max_seconds)))
        for rate, round_, client in measurements(p):
            path = rate_path(store, rate, client, round_)
            if (rate, round_, client) in todo:
                assert server is not None
                wait_idle(server)
                steps_before = engine_steps(server)
                with CpuTrace(server.process.pid) as meter:
                    if client == "harness":
                        result = run_rate(server, [Prompt(w, len(w)) for w in windows[:n]], rate, p, cfg.seed)
                    else:
                        result = run_vllm_bench(server, run, rate, store, round_)
                # the server's whole process tree while requests were in flight, from the last snapshot before the
                # first request to the first after the last response: neither a client's start-up (`vllm bench
                # serve` imports for seconds) nor the wait for the first arrival is the server idling under load
                span = in_flight(result["summary"], result["detail"])
                usage = (meter.usage_between(*span) if span else meter.usage if client == "harness"
                         else meter.usage_of_last(result["summary"]["duration"]))
                assert usage is not None
                result["cpu"] = {**usage.as_dict(), "window": "in flight" if span else "client's load"}
                steps_after = engine_steps(server)
                if steps_before and steps_after:
                    result["steps"] = {k: steps_after[k] - steps_before[k] for k in steps_after}
                atomic_write_json(path, result)
                s = result["summary"]
                log.info("rate %g round %d, %s, %s: %d/%d completed, mean TTFT %.1f ms, mean TPOT %.1f ms", rate,
                         round_, cell.system.name, CLIENTS[client], s["completed"], n, s["mean_ttft_ms"],
                         s["mean_tpot_ms"])
                if round_ == p.repeats and client == p.clients[-1]:
                    run.advance(1)
            stored = json.loads(path.read_text())
            detail = stored.get("detail") or {}
            tpots = detail.get("tpots_ms") if client != "harness" else request_tpots_ms(detail) if detail else []
            rows.append({"system": cell.system.name, "client": CLIENTS[client], "request_rate": rate,
                         "round": round_, "burstiness": p.burstiness, "num_prompts": n, "input_len": p.input_len,
                         "output_len": p.output_len, "request_tpots_ms": tpots, **_with_cpu(stored)})
    finally:
        if server is not None:
            server.close()
    return {"system": cell.system.name, "rates": p.rates, "repeats": p.repeats, "rows": rows}

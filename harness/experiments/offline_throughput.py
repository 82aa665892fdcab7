"""Offline throughput: one fixed request set (essay text, fixed lengths, EOS ignored) through each system.

Definitions follow `vllm bench throughput`: only `generate()` is timed (one short warm-up call per system first,
excluded), token counts come from the returned ids, and total tok/s = (prompt + output tokens) / elapsed, output
tok/s = output tokens / elapsed, req/s = N / elapsed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig

from harness.accuracy_cells import Workspace
from harness.integrations.assets import essay_files
from harness.measuring.cpu_usage import CpuMeter
from harness.reporting import plots
from harness.reporting.summary import Summary, cell_envs, print_paths
from harness.running import params as params_lib
from harness.running.cells import cell_config, run_cell, stored_metrics
from harness.running.params import GridParams
from harness.running.progress import RunProgress
from harness.running.runner import GridCell
from systems.base import GenerationRequest


@dataclass
class Params(GridParams):
    num_requests: int = 16
    input_len: int = 4000
    output_lens: list[int] = field(default_factory=lambda: [256])
    seed: int = 0
    warmup: bool = True
    reference: Optional[str] = "vllm"         # ratios are to this system


def build_requests(tokenizer, num: int, input_len: int, output_len: int, seed: int) -> list[GenerationRequest]:
    """`num` distinct windows of essay tokens (no shared prefixes, so no system gains from prefix caching)."""
    text = "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in essay_files())
    ids = tokenizer.encode(text, add_special_tokens=False)
    need = input_len + num * 997
    while len(ids) < need:
        ids = ids + ids
    stride = max(1, (len(ids) - input_len) // max(1, num))
    start0 = (seed * 7919) % stride
    return [GenerationRequest(request_id=f"r{i}", prompt_token_ids=ids[start0 + i * stride:][:input_len],
                              max_new_tokens=output_len, ignore_eos=True, seed=seed) for i in range(num)]


def measure(system, requests: list[GenerationRequest], exclude: frozenset[int] = frozenset()) -> dict[str, Any]:
    """Time one generate() call; the CPU columns count this process and its children (vLLM's engine core) except
    the process subtrees in `exclude`."""
    system.reset_stats()
    with CpuMeter(exclude=exclude) as meter:
        t0 = time.perf_counter()
        completions = system.generate(requests)
        wall = time.perf_counter() - t0
    prompt = sum(c.prompt_tokens for c in completions)
    output = sum(len(c.token_ids) for c in completions)
    mem = system.memory_report()
    ttfts = [c.ttft for c in completions if c.ttft is not None]
    return {"wall_s": wall, "num_requests": len(completions), "prompt_tokens": prompt, "output_tokens": output,
            "total_tok_s": (prompt + output) / wall, "output_tok_s": output / wall, "req_s": len(completions) / wall,
            "device_kv_peak_bytes": mem.device_kv_peak_bytes,
            "device_kv_peak_bytes_per_request": (mem.device_kv_peak_bytes or 0) / max(1, len(completions)),
            "mean_ttft_s": sum(ttfts) / len(ttfts) if ttfts else None, "memory": mem.as_dict(), "mode": mem.mode,
            **cpu_columns(meter.usage)}


def cpu_columns(usage) -> dict[str, Any]:
    return {"cores_busy": usage.cores_busy, "cpu_s": usage.cpu_s, "busy_threads": usage.busy_threads,
            "cpus_allowed": usage.cpus_allowed} if usage else {}


def jobs(cfg: DictConfig, cells: list[GridCell], p: Params) -> list[tuple[GridCell, int, str]]:
    """(system cell, output length, cell key): throughput has no task, one cell per system and output length."""
    systems = list({c.system.name: c for c in cells}.values())
    return [(c, out, f"{c.system.name}__in{p.input_len}_out{out}_n{p.num_requests}")
            for c in systems for out in p.output_lens]


def run(cfg: DictConfig, cells: list[GridCell], out_dir: Path) -> Any:
    p = params_lib.parse(cfg, Params)
    ws = Workspace(cfg)
    todo, results = jobs(cfg, cells, p), []
    for cell, out_len, _ in todo:
        ws.check_fits(cell.system, p.input_len, out_len)
    progress = RunProgress(len(todo), len(todo) * p.num_requests, enabled=cfg.progress)
    try:
        for cell, out_len, key in todo:
            def work(store, cell=cell, out_len=out_len) -> dict:
                reqs = build_requests(ws.tokenizer, p.num_requests, p.input_len, out_len, p.seed)
                system = ws.system(cell.system)
                if p.warmup:
                    system.generate([GenerationRequest("warmup", reqs[0].prompt_token_ids[:64], 4, ignore_eos=True)])
                return {"system": cell.system.name, "input_len": p.input_len, "output_len": out_len,
                        **measure(system, reqs)}
            results.append(run_cell(cfg, key, cell_config(cfg, system=cell.system, output_len=out_len), out_dir,
                                    work, progress, f"{cell.system.name} × {p.num_requests} × ({p.input_len} + "
                                    f"{out_len})", p.num_requests))
    finally:
        progress.close()
        ws.close()
    summarize(cfg, cells, out_dir)
    return results


def summarize(cfg: DictConfig, cells: list[GridCell], out_dir: Path, same_code: bool = True) -> dict[str, str]:
    p = params_lib.parse(cfg, Params)
    results = [m for _, _, key in jobs(cfg, cells, p) if (m := stored_metrics(out_dir, key))]
    paths = write_summary(cfg, p, results, out_dir)
    print_paths(paths)
    return paths


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


def write_summary(cfg, p: Params, results: list[dict], out_dir: Path) -> dict[str, str]:
    ref = p.reference if p.reference in {r["system"] for r in results} else (results[0]["system"] if results else "")
    summary = Summary(cfg, envs=cell_envs(results))
    summary.glance(f"tokens/s of each system on the same requests, ratios to `{ref}`:", ratio_lines(results, ref))
    summary.table(["system", "in", "out", "requests", "total tok/s", "output tok/s", "req/s", "wall s",
                   "device KV peak MiB", "mode", "cores busy", "busy threads", "CPUs", "tok per CPU-s"],
                  [[r["system"], r["input_len"], r["output_len"], r["num_requests"], r["total_tok_s"],
                    r["output_tok_s"], r["req_s"], r["wall_s"], (r["device_kv_peak_bytes"] or 0) / 2**20, r["mode"],
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
                                        "device_kv_peak_bytes_per_request", "mode", "cores_busy", "cpu_s",
                                        "busy_threads", "cpus_allowed")} for r in results])
    if len({r["output_len"] for r in results}) > 1:
        summary.image("png", plots.line_plot(
            out_dir / "throughput_vs_output_len.png",
            {s: [(r["output_len"], r["output_tok_s"]) for r in results if r["system"] == s]
             for s in dict.fromkeys(r["system"] for r in results)},
            "output length (tokens)", "output throughput (tokens/s)", "Offline throughput vs output length"))
    summary.took(sum(r.get("wall_s", 0) for r in results), "timed generate() calls")
    return summary.write(out_dir)

"""Offline throughput: one fixed request set (essay text, fixed lengths, EOS ignored) through each system.

Definitions follow `vllm bench throughput` (shared/reference/serving.md §4): only `generate()` is timed (one
short warm-up call per system first, excluded), token counts come from the returned ids, and
total tok/s = (prompt + output tokens) / elapsed, output tok/s = output tokens / elapsed, req/s = N / elapsed.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from harness import report
from harness.envinfo import env_record
from harness.experiments.accuracy import Workspace
from harness.runner import Cell, dump_yaml
from harness.store import Cell as StoreCell
from systems.base import GenerationRequest
from harness.assets import essay_files

DEFAULTS = {"num_requests": 16, "input_len": 4000, "output_lens": [256], "seed": 0, "warmup": True}
CSV_COLUMNS = ["system", "total_tok_s", "output_tok_s", "req_s", "wall_s", "device_kv_peak_bytes"]


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


def measure(system, requests: list[GenerationRequest]) -> dict[str, Any]:
    system.reset_stats()
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
            "mean_ttft_s": sum(ttfts) / len(ttfts) if ttfts else None, "memory": mem.as_dict(),
            "mode": mem.mode}


def run(cfg: DictConfig, cells: list[Cell], out_dir: Path) -> Any:
    params = {**DEFAULTS, **dict(cfg.exp.params)}
    systems, seen = [], set()
    for c in cells:  # throughput has no task: one cell per distinct system
        if c.system.name not in seen:
            seen.add(c.system.name)
            systems.append(c)
    ws = Workspace(cfg)
    results = []
    try:
        for cell in systems:
            for out_len in params["output_lens"]:
                key = f"{cell.system.name}__in{params['input_len']}_out{out_len}_n{params['num_requests']}"
                store = StoreCell(out_dir / key)
                if store.is_complete():
                    print(f"[skip] {key}: complete on disk")
                    results.append(store.metrics())
                    continue
                store.open(dump_yaml(cell.resolved(cfg)), env_record(cfg.seed))
                reqs = build_requests(ws.tokenizer, params["num_requests"], params["input_len"], out_len,
                                      params["seed"])
                print(f"[run] {key}: {len(reqs)} requests × ({params['input_len']} in + {out_len} out)", flush=True)
                system = ws.system(cell.system)
                if params["warmup"]:
                    system.generate([GenerationRequest("warmup", reqs[0].prompt_token_ids[:64], 4, ignore_eos=True)])
                m = {"system": cell.system.name, "input_len": params["input_len"], "output_len": out_len,
                     **measure(system, reqs)}
                store.write_metrics(m)
                print(f"      {m['output_tok_s']:.1f} output tok/s, {m['total_tok_s']:.1f} total tok/s, "
                      f"{m['wall_s']:.1f} s", flush=True)
                results.append(m)
    finally:
        ws.close()
    paths = write_summary(cfg, results, out_dir)
    print(Path(paths["md"]).read_text())
    for kind, path in paths.items():
        print(f"[{kind}] {path}")
    return results


def ratio_lines(results: list[dict], reference: str) -> list[str]:
    lines = []
    for out_len in sorted({r["output_len"] for r in results}):
        rows = {r["system"]: r for r in results if r["output_len"] == out_len}
        ref = rows.get(reference)
        if not ref:
            continue
        for name, r in rows.items():
            if name != reference:
                lines.append(f"- output {out_len}: **{name} ÷ {reference} = {r['total_tok_s'] / ref['total_tok_s']:.2f}×** "
                             f"total tok/s ({r['total_tok_s']:.1f} vs {ref['total_tok_s']:.1f})")
    return lines


def write_summary(cfg, results: list[dict], out_dir: Path) -> dict[str, str]:
    ref = cfg.exp.params.get("reference", "vllm")
    if ref not in {r["system"] for r in results}:
        ref = results[0]["system"] if results else ref
    table = [[r["system"], r["input_len"], r["output_len"], r["num_requests"], r["total_tok_s"], r["output_tok_s"],
              r["req_s"], r["wall_s"], (r["device_kv_peak_bytes"] or 0) / 2**20, r["mode"]] for r in results]
    parts = [f"# {cfg.exp.name}", "",
             f"**At a glance:** tokens/s of each system on the same requests, ratios to `{ref}`:", "",
             *ratio_lines(results, ref), "",
             report.md_table(["system", "in", "out", "requests", "total tok/s", "output tok/s", "req/s", "wall s",
                              "device KV peak MiB", "mode"], table, 2), "",
             "Only `generate()` is timed (after one short warm-up call); EOS is ignored so every request produces "
             "exactly its output length; device KV peak is the block manager's peak for the engine, the padded "
             "cache for hf, and peak KV usage × block bytes for vLLM.", "",
             f"Regenerate: `{report.command_line(cfg)}`.", "", report.provenance(cfg), ""]
    rows = [{**{k: r.get(k) for k in CSV_COLUMNS}, "input_len": r["input_len"], "output_len": r["output_len"],
             "num_requests": r["num_requests"], "mode": r["mode"],
             "device_kv_peak_bytes_per_request": r.get("device_kv_peak_bytes_per_request")} for r in results]
    out_dir.mkdir(parents=True, exist_ok=True)
    md, csv_path = out_dir / "summary.md", out_dir / "summary.csv"
    report.atomic_write_text(md, "\n".join(parts))
    report.atomic_write_text(csv_path, report.to_csv(rows))
    paths = {"md": str(md), "csv": str(csv_path)}
    if len({r["output_len"] for r in results}) > 1:
        paths["png"] = plot(results, out_dir / "throughput_vs_output_len.png")
    return paths


def plot(results: list[dict], path: Path) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r["system"] for r in results):
        pts = sorted((r["output_len"], r["output_tok_s"]) for r in results if r["system"] == name)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xlabel("output length (tokens)")
    ax.set_ylabel("output throughput (tokens/s)")
    ax.set_title("Offline throughput vs output length")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)

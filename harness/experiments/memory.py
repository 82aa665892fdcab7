"""Device-tier KV per request vs sequence length against the analytic count (FlexiCache F9; CAKE F7 peak + latency).

Also CAKE's peak device KV during prefill and decode latency vs length, cascading or not (CAKE F7).

One request at a time (essay text, EOS ignored, so every request holds exactly prompt + output - 1 tokens of KV
when it finishes) through each engine system at each prompt length. Measured, per request: the device blocks it
holds when it finishes (the policy's kv_stats, read just before the blocks are freed), the block manager's peak over
the request (for CAKE the prefill peak: decoding holds a constant cache), the MinMax bytes, host-tier bytes and
tier traffic, TTFT and the mean decode time per token (TPOT).

Analytic device KV (T tokens held, P tokens per page, b = bytes of one page of one KV head, K and V):
- dense, quest: L · Hkv · ceil(T / P) · b (Quest saves reads, not memory);
- flexicache: (unstable heads · ceil(T / P) + stable heads · min(ceil(T / P), K + 1)) · b, MinMax on top;
- lserve: (retrieval heads · ceil(T / P) + streaming heads · min(ceil(T / P), sink / P + local / P + 1)) · b;
- eviction policies: L · Hkv · ceil(C / P) · b with C = min(T, budget) for policies that evict while decoding and
  C = min(n, budget) + output - 1 for prefill-only ones (no after_append hook, or CAKE with decode_evict off).
  Non-uniform per-layer budgets (PyramidKV, CAKE) round up once per layer: the check allows one page per
  (layer, KV head) above the count.
CAKE's prefill peak bound: with cascading the seen layers hold at most their budgets plus one whole layer
(systems.policies.allocation.cascading_blocks_bound); without it the whole prompt is held, L · Hkv · ceil(n / P) · b.
"""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from harness import plots, report
from harness.envinfo import env_record
from harness.experiments.accuracy import Workspace
from harness.experiments.offline_throughput import build_requests
from harness.runner import Cell, UserError, dump_yaml
from harness.store import Cell as StoreCell
from systems.policies import allocation
from systems.policies.base import Policy

DEFAULTS = {"lengths": [1000, 2000, 4000], "output_len": 16, "seed": 0, "warmup": True}
MIB = 2 ** 20


def _pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def analytic(policy: Policy, spec: dict, n: int, out: int) -> dict[str, float]:
    """Expected device bytes of one request with prompt n and `out` output tokens under `policy` (see docstring)."""
    L, H, P, b = spec["layers"], spec["kv_heads"], spec["page_size"], spec["bytes_per_block"]
    T = n + out - 1
    minmax = L * H * _pages(T, P) * spec["minmax_bytes_per_page"]
    res = {"tokens_held": T, "analytic_minmax_bytes": minmax, "dense_token_bytes": L * H * T * b / P,
           "analytic_tolerance_bytes": 0}
    name = policy.name
    if name in ("dense", "quest"):
        res["analytic_device_kv_bytes"] = L * H * _pages(T, P) * b
    elif name == "flexicache":
        n_u = int(policy.unstable.sum())
        n_s = L * H - n_u
        res["analytic_device_kv_bytes"] = (n_u * _pages(T, P) + n_s * min(_pages(T, P), policy.top_k + 1)) * b
        res["analytic_tolerance_bytes"] = L * H * b                  # issue 4: within one page per head
    elif name == "lserve":
        n_s = int(policy.streaming.sum())
        window = policy.sink_tokens // P + policy.local_tokens // P + 1      # sink pages + local pages + partial
        res["analytic_device_kv_bytes"] = ((L * H - n_s) * _pages(T, P) + n_s * min(_pages(T, P), window)) * b
        res["analytic_tolerance_bytes"] = L * H * b
    elif hasattr(policy, "budget"):
        prefill_only = (type(policy).after_append is Policy.after_append) or not getattr(policy, "decode_evict", True)
        C = min(n, policy.budget) + out - 1 if prefill_only else min(T, policy.budget)
        res["analytic_device_kv_bytes"] = L * H * _pages(C, P) * b
        res["analytic_tolerance_bytes"] = L * H * b
    else:
        res["analytic_device_kv_bytes"] = math.nan       # no closed form for this policy
    if name == "cake":
        if policy.cascading and policy.compresses(n):
            blocks = allocation.cascading_blocks_bound(n, policy.total, policy.window, L, P, H)
        else:
            blocks = L * H * _pages(n, P)
        res["analytic_prefill_peak_bytes"] = blocks * b
    return res


def model_spec(system) -> dict:
    kv = system.engine.kv
    return {"layers": kv.num_layers, "kv_heads": kv.num_kv_heads, "head_dim": kv.head_dim, "page_size": kv.page_size,
            "bytes_per_block": kv.bytes_per_block, "minmax_bytes_per_page": kv.minmax_bytes_per_page}


def measure_one(system, request) -> dict[str, Any]:
    system.reset_stats()
    (c,) = system.generate([request])
    mem = system.memory_report()
    spec = model_spec(system)
    stats = c.kv_stats or {}
    return {"prompt_tokens": c.prompt_tokens, "output_tokens": c.output_tokens,
            "device_kv_final_bytes": stats.get("device_pages", 0) * spec["bytes_per_block"],
            "device_kv_peak_bytes": mem.device_kv_peak_bytes, "host_kv_peak_bytes": mem.host_kv_peak_bytes,
            "minmax_peak_bytes": mem.extra.get("minmax_peak_bytes"), "bytes_host_to_device": mem.bytes_host_to_device,
            "bytes_device_to_host": mem.bytes_device_to_host, "ttft_s": c.ttft, "tpot_s": c.tpot, "mode": mem.mode,
            "kept_tokens_mean": _mean_nested(stats.get("kept_tokens")), **spec}


def _mean_nested(x) -> float | None:
    flat = [v for row in x for v in row] if x else []
    return sum(flat) / len(flat) if flat else None


def run(cfg: DictConfig, cells: list[Cell], out_dir: Path) -> Any:
    p = {**DEFAULTS, **OmegaConf.to_container(cfg.exp.params, resolve=True)}
    systems = list({c.system.name: c for c in cells}.values())       # memory has no task: one cell per system
    bad = [c.system.name for c in systems if c.system.backend != "engine"]
    if bad:
        raise UserError(f"the memory experiment measures the engine's tiers; remove non-engine systems {bad} from "
                        f"exp.systems")
    if not p["lengths"] or min(p["lengths"]) <= 0 or p["output_len"] < 2:
        raise UserError("exp.params.lengths must be positive prompt lengths and exp.params.output_len >= 2")
    if max(p["lengths"]) + p["output_len"] > cfg.model.max_model_len:
        raise UserError(f"the longest request ({max(p['lengths'])} + {p['output_len']} tokens) exceeds "
                        f"model.max_model_len={cfg.model.max_model_len}; shorten exp.params.lengths")
    ws = Workspace(cfg)
    results = []
    try:
        # one essay window, tokenized once, cut to each length: every system sees the same prompts
        (longest,) = build_requests(ws.tokenizer, 1, max(p["lengths"]), int(p["output_len"]), p["seed"])
        for cell in systems:
            for n in p["lengths"]:
                store = StoreCell(out_dir / f"{cell.key}__len{n}_out{p['output_len']}")
                if store.is_complete():
                    print(f"[skip] {cell.system.name} len {n}: complete on disk")
                    results.append(store.metrics())
                    continue
                store.open(dump_yaml(cell.resolved(cfg)), env_record(cfg.seed))
                system = ws.system(cell.system)
                if p["warmup"]:
                    system.generate([replace(longest, request_id="warmup", max_new_tokens=2,
                                             prompt_token_ids=longest.prompt_token_ids[:64])])
                req = replace(longest, request_id=f"len{n}", prompt_token_ids=longest.prompt_token_ids[:int(n)])
                m = {"system": cell.system.name, "policy": cell.system.policy, "length": int(n),
                     **measure_one(system, req),
                     **analytic(system.engine.policy, model_spec(system), int(n), int(p["output_len"]))}
                store.write_metrics(m)
                print(f"[run] {cell.system.name} len {n}: device KV {m['device_kv_final_bytes'] / MIB:.2f} MiB "
                      f"(analytic {m['analytic_device_kv_bytes'] / MIB:.2f}), "
                      f"peak {m['device_kv_peak_bytes'] / MIB:.2f} MiB, TPOT {1000 * (m['tpot_s'] or 0):.1f} ms",
                      flush=True)
                results.append(m)
    finally:
        ws.close()
    paths = write_summary(cfg, results, p, out_dir)
    print(Path(paths["md"]).read_text())
    for kind, path in paths.items():
        print(f"[{kind}] {path}")
    return results


def within_bound(r: dict) -> bool | None:
    bound = r.get("analytic_device_kv_bytes")
    if bound is None or math.isnan(bound):
        return None
    return abs(r["device_kv_final_bytes"] - bound) <= r["analytic_tolerance_bytes"]


def write_summary(cfg, results: list[dict], p: dict, out_dir: Path) -> dict[str, str]:
    systems = list(dict.fromkeys(r["system"] for r in results))
    longest = max(r["length"] for r in results)
    at_long = {r["system"]: r for r in results if r["length"] == longest}
    dense = next((r for r in at_long.values() if r["policy"] == "dense"), None)
    glance = f"**At a glance:** device KV per request at {longest}-token prompts: " + ", ".join(
        f"{s} {at_long[s]['device_kv_final_bytes'] / MIB:.2f} MiB"
        + (f" ({at_long[s]['device_kv_final_bytes'] / dense['device_kv_final_bytes']:.2f}× dense)" if dense else "")
        for s in systems if s in at_long) + "."
    ok = [within_bound(r) for r in results]
    checked = [x for x in ok if x is not None]
    glance += f" Measured = analytic count in {sum(checked)} of {len(checked)} (system, length) points."
    table = [[r["system"], r["length"], r["output_tokens"], r["device_kv_final_bytes"] / MIB,
              r["analytic_device_kv_bytes"] / MIB, {True: "yes", False: "NO", None: "—"}[o],
              r["device_kv_peak_bytes"] / MIB, (r["minmax_peak_bytes"] or 0) / MIB,
              (r["host_kv_peak_bytes"] or 0) / MIB,
              r["bytes_host_to_device"] / MIB, 1000 * (r["ttft_s"] or math.nan), 1000 * (r["tpot_s"] or math.nan),
              r["mode"]] for r, o in zip(results, ok)]
    header = ["system", "prompt", "out", "device KV MiB", "analytic MiB", "matches", "peak MiB", "MinMax MiB",
              "host MiB", "H2D MiB", "TTFT ms", "TPOT ms", "mode"]
    parts = [f"# {cfg.exp.name}", "", glance, "", report.md_table(header, table, 2), "",
             "device KV = blocks the request holds when it finishes (one page of one KV head = "
             f"{results[0]['bytes_per_block']} B); peak = the block manager's peak over the request (prefill "
             "included); MinMax = per-page key bounds kept on the device for every page (FlexiCache's F9 count adds "
             "them); matches = measured equals the analytic count (eviction policies: within one page per layer "
             "and KV head for FlexiCache and eviction policies, exact for dense and Quest).", ""]
    cake = [r for r in results if r["policy"] == "cake" or r["policy"] == "dense"]
    if any(r["policy"] == "cake" for r in cake):
        rows = [[r["system"], r["length"], r["device_kv_peak_bytes"] / MIB,
                 r.get("analytic_prefill_peak_bytes", r["analytic_device_kv_bytes"]) / MIB,
                 1000 * (r["tpot_s"] or math.nan)] for r in cake]
        parts += ["## CAKE: peak device KV during prefill and decode latency (CAKE F7)", "",
                  report.md_table(["system", "prompt", "peak MiB", "analytic peak MiB", "TPOT ms"], rows, 2), ""]
    parts += [f"Regenerate: `{report.command_line(cfg)}`.", "", report.provenance(cfg), ""]
    out_dir.mkdir(parents=True, exist_ok=True)
    md, csv_path = out_dir / "summary.md", out_dir / "summary.csv"
    report.atomic_write_text(md, "\n".join(parts))
    report.atomic_write_text(csv_path, report.to_csv([{**r, "matches_analytic": o} for r, o in zip(results, ok)]))
    series = lambda key, rs, scale=MIB: {s: [(r["tokens_held"], r[key] / scale) for r in rs if r["system"] == s]  # noqa
                                         for s in dict.fromkeys(r["system"] for r in rs)}
    paths = {"md": str(md), "csv": str(csv_path)}
    paths["png_memory"] = plots.line_plot(
        out_dir / "device_kv_vs_length.png", series("device_kv_final_bytes", results),
        dashed=series("analytic_device_kv_bytes", results), xlabel="sequence length (tokens held)",
        ylabel="device-tier KV per request (MiB, log scale)", title="Device KV vs sequence length", logy=True)
    if any(r["policy"] == "cake" for r in cake):
        bounds = {s: [(r["length"], r.get("analytic_prefill_peak_bytes", r["analytic_device_kv_bytes"]) / MIB)
                      for r in cake if r["system"] == s] for s in dict.fromkeys(r["system"] for r in cake)}
        paths["png_cake_peak"] = plots.line_plot(
            out_dir / "cake_prefill_peak.png", {s: [(r["length"], r["device_kv_peak_bytes"] / MIB) for r in cake
                                                     if r["system"] == s] for s in bounds}, dashed=bounds,
            xlabel="prompt length (tokens)", ylabel="peak device KV per request (MiB)",
            title="CAKE peak device KV during prefill, cascading vs not")
        paths["png_cake_latency"] = plots.line_plot(
            out_dir / "cake_decode_latency.png", {s: [(r["length"], 1000 * (r["tpot_s"] or math.nan)) for r in cake
                                                       if r["system"] == s] for s in bounds},
            xlabel="prompt length (tokens)", ylabel="decode time per output token (ms)",
            title="CAKE decode latency vs length")
    return paths

"""Device-tier KV per request vs sequence length against each policy's analytic count (FlexiCache F9; CAKE F7).

One request at a time (essay text, EOS ignored, so every request holds exactly prompt + output - 1 tokens of KV
when it finishes) through each engine system at each prompt length. Measured per request: the device blocks it
holds when it finishes (the policy's kv_stats, read just before the blocks are freed), the block manager's peak over
the request (for CAKE the prefill peak: decoding holds a constant cache), the MinMax bytes, host-tier bytes and
tier traffic, TTFT and the mean decode time per token (TPOT).

The analytic count is the policy's own answer (Policy.expected_device_blocks, with expected_blocks_slack for
per-layer rounding; prefill_peak_blocks where prefill holds more than the result, CAKE's cascading bound): the
harness knows no policy by name, so a new policy is checked by its own rule. On a hybrid model (sliding-window and
full-attention layers) both counts are also split by layer type: the windowed layers keep only their window's pages.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from harness.measuring.offline import build_requests
from harness.reporting import plots
from harness.reporting.summary import cell_envs
from harness.running.cells import cell_config
from harness.running.config import UserError
from harness.running.experiment import Cell, Experiment, Run
from harness.running.params import GridParams
from harness.running.store import CellStore
from systems.base import GenerationRequest
from systems.policies.base import Policy
from systems.registry import backend_of

MIB = 2 ** 20


@dataclass
class Params(GridParams):
    lengths: list[int] = field(default_factory=lambda: [1000, 2000, 4000])    # prompt tokens
    output_len: int = 16                     # EOS ignored: each request holds prompt + output - 1 tokens at the end
    seed: int = 0
    warmup: bool = True
    reference: Optional[str] = None          # the glance states each system's KV as a multiple of this system's


def analytic(policy: Policy, spec: dict, n: int, out: int) -> dict[str, float | None]:
    """What the policy says one request with prompt n and `out` output tokens holds on the device tier."""
    b, T = spec["bytes_per_block"], n + out - 1
    pages = -(-T // spec["page_size"])
    blocks, peak = policy.expected_device_blocks(n, out), policy.prefill_peak_blocks(n)
    windowed = policy.window_blocks(T)          # the layers the policy leaves to their window
    split = {} if not policy.left_windows else {
        "analytic_windowed_kv_bytes": windowed * b,
        "analytic_full_kv_bytes": math.nan if blocks is None else (blocks - windowed) * b}
    return {**split, "tokens_held": T, "analytic_minmax_bytes": spec["layers"] * spec["kv_heads"] * pages
            * spec["minmax_bytes_per_page"], "dense_token_bytes": spec["layers"] * spec["kv_heads"] * T * b
            / spec["page_size"], "analytic_device_kv_bytes": math.nan if blocks is None else blocks * b,
            "analytic_tolerance_bytes": policy.expected_blocks_slack() * b,
            "analytic_prefill_peak_bytes": None if peak is None else peak * b}


def model_spec(system: Any) -> dict:
    kv = system.engine.kv
    return {"layers": kv.num_layers, "kv_heads": kv.num_kv_heads, "head_dim": kv.head_dim, "page_size": kv.page_size,
            "bytes_per_block": kv.bytes_per_block, "minmax_bytes_per_page": kv.minmax_bytes_per_page}


def measure_one(system: Any, request: GenerationRequest) -> dict[str, Any]:
    system.reset_stats()
    (c,) = system.generate([request])
    mem, spec, stats = system.memory_report(), model_spec(system), c.kv_stats or {}
    kept = [v for row in stats.get("kept_tokens") or [] for v in row]
    split = {} if "device_pages_windowed" not in stats else {      # a hybrid model: per layer type
        "device_kv_windowed_bytes": stats["device_pages_windowed"] * spec["bytes_per_block"],
        "device_kv_full_bytes": stats["device_pages_full"] * spec["bytes_per_block"]}
    return {**split, "prompt_tokens": c.prompt_tokens, "output_tokens": c.output_tokens,
            "device_kv_final_bytes": stats.get("device_pages", 0) * spec["bytes_per_block"],
            "device_kv_peak_bytes": mem.device_kv_peak_bytes, "host_kv_peak_bytes": mem.host_kv_peak_bytes,
            "minmax_peak_bytes": mem.extra.get("minmax_peak_bytes"), "bytes_host_to_device": mem.bytes_host_to_device,
            "bytes_device_to_host": mem.bytes_device_to_host, "ttft_s": c.ttft, "tpot_s": c.tpot, "mode": mem.mode,
            "kept_tokens_mean": sum(kept) / len(kept) if kept else None, **spec}


class Memory(Experiment[Params]):
    params_type = Params

    def check(self, run: Run[Params]) -> None:
        p, cfg = run.params, run.cfg
        bad = sorted({c.system.name for c in run.grid if not backend_of(c.system).runs_policies})
        if bad:
            raise UserError(f"the memory experiment measures a KV policy's tiers; remove {bad} (systems whose "
                            "backend runs no KV policy) from exp.systems")
        if not p.lengths or min(p.lengths) <= 0 or p.output_len < 2:
            raise UserError("exp.params.lengths must be positive prompt lengths and exp.params.output_len >= 2")
        if max(p.lengths) + p.output_len > cfg.model.max_model_len:
            raise UserError(f"the longest request ({max(p.lengths)} + {p.output_len} tokens) exceeds "
                            f"model.max_model_len={cfg.model.max_model_len}; shorten exp.params.lengths")

    def cells(self, run: Run[Params]) -> list[Cell]:
        """One cell per system and prompt length (memory has no task)."""
        p = run.params
        systems = list({c.system.name: c for c in run.grid}.values())
        return [Cell(key=f"{c.key}__len{n}_out{p.output_len}", config=cell_config(run.cfg, system=c.system, length=n),
                     label=f"{c.system.name} × {n} tokens", system=c.system, policy=c.policy,
                     fits=(int(n), p.output_len), item=int(n)) for c in systems for n in p.lengths]

    def run_cell(self, run: Run[Params], cell: Cell, store: CellStore) -> dict:
        p, ws, n = run.params, run.workspace, cell.item
        # one essay window, tokenized once, cut to each length: every system sees the same prompts
        (longest,) = ws.memo("memory:longest", lambda: build_requests(ws.tokenizer, 1, max(p.lengths), p.output_len,
                                                                      p.seed))
        assert cell.system is not None
        system = ws.system(cell.system, cell.policy)
        if p.warmup:
            system.generate([replace(longest, request_id="warmup", max_new_tokens=2,
                                     prompt_token_ids=longest.prompt_token_ids[:64])])
        req = replace(longest, request_id=f"len{n}", prompt_token_ids=longest.prompt_token_ids[:n])
        policy: Policy = system.engine.policy       # type: ignore[attr-defined]  # a backend that runs policies
        return {"system": cell.system.name, "policy": cell.system.policy, "length": n,
                **measure_one(system, req), **analytic(policy, model_spec(system), n, p.output_len)}

    def report(self, run: Run[Params], cells: list[Cell]) -> dict[str, str]:
        return write_summary(run, [m for c in cells if (m := run.stored(c.key))])


def within_bound(r: dict) -> bool | None:
    bound = r.get("analytic_device_kv_bytes")
    if bound is None or math.isnan(bound):
        return None
    return abs(r["device_kv_final_bytes"] - bound) <= r["analytic_tolerance_bytes"]


Points = dict[str, list[tuple[float, float]]]


def merged(measured: Points, analytic: Points) -> tuple[Points, Points]:
    """Systems whose measured points are equal drawn as one line labelled with all their names (`a = b`), so a
    line hidden under another (dense under Quest, seven eviction policies at one budget) is named, not lost; their
    analytic counts follow the line's label (the first one of each group that has them)."""
    groups: dict[tuple, list[str]] = {}
    for system, pts in measured.items():
        groups.setdefault(tuple(sorted((x, round(y, 6)) for x, y in pts)), []).append(system)
    lines: Points = {}
    bounds: Points = {}
    for names in groups.values():
        label = " = ".join(names)
        lines[label] = measured[names[0]]
        known = [analytic[s] for s in names if any(math.isfinite(y) for _, y in analytic.get(s, []))]
        if known:
            bounds[label] = known[0]
    return lines, bounds


def write_summary(run: Run[Params], results: list[dict]) -> dict[str, str]:
    p, out_dir = run.params, run.out_dir
    systems = list(dict.fromkeys(r["system"] for r in results))
    longest = max(r["length"] for r in results)
    at_long = {r["system"]: r for r in results if r["length"] == longest}
    dense = at_long.get(p.reference) if p.reference else None
    ok = [within_bound(r) for r in results]
    checked = [x for x in ok if x is not None]
    summary = run.summary(envs=cell_envs(results))
    summary.glance(f"device KV per request at {longest}-token prompts: " + ", ".join(
        f"{s} {at_long[s]['device_kv_final_bytes'] / MIB:.2f} MiB"
        + (f" ({at_long[s]['device_kv_final_bytes'] / dense['device_kv_final_bytes']:.2f}× dense)" if dense else "")
        for s in systems if s in at_long) + f". Measured = the policy's analytic count in {sum(checked)} of "
        f"{len(checked)} (system, length) points.")
    summary.table(["system", "prompt", "out", "device KV MiB", "analytic MiB", "matches", "peak MiB", "MinMax MiB",
                   "host MiB", "H2D MiB", "TTFT ms", "TPOT ms", "mode"],
                  [[r["system"], r["length"], r["output_tokens"], r["device_kv_final_bytes"] / MIB,
                    r["analytic_device_kv_bytes"] / MIB, {True: "yes", False: "NO", None: "—"}[o],
                    r["device_kv_peak_bytes"] / MIB, (r["minmax_peak_bytes"] or 0) / MIB,
                    (r["host_kv_peak_bytes"] or 0) / MIB, r["bytes_host_to_device"] / MIB,
                    1000 * (r["ttft_s"] or math.nan), 1000 * (r["tpot_s"] or math.nan), r["mode"]]
                   for r, o in zip(results, ok)], 2)
    summary.text(f"device KV = blocks the request holds when it finishes (one page of one KV head = "
                 f"{results[0]['bytes_per_block']} B); peak = the block manager's peak over the request (prefill "
                 "included); MinMax = per-page key bounds kept on the device for every page (FlexiCache's F9 count "
                 "adds them); matches = measured equals the policy's analytic count within its stated slack (per-"
                 "layer rounding: one page per layer and KV head).")
    peaks = [r for r in results
             if r.get("analytic_prefill_peak_bytes") is not None or r["system"] == p.reference]
    if any(r.get("analytic_prefill_peak_bytes") is not None for r in peaks):
        summary.section("Peak device KV during prefill and decode latency (CAKE F7)").table(
            ["system", "prompt", "peak MiB", "analytic peak MiB", "TPOT ms"],
            [[r["system"], r["length"], r["device_kv_peak_bytes"] / MIB,
              (r.get("analytic_prefill_peak_bytes") or r["analytic_device_kv_bytes"]) / MIB,
              1000 * (r["tpot_s"] or math.nan)] for r in peaks], 2)
    hybrid = [r for r in results if "device_kv_windowed_bytes" in r]
    if hybrid:
        summary.section("Device KV by layer type (sliding-window vs full attention)").table(
            ["system", "prompt", "windowed MiB", "analytic windowed MiB", "full MiB", "analytic full MiB"],
            [[r["system"], r["length"], r["device_kv_windowed_bytes"] / MIB,
              r.get("analytic_windowed_kv_bytes", math.nan) / MIB, r["device_kv_full_bytes"] / MIB,
              r.get("analytic_full_kv_bytes", math.nan) / MIB] for r in hybrid], 2)
    summary.csv([{**{k: v for k, v in r.items() if k != "_env"}, "matches_analytic": o} for r, o in zip(results, ok)],
                "memory")

    def series(rs: list[dict], key: str, x: str = "tokens_held") -> dict[str, list[tuple[float, float]]]:
        return {s: [(r[x], (r[key] or math.nan) / MIB) for r in rs if r["system"] == s]
                for s in dict.fromkeys(r["system"] for r in rs)}
    n = "n = 1 request per point (one request's KV is deterministic)"
    measured, analytic_kv = merged(series(results, "device_kv_final_bytes"), series(results,
                                                                                    "analytic_device_kv_bytes"))
    summary.image("png_memory", plots.line_plot(
        out_dir / "device_kv_vs_length.png", measured, dashed=analytic_kv, xlabel="sequence length (tokens held)",
        ylabel="device-tier KV per request (MiB, log scale)",
        title="Device KV vs sequence length (systems with equal values share a line)", logy=True,
        note=summary.figure_note(n)), "device KV vs length")
    if any(r.get("analytic_prefill_peak_bytes") is not None for r in peaks):
        summary.image("png_cake_peak", plots.line_plot(
            out_dir / "cake_prefill_peak.png", series(peaks, "device_kv_peak_bytes", "length"),
            dashed=series(peaks, "analytic_prefill_peak_bytes", "length"), xlabel="prompt length (tokens)",
            ylabel="peak device KV per request (MiB)", title="Peak device KV during prefill", ymin=0.0,
            note=summary.figure_note(n)), "prefill peak")
        summary.image("png_cake_latency", plots.line_plot(
            out_dir / "cake_decode_latency.png",
            {s: [(r["length"], 1000 * (r["tpot_s"] or math.nan)) for r in peaks if r["system"] == s]
             for s in dict.fromkeys(r["system"] for r in peaks)},
            "prompt length (tokens)", "decode time per output token (ms)", "Decode latency vs length", ymin=0.0,
            note=summary.figure_note(f"n = {p.output_len - 1} decode steps per point (mean)")), "decode latency")
    return summary.write(out_dir)


EXPERIMENT = Memory()

"""The decode roofline's summary: step time against the bandwidth floor per point, the targets, the GB/s plot."""
from __future__ import annotations

import math
from typing import Any

from harness.experiments.decode_roofline.params import Params
from harness.reporting import plots
from harness.running.envinfo import machine_class
from harness.running.experiment import Run

MB = 1e6


def derived(r: dict[str, Any], bandwidth_gbs: float) -> dict[str, Any]:
    """A point's bytes, floor, achieved GB/s and split, from what was measured."""
    total = r["weight_bytes"] + r["kv_bytes"] + r["metadata_bytes"]
    floor_ms = total / (bandwidth_gbs * 1e9) * 1e3
    rest = r["split_step_ms"] - r["select_ms"] - r["attention_ms"]        # all three from the layer-by-layer steps
    return {**r, "bytes_read": total, "floor_ms": floor_ms, "step_over_floor": r["step_ms"] / floor_ms,
            "achieved_gbs": total / (r["step_ms"] * 1e-3) / 1e9, "share_of_bandwidth": total / (r["step_ms"] * 1e-3)
            / (bandwidth_gbs * 1e9), "rest_ms": max(rest, 0.0)}


def unsteady(samples_gbs: list[float], limit: float, recheck: dict | None = None) -> str | None:
    """Why the run's timings are not a quiet host's, or None: the streaming bandwidth read before each system and at
    the end moved by more than `limit` of the best read (another tenant's memory traffic), or the reference's first
    point timed again at the end moved by more than `limit` of the slower timing (its compute, too)."""
    why = []
    low, high = min(samples_gbs), max(samples_gbs)
    if (high - low) / high > limit:
        why.append(f"the streaming read bandwidth moved {100 * (high - low) / high:.0f} % ({low:.1f} to {high:.1f} "
                   f"GB/s over {len(samples_gbs)} reads)")
    if recheck:
        a, b = recheck["first_ms"], recheck["again_ms"]
        if abs(a - b) / max(a, b) > limit:
            why.append(f"{recheck['system']} at batch {recheck['batch']}, {recheck['context']} tokens took "
                       f"{a:.1f} ms per step first and {b:.1f} ms when timed again at the end")
    if not why:
        return None
    return (f"Unsteady host: during this run {' and '.join(why)}, more than the {100 * limit:g} % accepted, so "
            "another tenant used this machine while the points were timed: their steps and floor ratios are not "
            "comparable with a quiet run's; rerun on a quiet host.")


def bandwidth_reads(stored: dict) -> list[float]:
    """The run's streaming-bandwidth reads, in order (runs stored before per-system reads kept the first and last)."""
    return stored.get("bandwidth_samples_gbs") or [stored["bandwidth_gbs"], stored["bandwidth_after_gbs"]]


def reference_name(reference: str | None, systems: list[str]) -> str:
    """The system every step is compared to: the configured one when it ran, else the first."""
    return reference if reference is not None and reference in systems else systems[0]


def write_summary(run: Run[Params], stored: dict, envs: list[dict]) -> dict[str, str]:
    p, out_dir = run.params, run.out_dir
    reads = bandwidth_reads(stored)
    bandwidth = max(reads)              # attainable: the best read of the run (a floor no quiet moment beats)
    rows = [derived(r, bandwidth) for r in stored["points"]]
    systems = list(dict.fromkeys(r["system"] for r in rows))
    at = {(r["system"], r["context"], r["batch"]): r for r in rows}
    contexts, batches = sorted({r["context"] for r in rows}), sorted({r["batch"] for r in rows})
    ref = reference_name(p.reference, systems)
    machine = machine_class(envs[0]) if envs else "unknown machine"
    summary = run.summary(envs=envs)
    warning = unsteady(reads, p.host_drift, stored.get("recheck"))
    when = "before each system" if len(reads) > 2 else "at its start"
    summary.glance(" ".join(([warning] if warning else []) + _targets(at, systems, ref, contexts, batches,
                                                                      p.floor_target)), bullets=[
        f"streaming read bandwidth measured in this run ({when} and at its end, each the best of 7 reads of "
        f"{p.bandwidth_gib:g} GiB): " + ", ".join(f"{x:.1f}" for x in reads)
        + f" GB/s; the floors use the best, {bandwidth:.1f} GB/s"])
    summary.table(
        ["system", "context", "batch", "step ms", "floor ms", "step ÷ floor", "achieved GB/s", "% of bandwidth",
         "weights MB", "KV read MB", "metadata MB", "layer-by-layer ms", "select ms", "attention ms", "rest ms",
         "H2D KiB", "device KV MB", "cores busy"],
        [[r["system"], r["context"], r["batch"], r["step_ms"], r["floor_ms"], r["step_over_floor"], r["achieved_gbs"],
          100 * r["share_of_bandwidth"], r["weight_bytes"] / MB, r["kv_bytes"] / MB, r["metadata_bytes"] / MB,
          r["split_step_ms"], r["select_ms"], r["attention_ms"], r["rest_ms"], r["h2d_bytes"] / 1024,
          r["device_kv_bytes"] / MB, r.get("cores_busy")] for r in rows], 2)
    summary.text(
        f"Each point: {p.steps} whole decode steps timed (the median is shown) after {p.warmup} warm-up steps, over "
        f"synthetic caches of `context` tokens in each of the model's {stored['num_layers']} layers, prepared by the "
        "policy as after a prefill; the model and its weights are real. Bytes read per step are counted: every "
        "weight matrix once (plus the embedding rows looked up), the K and V each head attended to (all its tokens, "
        "or the whole pages its policy selected; per KV head the union of its query heads' sets), and the MinMax "
        "bounds the page scorers read. floor = bytes ÷ the best bandwidth read in the run; achieved GB/s = bytes ÷ "
        "step time. "
        f"The split comes from {p.split_steps} further steps timed layer by layer (their mean: layer-by-layer ms), "
        "each layer's selection and attention timed apart; rest = those steps minus both (norms, projections, MLP, "
        "RoPE, the KV append, eviction hooks and the LM head). Timing each layer's pieces apart runs the step layer "
        "by layer, so layer-by-layer ms is above step ms wherever the whole step is one fused call (every policy "
        "but FlexiCache and LServe; Quest's page rule then runs inside the call, cheaper than the per-layer "
        "selection timed here). H2D = host → device bytes copied per step (FlexiCache's promotions). Cores busy = CPU "
        f"seconds ÷ wall time over the timed steps, from /proc. {stored['dtype']} on {machine}.")
    summary.csv([{**r, "reference": ref, "bandwidth_gbs": bandwidth} for r in rows], "points")
    budgets = sorted({str(r["budget"]) for r in rows if r.get("budget") is not None})
    panels = [{"series": {s: [(b, at[(s, c, b)]["achieved_gbs"]) for b in batches if (s, c, b) in at]
                          for s in systems},
               "ylabel": "GB/s read per decode step", "title": f"{c} tokens per sequence", "logx": True,
               "hline": bandwidth} for c in contexts]
    summary.image("png_roofline", plots.line_panels(
        out_dir / "achieved_vs_attainable.png", panels, "batch size (sequences)",
        f"Decode step: achieved GB/s vs the attainable {bandwidth:.0f} GB/s (grey line, measured in this run)",
        note=summary.figure_note(f"n = {p.steps} steps per point (median), budget {', '.join(budgets) or 'none'}")),
        "achieved vs attainable bandwidth")
    return summary.write(out_dir)


def _targets(at: dict, systems: list[str], ref: str, contexts: list[int], batches: list[int],
             floor_target: float) -> list[str]:
    """The issue's two targets as measured: the reference at batch 1 within `floor_target` of its floor, and every
    other system's step below the reference's at the longest context."""
    out = []
    first = batches[0]
    for c in contexts:
        r = at.get((ref, c, first))
        if r:
            verdict = "within" if r["step_over_floor"] <= floor_target else "NOT within"
            out.append(f"{ref} at batch {first}, {c} tokens: {r['step_ms']:.1f} ms per step = "
                       f"{r['step_over_floor']:.2f}× its bandwidth floor of {r['floor_ms']:.1f} ms ({verdict} "
                       f"{floor_target:g}×).")
    long = contexts[-1]
    slower = [f"{s} at batch {b} ({at[(s, long, b)]['step_ms']:.1f} vs {at[(ref, long, b)]['step_ms']:.1f} ms)"
              for s in systems if s != ref for b in batches
              if (s, long, b) in at and (ref, long, b) in at and at[(s, long, b)]["step_ms"] >= at[(ref, long, b)][
                  "step_ms"]]
    others = [s for s in systems if s != ref]
    if others:
        out.append(f"At {long} tokens every other system's step is below {ref}'s at every batch size." if not slower
                   else f"At {long} tokens, steps not below {ref}'s: " + "; ".join(slower) + ".")
    best = max((r for r in at.values()), key=lambda r: r["achieved_gbs"], default=None)
    if best is not None and not math.isnan(best["achieved_gbs"]):
        out.append(f"Highest achieved: {best['achieved_gbs']:.1f} GB/s ({best['system']}, batch {best['batch']}, "
                   f"{best['context']} tokens).")
    return out

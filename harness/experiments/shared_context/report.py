"""The shared_context summary: retention per mode, paired mode differences, first vs later questions, KV and speed.

Cells are labelled `<system>|<mode>`. Retention in a mode is against the reference system in the same mode; the
reference's own row compares its modes with its query-aware cell (dense keeps everything, so its answers should not
depend on the mode; the row says whether they do). Mode differences are
paired per sample, each side's retention against the reference's query-aware cell. Device KV per context adds what
each of a context's questions held on the device, shared pages once (kv_stats `device_pages` and
`shared_device_pages`), in tokens per layer and KV head. Output tokens/s is over each cell's generation time.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from harness.experiments.accuracy.data import AccuracyData, csv_estimate
from harness.experiments.accuracy.sections import CHAIN_KEY, cells_seconds
from harness.reporting import plots
from harness.reporting import uncertainty as unc
from harness.reporting.summary import cell_envs, generation_work
from harness.reporting.uncertainty import Estimate
from harness.running.config import UserError
from harness.running.experiment import Run

MODES = ("query_aware", "query_agnostic", "shared")
SEP = "|"
TITLES = {"query_aware": "query-aware", "query_agnostic": "query-agnostic", "shared": "shared context (k questions)"}
MODE_TEXT = ("Query-aware: the whole prompt prefilled at once, the question in view when the policy compresses. "
             "Query-agnostic: the context prefilled and compressed alone, the question prefilled onto the compressed "
             "cache. Shared: as query-agnostic, the k questions of one context submitted together, reading one "
             "compressed context.")
PAIRS = (("query_aware", "query_agnostic"), ("query_agnostic", "shared"), ("query_aware", "shared"))


def split(label: str) -> tuple[str, str]:
    system, _, mode = label.rpartition(SEP)
    return (system, mode) if system else (label, MODES[0])


def question_unit(task: str, row: dict) -> str:
    index = (row.get("meta") or {}).get("question_index")
    return f"{task}/{'single' if index is None else 'first' if int(index) == 0 else 'later'}"


def context_kv(rows: Sequence[dict], page: int | None) -> Estimate:
    """Device KV per context (tokens per layer and KV head): each question's own pages, the shared pages once; rows
    carry `context`, the context they ask about."""
    groups: dict[Any, list[dict]] = defaultdict(list)
    for row in rows:
        groups[row["context"]].append(row)
    values = []
    for group in groups.values():
        stats = [r.get("kv_stats") or {} for r in group]
        kept = stats[0].get("kept_tokens")
        if not page or not kept or not kept[0] or any(not isinstance(s.get("device_pages"), int) for s in stats):
            continue
        shared = [int(s.get("shared_device_pages") or 0) for s in stats]
        pages = sum(int(s["device_pages"]) - x for s, x in zip(stats, shared)) + max(shared)
        values.append(pages * page / (len(kept) * len(kept[0])))
    return unc.mean(values)


def write_summary(run: Run[Any], cells: list[Any], labels: list[str], metrics: list[dict],
                  rows_by_cell: dict[str, list[dict]]) -> dict[str, str]:
    p, out_dir = run.params, run.out_dir
    reference = p.reference or split(labels[0])[0]
    modes = [m for m in MODES if any(split(label)[1] == m for label in labels)]
    systems = list(dict.fromkeys(split(label)[0] for label in labels))
    if reference not in systems:
        raise UserError(f"reference system {reference!r} is not in the grid {systems}: add it to exp.systems")
    policies = [s for s in systems if s != reference]
    data = AccuracyData(cells, labels, rows_by_cell, p.min_reference_score)
    by_q = AccuracyData(cells, labels, rows_by_cell, p.min_reference_score, unit_of=question_unit)

    def lab(system: str, mode: str) -> str:
        return f"{system}{SEP}{mode}"

    summary = run.summary(envs=cell_envs(metrics))
    base = lab(reference, MODES[0]) if MODES[0] in modes else lab(reference, modes[0])
    # the reference's own row: each of its modes against its first (does dense answer alike in every mode?)
    retention = {(s, m): data.macro_retention(lab(s, m), lab(reference, m) if s != reference else base)
                 for s in systems for m in modes}
    bullets = [f"macro retention vs `{reference}`, {TITLES[m]}: "
               f"{data.ranking(lab(reference, m), [lab(s, m) for s in policies])}" for m in modes]
    summary.glance(CHAIN_KEY, bullets)
    summary.reasons(p.size_reason, p.budget_reason, p.budget)

    summary.section(f"Retention vs `{reference}` per mode (paired 95 % bootstrap intervals)").table(
        ["system", *[TITLES[m] for m in modes]], [[s, *[retention[(s, m)].fmt(2) for m in modes]] for s in systems])
    summary.text(f"Each policy against `{reference}` in the same mode; `{reference}`'s own row against its "
                 f"{TITLES[split(base)[1]]} cell. " + MODE_TEXT)
    summary.csv([{"system": s, "mode": m, **csv_estimate(retention[(s, m)], "retention")}
                 for s in systems for m in modes], "retention_by_mode")

    pairs = [(a, b) for a, b in PAIRS if a in modes and b in modes]
    diffs = {(s, a, b): data.macro_difference(lab(s, b), lab(s, a), base) for s in policies for a, b in pairs}
    summary.section("Paired difference between modes (retention, second − first)").table(
        ["system", *[f"{TITLES[b]} − {TITLES[a]}" for a, b in pairs]],
        [[s, *[diffs[(s, a, b)].fmt(3) for a, b in pairs]] for s in policies])
    summary.text(f"Both sides against `{reference}` {TITLES[split(base)[1]]} on the same samples; an interval that "
                 "excludes 0 is a difference the data support.")
    summary.csv([{"system": s, "mode": b, "versus": a, **csv_estimate(d, "difference")}
                 for (s, a, b), d in diffs.items()], "mode_differences")

    positions = [q for q in ("first", "later", "single") if any(u.endswith("/" + q) for u in by_q.units)]
    by_question = {(s, m, q): by_q.macro_retention(lab(s, m), lab(reference, m),
                                                   [u for u in by_q.units if u.endswith("/" + q)])
                   for s in policies for m in modes for q in positions}
    summary.section("Retention by question: the first asked of a context vs the later ones").table(
        ["system", "mode", *positions], [[s, TITLES[m], *[by_question[(s, m, q)].fmt(2) for q in positions]]
                                         for s in policies for m in modes])
    summary.csv([{"system": s, "mode": m, "question": q, **csv_estimate(e, "retention")}
                 for (s, m, q), e in by_question.items()], "retention_by_question")

    # a label's cells (one per task) together; contexts are told apart by their cell
    peak: dict[str, float] = {}
    rows_of: dict[str, list[dict]] = defaultdict(list)
    for cell, label, m in zip(cells, labels, metrics):
        bytes_ = (m.get("memory") or {}).get("device_kv_peak_bytes")
        if isinstance(bytes_, (int, float)):
            peak[label] = max(peak.get(label, 0.0), float(bytes_))
        rows_of[label] += [{**r, "context": (cell.key, (r.get("meta") or {}).get("context_id", r["id"]))}
                           for r in rows_by_cell.get(cell.key, [])]
    labels = list(dict.fromkeys(labels))
    kv = {label: context_kv(rows_of[label], data.page_size.get(label)) for label in labels}
    speed = {label: _tokens_per_second(rows_of[label]) for label in labels}
    summary.section("Device KV per context and output speed").table(
        ["system", "mode", "device KV per context (tokens / layer·head)", "peak device KV (MiB)", "output tokens/s"],
        [[split(label)[0], TITLES[split(label)[1]], kv[label].fmt(0), _mib(peak.get(label)), speed[label]]
         for label in labels])
    summary.text("Device KV per context: the device pages each question of a context held at its end, the pages its "
                 "questions shared counted once. In the independent modes each question holds its own copy of the "
                 "context; in the shared mode they hold one.")
    summary.csv([{"system": split(label)[0], "mode": split(label)[1], **csv_estimate(kv[label], "context_kv_tokens"),
                  "peak_device_kv_bytes": peak.get(label), "output_tokens_per_s": speed[label]} for label in labels],
                "kv_and_speed")
    if "shared" in modes and "query_agnostic" in modes:
        gains = [[s, speed[lab(s, "query_agnostic")], speed[lab(s, "shared")],
                  _ratio(speed.get(lab(s, "shared")), speed.get(lab(s, "query_agnostic")))]
                 for s in systems if lab(s, "shared") in speed and lab(s, "query_agnostic") in speed]
        summary.section("Shared vs independent prefill: output tokens/s").table(
            ["system", "independent (query-agnostic)", "shared", "shared ÷ independent"], gains, 2)

    if policies:
        n = sorted({e.n for e in retention.values() if e.n})
        n_text = f"n = {n[0]} samples per system" if len(n) == 1 else f"n = {n[0]}–{n[-1]} samples per system" \
            if n else "n = 0"
        summary.image("png_retention_by_mode", plots.bar_plot(
            out_dir / "retention_by_mode.png", policies, {TITLES[m]: [retention[(s, m)].value for s in policies]
                                                          for m in modes},
            errors={TITLES[m]: [(retention[(s, m)].low, retention[(s, m)].high) for s in policies] for m in modes},
            colour_by="group", reference=1.0, reference_label=f"{reference} (= 1)",
            xlabel="system (bars: modes, hatched as in the legend)",
            ylabel=f"macro retention vs {reference}, same mode (95 % CI)",
            title=f"Retention by compression mode ({n_text})", note=summary.figure_note(n_text)), "retention by mode")
    summary.took(cells_seconds(metrics), generation_work(p))
    return summary.write(out_dir)


def _tokens_per_second(rows: Sequence[dict]) -> float | None:
    seconds = sum(float(r.get("generation_s") or 0.0) for r in rows)
    return sum(int(r.get("output_tokens") or 0) for r in rows) / seconds if seconds > 0 else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _mib(n: Any) -> float | None:
    return n / 2 ** 20 if isinstance(n, (int, float)) else None

"""The answer-survival diagnostic of an accuracy run, from its finished cells: what each system's heads keep of the gold
answer at the first decode step, and where their slots go.

    python scripts/answer_survival.py /tmp/run/budget_sweep [--task niah_single_2] [--examples 4]

Per system label (`<system>@<budget>`), over the samples whose rows carry `answer_survival`, each with its n and a
95 % bootstrap interval: the score, answer kept (% of samples whose whole answer at least half of the (layer, KV
head) pairs read), the share of gold tokens a head reads, the heads reading the whole answer, the share of heads
reading each gold token in order (with --task), the share of read slots per prompt region, and the share of gold
tokens read per layer. With --prompts it rebuilds the samples of the cells' task config to describe the prompts
themselves: tokens per region and what the last 32 prompt tokens (SnapKV's observation window) are.
"""
from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import numpy as np

from harness.measuring.answer_survival import REGIONS
from harness.reporting import uncertainty as unc
from harness.running.cells import StoredCell, finished
from harness.running.grid import budget_label


def _fmt(values: list[float], digits: int = 1) -> str:
    return unc.mean(values).fmt(digits) if values else "—"


def report(cells: list[StoredCell], task: str | None, examples: int) -> None:
    by_label: dict[str, list[dict]] = defaultdict(list)
    for cell in cells:
        by_label[budget_label(cell.system, [1])] += [
            r for r in cell.rows() if isinstance(r.get("answer_survival"), dict)
            and (task is None or (r.get("meta") or {}).get("ruler_task", cell.task.name) == task)]
    print(f"## {task or 'all samples'}\n")
    print("| system | score | answer kept % | gold read share | heads reading all (of L×H) | min–max |")
    print("| --- | --- | --- | --- | --- | --- |")
    for label, rows in sorted(by_label.items()):
        surv = [r["answer_survival"] for r in rows]
        whole = [s["heads_whole"] for s in surv]
        print(f"| {label} | {_fmt([r['score'] for r in rows])} | {_fmt([100.0 * s['span_kept'] for s in surv])} | "
              f"{_fmt([float(np.mean(s['read'])) for s in surv], 3)} | {_fmt(whole)} of {surv[0]['heads']} | "
              f"{min(whole)}–{max(whole)} |")
    print("\nShare of read slots per prompt region (% of all slots a head reads at decode step 1, mean over "
          "samples):\n")
    print("| system | " + " | ".join(REGIONS) + " |")
    print("| --- |" + " --- |" * len(REGIONS))
    for label, rows in sorted(by_label.items()):
        shares = [[100 * r["answer_survival"]["read_slots"][g] / sum(r["answer_survival"]["read_slots"].values())
                   for r in rows] for g in REGIONS]
        print(f"| {label} | " + " | ".join(_fmt(v) for v in shares) + " |")
    print("\nShare of gold tokens read per layer (mean over samples and KV heads), layers 0, 1, ...:\n")
    for label, rows in sorted(by_label.items()):
        per_layer = np.mean([np.mean(r["answer_survival"]["read"], axis=1) for r in rows], axis=0)
        print(f"- {label}: " + " ".join(f"{v:.2f}" for v in per_layer))
    if task is not None:
        print("\nShare of heads reading each gold token, in order (mean over samples):\n")
        for label, rows in sorted(by_label.items()):
            heads = [np.asarray(r["answer_survival"]["token_heads"]) / r["answer_survival"]["heads"] for r in rows
                     if "token_heads" in r["answer_survival"]]
            if heads and len({h.size for h in heads}) == 1:
                print(f"- {label}: " + " ".join(f"{v:.2f}" for v in np.mean(heads, axis=0)))
        print("\nPredictions (gold → prediction, heads reading the whole answer):\n")
        for label, rows in sorted(by_label.items()):
            shown = "; ".join(f"{'/'.join(r['answers'])} → {r['prediction'].strip()[:24]!r} "
                              f"({r['answer_survival']['heads_whole']})" for r in rows[:examples])
            print(f"- {label}: {shown}")
    print()


def prompts(cells: list[StoredCell]) -> None:
    """Tokens per region of the cells' prompts and the regions of their last 32 tokens."""
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from harness.integrations.assets import prepare
    from harness.measuring.answer_survival import layout
    from harness.running.prompts import render
    from tasks.base import load_task

    cell = cells[0]
    cfg = OmegaConf.create(cell.config)
    tok = AutoTokenizer.from_pretrained(cfg.model.path or prepare(progress=False, name=cfg.model.name))
    t = cell.task
    task = load_task(t.family, t.name, OmegaConf.to_container(t.params), seed=cfg.seed, limit=t.limit,
                     fraction=t.fraction)
    count: dict[str, list[float]] = defaultdict(list)
    window: dict[str, list[float]] = defaultdict(list)
    for s in task.samples(tok):
        ids = render(s, tok, cfg.model.max_input_tokens)
        lay = layout(s, tok, ids)
        if lay is None:
            continue
        key = (s.meta or {}).get("ruler_task", t.name)
        for k in (key, "all"):
            count[k].append(float(len(ids)))
            for i, g in enumerate(REGIONS[:5]):
                count[f"{k}:{g}"].append(float((lay.region == i).sum()))
                window[f"{k}:{g}"].append(float((lay.region[-32:] == i).sum()))
    print("## Prompts: tokens per region (mean, 95 % CI) and in the last 32 prompt tokens\n")
    print("| task | prompt tokens | " + " | ".join(REGIONS[:5]) + " | last 32: " + " / ".join(REGIONS[:5]) + " |")
    print("| --- | --- |" + " --- |" * 6)
    for k in sorted({k.split(":")[0] for k in count}):
        print(f"| {k} | {_fmt(count[k], 0)} | " + " | ".join(_fmt(count[f'{k}:{g}'], 0) for g in REGIONS[:5])
              + " | " + " / ".join(f"{np.mean(window[f'{k}:{g}']):.1f}" for g in REGIONS[:5]) + " |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="an experiment's results folder (results_dir/<exp>)")
    parser.add_argument("--task", action="append", help="also report one RULER task (or task name) alone")
    parser.add_argument("--examples", type=int, default=4, help="predictions shown per system with --task")
    parser.add_argument("--prompts", action="store_true", help="describe the prompts (rebuilds the samples)")
    args = parser.parse_args()
    cells = finished(args.folder, None, False)
    if not cells:
        raise SystemExit(f"no finished cells under {args.folder}")
    if args.prompts:
        prompts(cells)
    report(cells, None, args.examples)
    for task in args.task or []:
        report(cells, task, args.examples)


if __name__ == "__main__":
    main()

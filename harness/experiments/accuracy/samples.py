"""Per-sample logs, as lm-eval's `--log_samples` writes them: results/<exp>/samples/samples_<system>_<task>.jsonl.

One JSON line per sample of every finished accuracy cell, rebuilt with the summary from the cells on disk: the
sample id (`doc_id`), the hashes of the prompt and the target, the target answers, the prediction, its score and
the task's other metrics, and the per-sample fidelity to the reference (top-1 agreement, KL, Δ gold log-likelihood).
The folder sits beside the cells, so like them it stays out of git (the committed summary quotes its numbers).
"""
from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.reporting.results_file import clean
from harness.running.store import atomic_write_text

FOLDER = "samples"
# row keys that are bookkeeping, not a metric of the sample
NOT_METRICS = {"id", "prediction", "meta", "answers", "prompt_hash", "prompt_tokens", "output_tokens", "output_ids",
               "ttft_s", "tpot_s", "finish_reason", "kv_stats", "generation_s", "fidelity_s", "fid_steps", "kv_budget"}
FIDELITY = ("fid_top1", "fid_kl", "gold_loglik")


def _hash(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def sample_record(row: dict, system: str, task: str) -> dict[str, Any]:
    """lm-eval's sample fields where they have a match (doc_id, target, prompt_hash, target_hash), plus ours."""
    metrics = {k: v for k, v in row.items() if k not in NOT_METRICS and k not in FIDELITY}
    return {"doc_id": row["id"], "system": system, "task": task, "prompt_hash": row.get("prompt_hash"),
            "target": row.get("answers"), "target_hash": _hash(row.get("answers")),
            "prediction": row.get("prediction"), "score": row.get("score"), "metrics": metrics,
            "fidelity": {k: row.get(k) for k in FIDELITY if k in row} or None,
            "prompt_tokens": row.get("prompt_tokens"), "output_tokens": row.get("output_tokens"),
            "kv_budget": row.get("kv_budget"),
            "finish_reason": row.get("finish_reason"), "meta": row.get("meta")}


def file_name(system: str, task: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.@=+-]", "-", f"samples_{system}_{task}") + ".jsonl"


def write_samples(out_dir: Path, cells: Sequence[Any], labels: Sequence[str],
                  rows_by_cell: dict[str, list[dict]]) -> str | None:
    """One samples file per (system label, task) of the finished cells; returns the folder (None: no rows)."""
    folder = Path(out_dir) / FOLDER
    written = set()
    for cell, label in zip(cells, labels):
        rows = rows_by_cell.get(cell.key) or []
        if not rows:
            continue
        name = file_name(label, str(cell.task.name))
        text = "".join(json.dumps(clean(sample_record(r, label, str(cell.task.name))), ensure_ascii=False,
                                  allow_nan=False) + "\n" for r in rows)
        atomic_write_text(folder / name, text)
        written.add(name)
    for old in folder.glob("samples_*.jsonl") if written else ():      # cells no longer in the summary
        if old.name not in written:
            old.unlink()
    return str(folder) if written else None

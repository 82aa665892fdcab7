"""LongBench v1 and LongBench-E (THUDM/LongBench): upstream prompts, generation lengths and scoring.

One task holds one or more of the 21 datasets (`params.datasets`, or a group name: `en16`, `all`, `e13`).
Prompts and max_new_tokens are the upstream dataset2prompt/dataset2maxlen files (tasks/data/longbench/);
the harness applies the chat template (not for trec, triviaqa, samsum, lsht, lcc, repobench-p) and the
middle truncation to the model's max input tokens. Scores: max over answers, dataset score
round(100 * mean, 2), category means, the leaderboard average of categories and the plain mean over
datasets that KV-cache papers report; LongBench-E adds the 0-4k / 4-8k / 8k+ buckets on `length`.
Rows come from `data_dir` (upstream data.zip jsonl: <name>.jsonl, <name>_e.jsonl) or the HF parquet
mirror `hub_repo` (configs <name> and <name>_e, split test; a `question` column stands in for `input`).
Configs: conf/task/longbench_<dataset>.yaml for each dataset, longbench_en16 / longbench_all / longbench_e
for the groups; any other mix is `task.params.datasets=[...]` on one of them.
"""
from __future__ import annotations

import json
import logging
import pathlib
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tasks import metrics, sources
from tasks.base import Sample, Task, TaskError, split_at

log = logging.getLogger(__name__)
DATA = pathlib.Path(__file__).parent / "data" / "longbench"
PROMPTS: dict[str, str] = json.loads((DATA / "dataset2prompt.json").read_text(encoding="utf-8"))
MAX_NEW_TOKENS: dict[str, int] = json.loads((DATA / "dataset2maxlen.json").read_text(encoding="utf-8"))

# dataset -> (category, language, metric name in tasks.metrics.LONGBENCH_METRICS), from upstream eval.py
DATASETS: dict[str, tuple[str, str, str]] = {
    "narrativeqa": ("single_doc_qa", "en", "qa_f1"),
    "qasper": ("single_doc_qa", "en", "qa_f1"),
    "multifieldqa_en": ("single_doc_qa", "en", "qa_f1"),
    "multifieldqa_zh": ("single_doc_qa", "zh", "qa_f1_zh"),
    "hotpotqa": ("multi_doc_qa", "en", "qa_f1"),
    "2wikimqa": ("multi_doc_qa", "en", "qa_f1"),
    "musique": ("multi_doc_qa", "en", "qa_f1"),
    "dureader": ("multi_doc_qa", "zh", "rouge_zh"),
    "gov_report": ("summarization", "en", "rouge"),
    "qmsum": ("summarization", "en", "rouge"),
    "multi_news": ("summarization", "en", "rouge"),
    "vcsum": ("summarization", "zh", "rouge_zh"),
    "trec": ("few_shot", "en", "classification"),
    "triviaqa": ("few_shot", "en", "qa_f1"),
    "samsum": ("few_shot", "en", "rouge"),
    "lsht": ("few_shot", "zh", "classification"),
    "passage_count": ("synthetic", "en", "count"),
    "passage_retrieval_en": ("synthetic", "en", "retrieval"),
    "passage_retrieval_zh": ("synthetic", "zh", "retrieval_zh"),
    "lcc": ("code", "code", "code_sim"),
    "repobench-p": ("code", "code", "code_sim"),
}
NO_CHAT_TEMPLATE = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})
FIRST_LINE = frozenset({"trec", "triviaqa", "samsum", "lsht"})
GOLD_PARAGRAPH = {"passage_retrieval_en": r"Paragraph (\d+)", "passage_retrieval_zh": r"段落(\d+)"}
STOPS = {"samsum": ("\n",)}       # upstream adds "\n" to eos_token_id for samsum
EN16 = ["narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "gov_report", "qmsum",
        "multi_news", "trec", "triviaqa", "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p"]
E13 = ["qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news", "trec", "triviaqa",
       "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p"]
GROUPS = {"en16": EN16, "all": list(DATASETS), "e13": E13}
BUCKETS = (("0-4k", 4000), ("4-8k", 8000), ("8k+", float("inf")))


def resolve(names: Sequence[str]) -> list[str]:
    out: list[str] = []
    for name in names:
        for ds in GROUPS.get(name, [name]):
            if ds not in DATASETS:
                raise TaskError(f"unknown LongBench dataset {ds!r} in task.params.datasets; valid: "
                                f"{sorted(DATASETS)} or a group {sorted(GROUPS)}")
            if ds not in out:
                out.append(ds)
    return out


def bucket(length: int) -> str:
    return next(name for name, upper in BUCKETS if length < upper)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


class LongBench(Task):
    unit_key = "dataset"

    @dataclass
    class Params:
        datasets: list[str] = field(default_factory=lambda: ["en16"])   # names and/or groups en16, all, e13
        longbench_e: bool = False          # LongBench-E rows (<name>_e) and length buckets
        data_dir: str | None = None        # folder of upstream jsonl files; null = the HF hub
        hub_repo: str = "Xnhyacinth/LongBench"
        hub_timeout_s: float = 5.0         # reachability probe before any download
        on_malformed: str = "skip"         # skip (counted in the summary) | fail

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        p = self.params
        self.datasets = resolve(p.datasets)
        if p.longbench_e and set(self.datasets) - set(E13):
            raise TaskError(f"LongBench-E has no {sorted(set(self.datasets) - set(E13))}: use datasets from "
                            f"{E13} in task.params.datasets")
        if p.on_malformed not in ("skip", "fail"):
            raise TaskError(f"task.params.on_malformed must be 'skip' or 'fail', got {p.on_malformed!r}")

    # -- samples ---------------------------------------------------------------------------------
    def _rows(self, ds: str) -> list[Any]:
        config = f"{ds}_e" if self.params.longbench_e else ds
        if self.params.data_dir:
            return sources.local_rows(self.params.data_dir, f"{config}.jsonl", "task.params.data_dir")
        return sources.hub_rows(self.params.hub_repo, config, "test", "task.params.data_dir",
                                self.params.hub_timeout_s)

    def build_samples(self, tokenizer: Any = None) -> list[Sample]:
        out: list[Sample] = []
        for ds in self.datasets:
            good, bad = [], 0
            for i, row in enumerate(self._rows(ds)):
                problem = self._problem(ds, row)
                if problem is None:
                    good.append((i, row))
                elif self.params.on_malformed == "fail":
                    raise TaskError(f"LongBench {ds} row {i}: {problem}; fix the data or set "
                                    f"task.params.on_malformed=skip")
                else:
                    bad += 1
            if bad and not good:
                raise TaskError(f"LongBench {ds}: all {bad} rows are malformed; check task.params.data_dir "
                                f"(upstream jsonl) or task.params.hub_repo")
            if bad:
                log.warning("LongBench %s: skipped %d malformed row(s)", ds, bad)
            out += [self._sample(ds, i, row, bad) for i, row in good]
        return out

    def _problem(self, ds: str, row: Any) -> str | None:
        if not isinstance(row, dict):
            return "not a JSON object"
        if not isinstance(row.get("context"), str):
            return "'context' is not a string"
        if not isinstance(row.get("input", row.get("question")), str):
            return "'input' is not a string"
        answers = row.get("answers")
        if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
            return "'answers' is not a non-empty list of strings"
        if ds in ("trec", "lsht") and not isinstance(row.get("all_classes"), list):
            return "'all_classes' is missing"
        pattern = GOLD_PARAGRAPH.get(ds)
        if pattern and not all(re.search(pattern, a) for a in answers):
            return "an answer has no paragraph id"
        if not isinstance(row.get("length", 0 if not self.params.longbench_e else None), int):
            return "'length' is not an integer"
        return None

    def _sample(self, ds: str, index: int, row: dict, malformed: int) -> Sample:
        question = row.get("input", row.get("question"))
        category, language, metric = DATASETS[ds]
        # the context is the template up to the end of the document; the question part everything after it
        prompt = PROMPTS[ds].format(context=row["context"], input=question)
        context, asked = split_at(prompt, PROMPTS[ds].split("{context}", 1)[1].format(input=question))
        return Sample(
            id=f"{ds}{'_e' if self.params.longbench_e else ''}-{index}",
            context=context, question=asked,
            answers=tuple(row["answers"]),
            max_new_tokens=MAX_NEW_TOKENS[ds],
            chat_template=ds not in NO_CHAT_TEMPLATE,
            truncation="middle",
            stop=STOPS.get(ds, ()),
            meta={"dataset": ds, "category": category, "language": language, "metric": metric,
                  "length": row.get("length"), "all_classes": row.get("all_classes"), "_id": row.get("_id"),
                  "longbench_e": self.params.longbench_e, "malformed_skipped": malformed},
        )

    # -- scoring ---------------------------------------------------------------------------------
    def score(self, sample: Sample, prediction: str) -> dict[str, float]:
        ds = sample.meta["dataset"]
        if ds in FIRST_LINE:
            prediction = metrics.first_line(prediction)
        metric = metrics.LONGBENCH_METRICS[sample.meta["metric"]]
        value = metrics.best_over_references(metric, prediction, sample.answers,
                                             all_classes=sample.meta["all_classes"] or [])
        return {"score": 100 * value, "raw": value}

    def summarize(self, rows: Sequence[dict]) -> dict[str, float]:
        """Per dataset (and bucket) round(100 * mean, 2); category means; mean of categories and of datasets."""
        by_ds: dict[str, list[float]] = defaultdict(list)
        by_bucket: dict[str, list[float]] = defaultdict(list)
        skipped: dict[str, int] = {}
        for row in rows:
            ds = row["meta"]["dataset"]
            by_ds[ds].append(row["raw"])
            skipped[ds] = row["meta"].get("malformed_skipped", 0)
            if row["meta"].get("longbench_e"):
                by_bucket[f"{ds}_{bucket(row['meta']['length'])}"].append(row["raw"])
        out: dict[str, float] = {ds: metrics.longbench_aggregate(v) for ds, v in by_ds.items()}
        out.update({key: metrics.longbench_aggregate(v) for key, v in sorted(by_bucket.items())})
        categories: dict[str, list[float]] = defaultdict(list)
        for ds in by_ds:
            categories[DATASETS[ds][0]].append(out[ds])
        out.update({f"cat_{c}": _mean(v) for c, v in categories.items()})
        dataset_scores = [out[ds] for ds in by_ds]
        out["avg_datasets"] = _mean(dataset_scores) if dataset_scores else float("nan")
        out["avg_categories"] = _mean([out[f"cat_{c}"] for c in categories]) if categories else float("nan")
        out["score"] = out["avg_datasets"]
        out["n"] = len(rows)
        out.update({f"{ds}_malformed_skipped": n for ds, n in skipped.items() if n})
        return out


TASK = LongBench

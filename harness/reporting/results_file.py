"""results/<exp>/results.json: one run's numbers in a documented, versioned schema others can parse.

What lm-eval's users parse in `results_<time>.json`, for this harness: the experiment, its resolved config, the
budget (tokens, a sweep's budgets, or kvpress's compression_ratio), versions, the machine class, provenance, every
tidy table the summary wrote (one row type per CSV file, the same rows here), and, for accuracy kinds, one record
per task unit and system with its score, retention and fidelity, each an estimate {value, ci_low, ci_high, n}.
`RESULTS_SCHEMA` (harness/reporting/results_schema.json, JSON Schema draft 2020-12) is the contract; bump
SCHEMA_VERSION whenever a field changes meaning or goes away (adding a field keeps the version).
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

SCHEMA_NAME = "kvharness.results"
SCHEMA_VERSION = 1
SCHEMA_FILE = Path(__file__).with_name("results_schema.json")
ESTIMATES = ("score", "retention", "fid_top1", "fid_kl", "gold_loglik_delta")


def clean(value: Any) -> Any:
    """Plain JSON: NaN and infinities become null (JSON has neither), tuples lists, keys strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    if value is None or isinstance(value, (str, int, bool)):
        return value
    if hasattr(value, "item"):              # numpy scalars
        return clean(value.item())
    return str(value)


def estimate(row: Mapping[str, Any], name: str, n_key: str = "n") -> dict[str, Any] | None:
    """{value, ci_low, ci_high, n} of `name` from a flat CSV row (`name`, `name_ci_low`, `name_ci_high`, `name_n`);
    None when the row has no value for it."""
    value = row.get(name)
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return None
    return clean({"value": value, "ci_low": row.get(f"{name}_ci_low"), "ci_high": row.get(f"{name}_ci_high"),
                  "n": row.get(f"{name}_n", row.get(n_key))})


def unit_records(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per task unit and system, from the accuracy kinds' `scores` rows: the estimates nested, n kept with each."""
    out = []
    for r in rows:
        out.append({"system": r["system"], "task_unit": r["task"], "n": r.get("n"), "reference": r.get("reference"),
                    "flagged_small_reference": bool(r.get("flagged_small_reference")),
                    **{name: estimate(r, name) for name in ESTIMATES}})
    return clean(out)


def document(meta: Mapping[str, Any], tables: Mapping[str, Sequence[Mapping[str, Any]]],
             results: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The results.json object: `meta` (experiment, config, budget, versions, machine, provenance), the tables by
    name (each with its CSV file name) and the per-unit records."""
    return clean({"schema": SCHEMA_NAME, "schema_version": SCHEMA_VERSION, **meta,
                  "tables": {name: {"file": f"{name}.csv", "rows": list(rows)} for name, rows in tables.items()},
                  "results": list(results)})


def dumps(doc: Mapping[str, Any]) -> str:
    return json.dumps(doc, indent=1, sort_keys=False, allow_nan=False) + "\n"


def schema() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(SCHEMA_FILE.read_text())
    return loaded

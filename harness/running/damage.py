"""Damage in a cell's files, found before anything reads them: which file, which line, what is wrong.

Every file a cell reads back is checked here before the driver reuses, resumes or summarizes the cell: metrics.json
and env.json must be JSON objects, config.yaml a YAML mapping, and predictions.jsonl one JSON object per line, UTF-8,
each with the fields its experiment writes (ROW_FIELDS by default) and no id twice in a finished cell. What a crash
can leave is not damage: rows are appended with one write each and the other files are replaced atomically, so a
crash leaves at most a torn last line in an unfinished cell (opening the cell cuts it off). Anything else is damage
from outside (a disk, an editor, a copy cut short): the driver names the cell, the file and the line, and moves the
folder aside before running the cell again (or stops, with `recompute_damaged=false`), and a summary states how many
rows and cells it could not read instead of quietly leaving them out.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

PREDICTIONS, METRICS, CONFIG, ENV = "predictions.jsonl", "metrics.json", "config.yaml", "env.json"
ROW_FIELDS: tuple[str, ...] = ("id",)
SET_ASIDE = (".stale-", ".damaged-")        # folder names of cells moved aside: never read as cells


@dataclass
class Damage:
    """What is wrong with one cell folder; empty (falsy) when nothing is."""

    key: str
    problems: list[str] = field(default_factory=list)   # "<file> line <n>: <what>", the first found first
    bad_rows: int = 0                                  # lines of predictions.jsonl that are not rows

    def __bool__(self) -> bool:
        return bool(self.problems)

    def line(self) -> str:
        """The damage in one line: the cell, then its first problem (and how many more there are)."""
        more = f" (and {len(self.problems) - 1} more)" if len(self.problems) > 1 else ""
        return f"cell {self.key} is damaged: {self.problems[0]}{more}"

    def note(self) -> str:
        """What a summary says of the cell: the rows it could not read, or that it left the whole cell out."""
        if self.bad_rows and len(self.problems) == self.bad_rows:
            return f"{self.bad_rows} unreadable row(s) of `{self.key}` ({'; '.join(self.problems[:3])})"
        return f"cell `{self.key}` ({'; '.join(self.problems[:3])})"


def set_aside(folder: Path) -> bool:
    """Whether a folder is a cell moved aside (stale or damaged), which nothing reads as a cell."""
    return any(marker in folder.name for marker in SET_ASIDE)


def _read_json(path: Path, problems: list[str]) -> dict | None:
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        problems.append(f"{path.name}: unreadable ({exc.strerror or exc})")
        return None
    except UnicodeDecodeError as exc:
        problems.append(f"{path.name}: not UTF-8 (byte {exc.start})")
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        problems.append(f"{path.name} line {getattr(exc, 'lineno', 1)}: not valid JSON ({getattr(exc, 'msg', exc)})")
        return None
    if not isinstance(value, dict):
        problems.append(f"{path.name}: holds a {type(value).__name__}, not a JSON object")
        return None
    return value


def _read_yaml(path: Path, problems: list[str]) -> None:
    try:
        value = yaml.safe_load(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        return
    except OSError as exc:
        problems.append(f"{path.name}: unreadable ({exc.strerror or exc})")
        return
    except UnicodeDecodeError as exc:
        problems.append(f"{path.name}: not UTF-8 (byte {exc.start})")
        return
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problems.append(f"{path.name}{where}: not valid YAML ({getattr(exc, 'problem', None) or 'unparsable'})")
        return
    if not isinstance(value, dict):
        problems.append(f"{path.name}: holds {type(value).__name__}, not a mapping of config keys")


def row_problem(raw: bytes, fields: Sequence[str]) -> tuple[dict | None, str | None]:
    """One predictions line (without its newline) as a row, or why it is not one."""
    try:
        row: Any = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return None, f"not UTF-8 (byte {exc.start})"
    except ValueError:
        return None, "not valid JSON"
    if not isinstance(row, dict):
        return None, f"a JSON {type(row).__name__}, not a row object"
    missing = [f for f in fields if f not in row]
    if missing:
        return None, f"row without {missing}"
    if not isinstance(row.get("id", ""), str):
        return None, f"row id {row['id']!r} is not a string"
    return row, None


def _check_rows(path: Path, fields: Sequence[str], finished: bool, problems: list[str]) -> int:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return 0
    except OSError as exc:
        problems.append(f"{path.name}: unreadable ({exc.strerror or exc})")
        return 0
    lines = data.split(b"\n")
    torn = lines.pop()                       # after the last newline: empty, or a write a crash cut short
    bad = 0
    seen: dict[str, int] = {}               # id -> the line it first appears on
    for number, raw in enumerate(lines, 1):
        row, why = row_problem(raw, fields)
        if row is not None and finished and row["id"] in seen:
            why = f"id {row['id']!r} repeats line {seen[row['id']]}"
        if why is not None:
            bad += 1
            problems.append(f"{path.name} line {number}: {why}")
        elif row is not None:
            seen.setdefault(row["id"], number)
    if torn and finished:                    # a finished cell's rows were all written before its metrics
        bad += 1
        problems.append(f"{path.name} line {len(lines) + 1}: cut off (no newline) in a finished cell")
    return bad


def inspect(root: Path, row_fields: Sequence[str] = ROW_FIELDS) -> Damage:
    """Every problem of the cell folder `root` (none for a folder that does not exist yet)."""
    root = Path(root)
    damage = Damage(root.name)
    if not root.is_dir():
        return damage
    metrics = _read_json(root / METRICS, damage.problems)
    _read_json(root / ENV, damage.problems)
    _read_yaml(root / CONFIG, damage.problems)
    damage.bad_rows = _check_rows(root / PREDICTIONS, row_fields, bool(metrics and metrics.get("complete")),
                                  damage.problems)
    return damage

"""Tables from cells: summary.md / summary.csv under results/<exp>/, with how they were made and how to remake them."""
from __future__ import annotations

import csv
import io
import math
import sys
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.envinfo import static_env


def fmt(v: Any, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]], digits: int = 1) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(v, digits) for v in r) + " |" for r in rows]
    return "\n".join(lines)


_REBUILDING: list[str] | None = None    # the run's overrides while `python -m harness.report` rebuilds a summary


def command_line(cfg=None) -> str:
    """The user's command that regenerates this result: Hydra's overrides of this job (so a multirun or Ray worker
    records the user's arguments, not its own argv), the run's overrides when a summary is rebuilt from disk, else
    this process's harness arguments."""
    args = _REBUILDING
    try:
        from hydra.core.hydra_config import HydraConfig
        args = list(HydraConfig.get().overrides.task)
    except (ValueError, ImportError):
        main = Path(sys.argv[0]) if sys.argv else Path()
        if args is None and (main.name == "kvharness" or main.parts[-2:] == ("harness", "__main__.py")):
            args = sys.argv[1:]
    if args is None:
        return f"python -m harness +exp={cfg.exp.name}" if cfg is not None else "python -m harness"
    args = [a for a in args if not a.startswith(("hydra.", "hydra/"))]
    return "python -m harness " + " ".join(args) if args else "python -m harness"


def _overrides(command: str) -> list[str] | None:
    words = command.split()
    return words[3:] if words[:3] == ["python", "-m", "harness"] else None


def regenerate_command(cfg, envs: Sequence[dict] | None = None) -> str:
    """One command that remakes every cell: the cells' commands without `results_dir=` (it only says where a copy
    was written) and with their `exp.systems=` subsets merged, dropped when together they are the experiment's
    systems; the first command when the cells' commands differ in anything else."""
    commands = sorted({e.get("command_line") for e in envs or [] if e and e.get("command_line")})
    if not commands:
        return command_line(cfg)
    parsed = [_overrides(c) for c in commands]
    if any(p is None for p in parsed):
        return commands[0]
    configured = [str(s) for s in (cfg.exp.get("systems") or [])] if cfg is not None and cfg.get("exp") else []
    bases, systems = set(), []
    for words in parsed:
        subset = [w for w in words if w.startswith("exp.systems=")]
        bases.add(tuple(w for w in words if not w.startswith(("results_dir=", "exp.systems="))))
        chosen = subset[-1].split("=", 1)[1].strip("[]").split(",") if subset else configured
        systems += [s.strip(" '\"") for s in chosen if s.strip(" '\"") not in systems]
    if len(bases) > 1:
        return commands[0]
    base = list(next(iter(bases)))
    if set(systems) != set(configured):
        base.append("exp.systems=[" + ",".join(systems) + "]")
    return " ".join(["python -m harness", *base])


def provenance(cfg, envs: Sequence[dict] | None = None) -> str:
    """How the numbers were made: the cells' commands (with how many cells each made when they differ), git sha,
    code hash, CPU and versions (this process's when no cell records are given)."""
    envs = [e for e in (envs or []) if e] or [static_env()]
    env = envs[0]
    made = sorted({(e.get("git_sha") or "unknown")[:10] + ("*" if e.get("git_dirty") else "") for e in envs})
    codes = sorted({str(e.get("code_hash")) for e in envs})
    counts = Counter(e.get("command_line") for e in envs if e.get("command_line"))
    if len(counts) > 1:
        by_cells = sorted(counts.items(), key=lambda cn: (-cn[1], cn[0]))
        listed = [f"`{c}` ({n} cell{'s' if n > 1 else ''})" for c, n in by_cells]
        cmd = ", ".join(listed[:3]) + (f" and {len(listed) - 3} other commands" if len(listed) > 3 else "")
    else:
        cmd = f"`{next(iter(counts)) if counts else command_line(cfg)}`"
    mixed = " — cells from more than one code version: rerun to make them agree" if len(codes) > 1 else ""
    # a summary can be rebuilt by later code than made its cells (a reporting fix): name the code that wrote it
    writer = static_env()
    written = str(writer.get("code_hash")) not in codes
    sha = (writer.get("git_sha") or "")[:10] + ("*" if writer.get("git_dirty") else "")
    dirty = " (* = uncommitted changes)" if any(m.endswith("*") for m in made) or (written and "*" in sha) else ""
    return (f"Made by {cmd} at git {', '.join(f'`{m}`' for m in made)}, code "
            f"{', '.join(f'`{c}`' for c in codes)}{mixed}, on {env.get('cpu')} ({env.get('cpu_count')} cores, GPU: "
            f"{env.get('gpu') or 'none'}), torch {(env.get('packages') or {}).get('torch')}, transformers "
            f"{(env.get('packages') or {}).get('transformers')}"
            + (f"; this summary written by code `{writer.get('code_hash')}`" + (f" at git `{sha}`" if sha else "")
               if written else "")
            + f"{dirty}. Per-cell config.yaml and env.json sit beside this file (git-ignored raw runs).")


def length_depth_table(rows: Sequence[dict]) -> str | None:
    """Score per context length × depth (rows whose meta has both), with row/column means."""
    grid: dict[tuple, list[float]] = defaultdict(list)
    for r in rows:
        m = r.get("meta") or {}
        if "length" in m and "depth" in m:
            grid[(m["length"], m["depth"])].append(r["score"])
    if not grid:
        return None
    lengths = sorted({k[0] for k in grid})
    depths = sorted({k[1] for k in grid})

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else float("nan")

    body = []
    for L in lengths:
        cells = [mean(grid.get((L, d), [])) for d in depths]
        body.append([f"{L}", *cells, mean([s for d in depths for s in grid.get((L, d), [])])])
    body.append(["mean", *[mean([s for L in lengths for s in grid.get((L, d), [])]) for d in depths],
                 mean([s for v in grid.values() for s in v])])
    return md_table(["length \\ depth %", *[f"{d}" for d in depths], "mean"], body)


def to_csv(rows: list[dict]) -> str:
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=keys)
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def summarize_from_disk(overrides: Sequence[str], same_code: bool = False) -> dict[str, str]:
    """Rebuild an experiment's summary from the cells in its results folder (nothing runs): the grid is resolved
    from the same config a run would use; cells made by any code version are read, and the summary says which."""
    from hydra import compose, initialize_config_dir

    from harness.runner import CONF_DIR, experiment_module, pin_dtype, resolve_cells
    from harness.schema import register

    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=list(overrides))
    pin_dtype(cfg)
    module = experiment_module(cfg.exp.kind)
    if not hasattr(module, "summarize"):
        raise SystemExit(f"exp.kind {cfg.exp.kind!r} has no summary to rebuild")
    out_dir = Path(cfg.results_dir) / cfg.exp.name
    import harness.report as imported  # under `python -m harness.report` this module runs as __main__: set the copy
    imported._REBUILDING = list(overrides)   # that Summary reads
    try:
        return module.summarize(cfg, resolve_cells(cfg), out_dir, same_code=same_code)
    finally:
        imported._REBUILDING = None


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    from harness.runner import USER_ERRORS

    ap = argparse.ArgumentParser(prog="python -m harness.report",
                                 description="Rebuild results/<exp>/summary.{md,csv} and its plots from the cells on "
                                             "disk; runs no model.")
    ap.add_argument("exp", help="experiment name (conf/exp/<exp>.yaml)")
    ap.add_argument("overrides", nargs="*", help="the same key=value overrides the run used")
    args = ap.parse_args(argv)
    try:
        summarize_from_disk([f"+exp={args.exp}", *args.overrides])
    except USER_ERRORS as exc:
        print(f"error: {str(exc).strip().splitlines()[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Rebuild an experiment's summary, tables and plots from the cells on disk (`python -m harness.report EXP`)."""
from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from harness.running import envinfo


def summarize_from_disk(overrides: Sequence[str], same_code: bool = False) -> dict[str, str]:
    """Rebuild an experiment's summary from the cells in its results folder (nothing runs): the grid is resolved
    from the same config a run would use; cells made by any code version are read, and the summary says which."""
    from hydra import compose, initialize_config_dir

    from harness.running.runner import CONF_DIR, experiment_module, pin_dtype, resolve_cells
    from harness.running.schema import register

    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=list(overrides))
    pin_dtype(cfg)
    module = experiment_module(cfg.exp.kind)
    if not hasattr(module, "summarize"):
        raise SystemExit(f"exp.kind {cfg.exp.kind!r} has no summary to rebuild")
    out_dir = Path(cfg.results_dir) / cfg.exp.name
    envinfo.REBUILDING = list(overrides)
    try:
        return module.summarize(cfg, resolve_cells(cfg), out_dir, same_code=same_code)
    finally:
        envinfo.REBUILDING = None


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    from harness.running.runner import USER_ERRORS

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

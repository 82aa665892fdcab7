"""Rebuild an experiment's summary, tables and plots from the cells on disk (`python -m harness.report EXP`)."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from harness.running import envinfo


def summarize_from_disk(overrides: Sequence[str], same_code: bool = False) -> dict[str, str]:
    """Rebuild an experiment's summary from the cells in its results folder (nothing runs): the grid is resolved
    from the same config a run would use; cells made by any code version are read, and the summary says which."""
    from harness.running import models
    from harness.running.config import compose
    from harness.running.driver import prepare, run_models, summarize

    cfg = compose(list(overrides))
    if models.has_models(cfg):          # each model's summary, then the one across models
        envinfo.REBUILDING = list(overrides)
        try:
            run_models(cfg, same_code=same_code, execute=False)
            return {}
        finally:
            envinfo.REBUILDING = None
    experiment, run = prepare(cfg, same_code=same_code)
    envinfo.REBUILDING = list(overrides)
    try:
        return summarize(experiment, run)
    finally:
        envinfo.REBUILDING = None
        run.workspace.close()


def main(argv: Sequence[str] | None = None) -> int:
    from harness.running.config import USER_ERRORS

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

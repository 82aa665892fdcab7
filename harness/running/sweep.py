"""A Hydra multirun seen as one run: the sweep's command in every cell's provenance, one summary after the last job.

`python -m harness -m ... system=dense,streaming` launches one job per combination; each job runs its cells and
writes no summary (harness.running.driver). When the launcher returns, `summarize_sweep` rebuilds the summary of
each results folder the jobs wrote into, once, from the cells on disk, and prints its closing lines — so the console
ends with one at-a-glance block, not one per job. Every cell's env.json records the sweep's command (set here for
the jobs, which may run in other processes), so "Regenerate" names the sweep, not one job of it.
"""
from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

from harness.running.envinfo import SWEEP_ENV

MULTIRUN_FLAGS = ("-m", "--multirun")


def is_sweep(argv: list[str]) -> bool:
    return any(a in MULTIRUN_FLAGS for a in argv)


def _overrides(argv: list[str]) -> list[str]:
    return [a for a in argv if not a.startswith("-")]


def _ours(override: str) -> bool:
    """An override of the harness's config, not of Hydra's own (launcher, sweep dir): what a rerun needs."""
    return not override.lstrip("+~").startswith(("hydra.", "hydra/"))


def sweep_command(argv: list[str]) -> str:
    """The command that reruns the whole sweep (Hydra's own settings and where results were copied left out)."""
    keep = [a for a in _overrides(argv) if _ours(a) and not a.startswith("results_dir=")]
    return " ".join(["python -m harness -m", *keep])


def announce(argv: list[str]) -> None:
    """Tell the jobs (this process's, or a launcher's workers: they inherit the environment) the sweep's command."""
    os.environ[SWEEP_ENV] = sweep_command(argv)


def job_overrides(argv: list[str]) -> list[list[str]]:
    """Every job's overrides, as Hydra's basic sweeper expands them (the cartesian product of the sweep lists)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides([a for a in _overrides(argv) if _ours(a)])
    choices = []
    for o in parsed:
        if o.is_sweep_override():
            key = o.get_key_element()
            choices.append([f"{key}={value}" for value in o.sweep_string_iterator()])
        else:
            choices.append([str(o.input_line)])
    return [list(job) for job in itertools.product(*choices)]


def summarize_sweep(argv: list[str]) -> dict[Path, dict[str, str]]:
    """One summary per results folder the sweep's jobs wrote into, rebuilt from its cells (the last job's config
    names the grid; the cells of every job with the same experiment block join it), printed once."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    from harness.reporting.rebuild import summarize_from_disk
    from harness.running.config import USER_ERRORS, compose

    GlobalHydra.instance().clear()          # the finished sweep's; composing again needs a fresh one
    HydraConfig.instance().cfg = None       # its last job's, which is not this process's
    folders: dict[Path, list[str]] = {}
    for overrides in job_overrides(argv):
        cfg = compose(overrides)
        folders[Path(cfg.results_dir) / str(cfg.exp.name)] = overrides
    written: dict[Path, dict[str, str]] = {}
    for folder, overrides in folders.items():
        try:
            written[folder] = summarize_from_disk(overrides, same_code=True)
        except USER_ERRORS as exc:
            print(f"error: no summary for {folder}: {str(exc).strip().splitlines()[0]}", file=sys.stderr)
    return written

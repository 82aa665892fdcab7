"""Hydra entry point: `python -m harness +exp=NAME key=value ...` (and `-m` for multirun sweeps)."""
from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from harness.running.schema import register

register()


def one_line(exc: BaseException) -> str:
    """Hydra/OmegaConf errors span several lines and hide the cause; keep what names the fix, on one line."""
    parts: list[str] = []
    seen: set[str] = set()
    cause: BaseException | None = exc
    while cause is not None and len(parts) < 3:
        for line in str(cause).splitlines():
            line = line.strip()
            if line and not line.startswith(("full_key", "object_type", "reference_type")) and line not in seen:
                seen.add(line)
                parts.append(line.rstrip("."))
        cause = cause.__cause__ or cause.__context__
    return "; ".join(parts)


def precheck(argv: list[str]) -> None:
    """Compose the command line once before Hydra runs, so a typo or a wrong type exits with one line."""
    from hydra import compose, initialize_config_dir

    from harness.running.config import CONF_DIR, check_no_extra_keys

    if any(a in ("-m", "--multirun") or a.startswith("-") for a in argv):
        return  # sweeps, --help, --cfg: each job is still validated by the runner before any work
    overrides = [a for a in argv if not a.startswith(("hydra.", "hydra/", "+hydra", "~hydra"))]
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = compose(config_name="config", overrides=overrides)
        check_no_extra_keys(cfg)
    except Exception as exc:  # noqa: BLE001 - every composition error is a user error here
        print(f"error: {one_line(exc)} (see `python -m harness --cfg job` for valid keys)", file=sys.stderr)
        sys.exit(2)


# an absolute folder: the `kvharness` console script has no package-relative path to conf/
@hydra.main(version_base=None, config_path=str(Path(__file__).resolve().parents[1] / "conf"), config_name="config")
def main(cfg: DictConfig) -> None:
    from harness.running.config import UserError
    from harness.running.driver import run

    try:
        run(cfg)
    except UserError as exc:
        # One line that names the fix; nothing has been written to the store yet.
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


def cli() -> None:
    """`kvharness ...` and `python -m harness ...`: our --help (what can be run), a one-line precheck, then Hydra."""
    argv = sys.argv[1:]
    if argv and argv[0] in ("-h", "--help"):
        from harness.running.catalog import help_text
        print(help_text())
        return
    precheck(argv)
    from harness.running import sweep

    if sweep.is_sweep(argv):
        sweep.announce(argv)        # the jobs record the sweep's command; none of them writes the summary
    main()
    if sweep.is_sweep(argv):
        sweep.summarize_sweep(argv)  # one summary per results folder, after the last job


if __name__ == "__main__":  # the guard matters: vLLM spawns a process that re-imports this module
    cli()

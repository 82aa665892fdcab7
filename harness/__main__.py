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


MAX_PRECHECKED_JOBS = 64          # a sweep's jobs composed by the precheck (each value of each swept key once)


def job_overrides(overrides: list[str], multirun: bool) -> list[list[str]]:
    """The override lists the precheck composes: the command line, or under -m each value of each swept key once
    (beside the first value of every other key), so a typo in any value fails before Hydra launches a job."""
    if not multirun:
        return [overrides]
    from hydra.core.override_parser.overrides_parser import OverridesParser

    choices: list[list[str]] = []
    for line, override in zip(overrides, OverridesParser.create().parse_overrides(overrides)):
        if not override.is_sweep_override():
            choices.append([line])
            continue
        try:
            key = override.get_key_element()
            choices.append([f"{key}={v}" for v in override.sweep_string_iterator()])
        except Exception:  # noqa: BLE001 - a glob over a group is expanded against conf/ by Hydra's sweeper only
            continue
    first = [values[0] for values in choices]
    jobs = [first]
    for i, values in enumerate(choices):
        jobs += [first[:i] + [v] + first[i + 1:] for v in values[1:]]
    return jobs[:MAX_PRECHECKED_JOBS]


def precheck(argv: list[str]) -> None:
    """Compose the command line once before Hydra runs, so a typo, a wrong type or a path outside results_dir exits
    with one line; also under -m (every swept value), --cfg and Hydra's other flags."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.utils import get_args_parser

    from harness.running.config import CONF_DIR, UserError, check_no_extra_keys, check_paths

    args, unknown = get_args_parser().parse_known_args(argv)
    options = [a for a in unknown if a.startswith("-")]
    if options:
        fail(f"unknown option(s) {options}; see `python -m harness --help` (and --hydra-help for Hydra's)")
    if unknown:                             # Hydra's parser reads the overrides as one group, not between options
        fail(f"{unknown} are split from the other key=value overrides by an option, where Hydra does not read them; "
             "put every key=value together before the options (e.g. `python -m harness +exp=quickstart seed=1 "
             "--cfg job`)")
    if args.help or args.hydra_help or args.shell_completion or args.info or args.experimental_rerun:
        return                              # Hydra answers these itself and runs nothing
    config_dir = Path(args.config_path) if args.config_path else CONF_DIR
    if not config_dir.is_absolute():        # as Hydra reads --config-path: relative to this module's folder
        config_dir = Path(__file__).resolve().parent / config_dir
    overrides = [a for a in args.overrides if not a.startswith(("hydra.", "hydra/", "+hydra", "~hydra"))]
    if args.config_dir:
        overrides.append(f"hydra.searchpath=[file://{Path(args.config_dir).resolve()}]")
    try:
        jobs = job_overrides(overrides, args.multirun)
        for job in jobs:
            with initialize_config_dir(config_dir=str(config_dir), version_base=None):
                cfg = compose(config_name=args.config_name or "config", overrides=job)
            check_no_extra_keys(cfg)
            if args.cfg is None:            # --cfg only prints the config: no folder is made, so any name is fine
                check_paths(cfg)
    except UserError as exc:
        fail(str(exc))
    except Exception as exc:  # noqa: BLE001 - every composition error is a user error here
        fail(f"{one_line(exc)} (see `python -m harness --cfg job` for valid keys)")


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
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

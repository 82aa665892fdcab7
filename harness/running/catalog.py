"""What can be run: the experiments, systems, tasks and models of conf/, each with its file's first comment line."""
from __future__ import annotations

from pathlib import Path

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
GROUPS = {"exp": "experiments (+exp=NAME)", "system": "systems (system=NAME, exp.systems=[...])",
          "task": "tasks (task=NAME, exp.tasks=[...])", "model": "models (model=NAME)",
          "tracking": "experiment tracking (tracking=NAME, tracking.uri=...)"}


def describe(path: Path) -> str:
    """The first comment line of a conf file (its one-line description)."""
    for line in path.read_text().splitlines():
        if line.startswith("#") and "@package" not in line:
            return line.lstrip("#").strip()
        if line.strip() and not line.startswith("#"):
            break
    return ""


def entries(group: str, conf_dir: Path = CONF_DIR) -> list[tuple[str, str]]:
    return [(p.stem, describe(p)) for p in sorted((conf_dir / group).glob("*.yaml"))]


def help_text(conf_dir: Path = CONF_DIR) -> str:
    lines = ["usage: kvharness +exp=NAME [key=value ...]    (= python -m harness ...; -m for a multirun sweep)",
             "",
             "Runs an experiment's grid of systems x tasks; finished cells are kept under results/<exp>/ and reused.",
             "Rebuild a summary from disk: python -m harness.report EXP.  Resolved config: kvharness --cfg job.",
             "Hydra's own options: kvharness --hydra-help."]
    for group, title in GROUPS.items():
        rows = entries(group, conf_dir)
        width = max((len(name) for name, _ in rows), default=0)
        lines += ["", f"{title}:"] + [f"  {name:<{width}}  {text}" for name, text in rows]
    return "\n".join(lines)

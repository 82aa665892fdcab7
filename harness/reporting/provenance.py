"""How a summary says it was made: the command that regenerates every cell, git sha, code hash, machine, versions."""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from harness.running.envinfo import command_line, static_env


def _overrides(command: str) -> list[str] | None:
    words = command.split()
    return words[3:] if words[:3] == ["python", "-m", "harness"] else None


def regenerate_command(cfg: Any, envs: Sequence[dict] | None = None) -> str:
    """One command that remakes every cell: the sweep's command when every cell came from one multirun; else the
    cells' commands without `results_dir=` (it only says where a copy was written) and with their `exp.systems=`
    subsets merged, dropped when together they are the experiment's systems; the first command when the cells'
    commands differ in anything else."""
    sweeps = {e.get("sweep_command") for e in envs or [] if e}
    if len(sweeps) == 1 and None not in sweeps:        # every cell came from one multirun: rerun the sweep
        return str(next(iter(sweeps)))
    commands: list[str] = sorted({str(e["command_line"]) for e in envs or [] if e and e.get("command_line")})
    if not commands:
        return command_line(cfg)
    parsed = [words for c in commands if (words := _overrides(c)) is not None]
    if len(parsed) < len(commands):
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


def provenance(cfg: Any, envs: Sequence[dict] | None = None) -> str:
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

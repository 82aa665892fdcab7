"""One writer for every experiment's summary.md / summary.csv: experiments hand it content, it owns the layout.

Layout: `# title`, the **At a glance:** paragraph, sections (heading, prose, tables, images), then the footer every
result carries: the command that regenerates it, what it cost, and how it was made (git sha, code hash, dtype,
machine class, versions). Files are written whole and renamed, so a reader never sees half a summary.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.reporting import provenance, tables
from harness.running.envinfo import command_line, machine_class, static_env
from harness.running.store import atomic_write_text
from systems.hardware import dtype_name

log = logging.getLogger("kvharness")


class Summary:
    def __init__(self, cfg: Any, title: str | None = None, envs: list[dict] | None = None):
        """`envs`: the env.json records of the cells the numbers come from (their commands, commits and machine
        make the footer); default: this process's."""
        self.cfg = cfg
        self.envs = [e for e in (envs or []) if e]
        self.title = title or cfg.exp.name
        self.glance_text: str | None = None
        self.parts: list[str] = []
        self.csv_rows: list[dict] = []
        self.paths: dict[str, str] = {}
        self.cost: str | None = None
        self.notes: list[str] = []

    def glance(self, text: str, bullets: Sequence[str] = ()) -> Summary:
        self.glance_text = "**At a glance:** " + text + ("\n\n" + "\n".join(f"- {b}" for b in bullets)
                                                         if bullets else "")
        return self

    def section(self, heading: str) -> Summary:
        self.parts += [f"## {heading}", ""]
        return self

    def text(self, paragraph: str) -> Summary:
        if paragraph:
            self.parts += [paragraph, ""]
        return self

    def reasons(self, size_reason: str = "", budget_reason: str = "", budget: int | None = None) -> Summary:
        """Why the committed grid has this size and budget (exp.params.size_reason / budget_reason); a run whose
        command changed the experiment block says the reasons are for the committed configuration."""
        changed = [a for a in command_line(self.cfg).split()[3:]
                   if a.lstrip("+").startswith("exp.") and "_reason" not in a]
        note = (f" *This run changed the committed grid ({', '.join(f'`{a}`' for a in changed)}): the reasoning is "
                "for the committed configuration.*") if changed else ""
        if size_reason:
            self.text(f"**Why this size:** {size_reason}{note}")
        if budget_reason:
            what = f"{budget} tokens" if budget else "this budget"
            self.text(f"**Why {what}:** {budget_reason}")
        return self

    def table(self, header: Sequence[str], rows: Sequence[Sequence[Any]], digits: int = 1) -> Summary:
        if rows:
            self.parts += [tables.md_table(header, rows, digits), ""]
        return self

    def image(self, key: str, path: str | None, alt: str | None = None) -> Summary:
        """Record a written PNG and show it (beside summary.md, so the link is its bare name)."""
        if path:
            self.paths[key] = str(path)
            self.parts += [f"![{alt or Path(path).stem}]({Path(path).name})", ""]
        return self

    def csv(self, rows: Sequence[dict]) -> Summary:
        self.csv_rows += list(rows)
        return self

    def note(self, text: str) -> Summary:
        """A paragraph placed after the sections, before the footer (e.g. systems a shared budget left out)."""
        self.notes.append(text)
        return self

    def took(self, seconds: float | None, what: str = "") -> Summary:
        """State the run's cost (wall time of its cells, all sessions together)."""
        if seconds is not None and math.isfinite(seconds) and seconds > 0:
            hours = seconds / 3600
            self.cost = (f"{seconds / 60:.0f} min" if hours < 1 else f"{hours:.1f} h") + (f" ({what})" if what else "")
        return self

    def footer(self) -> list[str]:
        env = self.envs[0] if self.envs else static_env()
        dtype = dtype_name(self.cfg.model.dtype) if self.cfg.get("model") is not None else None
        lines = [f"Regenerate: `{provenance.regenerate_command(self.cfg, self.envs)}`."]
        if self.cost:
            lines.append(f"Cost: {self.cost} on this machine.")
        lines.append(f"Machine class: {machine_class(env)}" + (f"; model dtype {dtype}." if dtype else "."))
        lines.append(provenance.provenance(self.cfg, self.envs))
        return [line for part in lines for line in (part, "")]

    def render(self) -> str:
        head = [f"# {self.title}", ""] + ([self.glance_text, ""] if self.glance_text else [])
        notes = [line for text in self.notes for line in (text, "")]
        return "\n".join(head + self.parts + notes + self.footer())

    def write(self, out_dir: Path) -> dict[str, str]:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        md, csv_path = out_dir / "summary.md", out_dir / "summary.csv"
        atomic_write_text(md, self.render())
        paths = {"md": str(md)}
        if self.csv_rows:
            atomic_write_text(csv_path, tables.to_csv(self.csv_rows))
            paths["csv"] = str(csv_path)
        return {**paths, **self.paths}


def cell_envs(metrics: list[dict]) -> list[dict]:
    """The env records that harness.running.cells attaches to metrics read from disk (`_env`)."""
    return [m["_env"] for m in metrics if isinstance(m, dict) and m.get("_env")]


def print_paths(paths: dict[str, str]) -> None:
    """The summary on stdout (the tables a user runs the experiment for); the files written, in the log."""
    print(Path(paths["md"]).read_text(), flush=True)
    for kind, path in paths.items():
        log.info("wrote %s: %s", kind, path)

"""One writer for every experiment's summary: summary.md, tidy CSVs and results.json; experiments hand it content.

Layout of summary.md: `# title`, the **At a glance:** paragraph, sections (heading, prose, tables, images), then the
footer every result carries: the command that regenerates it, what it cost, and how it was made (git sha, code hash,
dtype, machine class, versions). Tables for machines go to CSV files, one row type per file (`csv(rows, name)` ->
`<name>.csv`), and all of them, with the config, budget, versions and machine class, to results.json
(harness.reporting.results_file). Files are written whole and renamed, so a reader never sees half a summary.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.reporting import provenance, results_file, tables
from harness.running.envinfo import command_line, machine_class, static_env
from harness.running.store import atomic_write_text
from systems.hardware import dtype_name

log = logging.getLogger("kvharness")


def generation_work(params: Any) -> str:
    """What an accuracy run's cost covers: the teacher-forced fidelity pass only where the run made one."""
    fidelity = params.get("fidelity") if hasattr(params, "get") else getattr(params, "fidelity", None)
    return "generation + fidelity, every cell" if fidelity else "generation, every cell"


class Summary:
    def __init__(self, cfg: Any, title: str | None = None, envs: list[dict] | None = None):
        """`envs`: the env.json records of the cells the numbers come from (their commands, commits and machine
        make the footer); default: this process's."""
        self.cfg = cfg
        self.envs = [e for e in (envs or []) if e]
        self.title = title or cfg.exp.name
        self.glance_text: str | None = None
        self.parts: list[str] = []
        self.tables: dict[str, list[dict]] = {}
        self.records: list[dict] = []
        self.paths: dict[str, str] = {}
        self.cost: str | None = None
        self.seconds: float | None = None
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

    def budget_text(self) -> str:
        """The run's KV budget in words: kvpress's ratio, a shared budget, a sweep's budgets, or none; and a
        query-agnostic run says so (a figure of one mode must not pass for the other)."""
        params = self.cfg.exp.get("params") or {} if self.cfg.get("exp") is not None else {}
        mode = params.get("compression")
        return self._budget_words(params) + (f", {str(mode).replace('_', '-')}" if mode not in (None, "query_aware")
                                             else "")

    @staticmethod
    def _budget_words(params: Any) -> str:
        if params.get("compression_ratio") is not None:
            return f"kvpress compression_ratio {float(params['compression_ratio']):g} (budget per sample)"
        if params.get("budget") is not None:
            return f"budget {params['budget']} tokens per layer and KV head"
        if params.get("budgets"):
            return f"budgets {', '.join(str(b) for b in params['budgets'])} tokens per layer and KV head"
        return "no shared KV budget (each system as configured)"

    def figure_note(self, n: str) -> str:
        """The line under every figure: its n (`n = 44 per system`), the budget and the machine class."""
        env = self.envs[0] if self.envs else static_env()
        return f"{n} · {self.budget_text()} · {machine_class(env)}"

    def csv(self, rows: Sequence[dict], name: str = "summary") -> Summary:
        """Rows of one kind for `<name>.csv` (and results.json's tables): one row type per file, so a reader never
        filters rows by a marker column."""
        self.tables.setdefault(name, []).extend(rows)
        return self

    def results(self, records: Sequence[dict]) -> Summary:
        """results.json's per-unit records (accuracy kinds: harness.reporting.results_file.unit_records)."""
        self.records += list(records)
        return self

    def note(self, text: str) -> Summary:
        """A paragraph placed after the sections, before the footer (e.g. systems a shared budget left out)."""
        self.notes.append(text)
        return self

    def took(self, seconds: float | None, what: str = "") -> Summary:
        """State the run's cost (wall time of its cells, all sessions together)."""
        if seconds is not None and math.isfinite(seconds) and seconds > 0:
            self.seconds = seconds
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

    def meta(self) -> dict[str, Any]:
        """results.json's description of the run: experiment, config, budget, versions, machine, provenance."""
        from omegaconf import OmegaConf

        env = self.envs[0] if self.envs else static_env()
        cfg = self.cfg
        params = cfg.exp.get("params") or {} if cfg.get("exp") is not None else {}
        config = {k: OmegaConf.to_container(cfg[k], resolve=True) if OmegaConf.is_config(cfg[k]) else cfg[k]
                  for k in ("model", "exp", "seed") if cfg.get(k) is not None}
        envs = self.envs or [env]
        return {
            "experiment": {"name": str(cfg.exp.name), "kind": str(cfg.exp.get("kind", "")), "title": self.title,
                           "glance": self.glance_text.removeprefix("**At a glance:** ") if self.glance_text else None},
            "config": config,
            "budget": {"tokens": params.get("budget"), "budgets": list(params.get("budgets") or []) or None,
                       "compression_ratio": params.get("compression_ratio")},
            "versions": {"python": env.get("python"), "packages": dict(env.get("packages") or {})},
            "machine": {"class": machine_class(env), "cpu": env.get("cpu"), "cpu_count": env.get("cpu_count"),
                        "gpu": env.get("gpu"), "matrix_isa": env.get("matrix_isa"),
                        "model_dtype": dtype_name(cfg.model.dtype) if cfg.get("model") is not None else None},
            "provenance": {"regenerate": provenance.regenerate_command(cfg, self.envs),
                           "commands": sorted({str(e["command_line"]) for e in envs if e.get("command_line")}),
                           "git_shas": sorted({str(e.get("git_sha")) for e in envs}),
                           "code_hashes": sorted({str(e.get("code_hash")) for e in envs}),
                           "cost_seconds": self.seconds},
        }

    def write(self, out_dir: Path) -> dict[str, str]:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        md = out_dir / "summary.md"
        atomic_write_text(md, self.render())
        paths = {"md": str(md)}
        written = {f"{name}.csv" for name, rows in self.tables.items() if rows}
        for stale in out_dir.glob("*.csv"):           # a table this summary no longer has (or an older layout's)
            if stale.name not in written:
                stale.unlink()
        for name, rows in self.tables.items():
            if rows:
                atomic_write_text(out_dir / f"{name}.csv", tables.to_csv(rows))
                paths[f"csv_{name}"] = str(out_dir / f"{name}.csv")
        doc = results_file.document(self.meta(), {n: r for n, r in self.tables.items() if r}, self.records)
        atomic_write_text(out_dir / "results.json", results_file.dumps(doc))
        paths["json"] = str(out_dir / "results.json")
        return {**paths, **self.paths}


def cell_envs(metrics: list[dict]) -> list[dict]:
    """The env records that harness.running.cells attaches to metrics read from disk (`_env`)."""
    return [m["_env"] for m in metrics if isinstance(m, dict) and m.get("_env")]


def glance_lines(lines: list[str]) -> list[str]:
    """A summary's '**At a glance:**' paragraph and the bullet list that may follow it."""
    start = next((i for i, line in enumerate(lines) if line.startswith("**At a glance:**")), None)
    if start is None:
        return []
    out, i = [lines[start]], start + 1
    while i < len(lines):
        j = i
        while j < len(lines) and not lines[j].strip():
            j += 1
        if j < len(lines) and lines[j].startswith("- "):
            out += [""] * (j - i)
            while j < len(lines) and lines[j].startswith("- "):
                out.append(lines[j])
                j += 1
            i = j
            continue
        break
    return out


def console_lines(paths: dict[str, str]) -> list[str]:
    """What a run prints last: its title, where its tables and figures went, then the at-a-glance block, so the
    lines a user reads first are the ones above the prompt (the tables are in the files)."""
    md = Path(paths["md"])
    lines = md.read_text().splitlines()
    title = lines[0].removeprefix("# ") if lines else md.parent.name
    names = [Path(p).name + ("/" if Path(p).is_dir() else "") for k, p in paths.items() if k != "md"]
    glance = [line.replace("**", "") for line in glance_lines(lines)]
    return [f"{title}: {md}" + (f" (with {', '.join(names)} in {md.parent})" if names else ""), "", *glance]


def print_paths(paths: dict[str, str]) -> None:
    """The run's closing lines on stdout (console_lines); every file written, in the log."""
    for kind, path in paths.items():
        log.debug("wrote %s: %s", kind, path)
    print("\n".join(console_lines(paths)), flush=True)

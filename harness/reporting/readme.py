"""Rebuild README.md's quickstart and results blocks from the committed results/*/summary.md files.

    python -m harness.reporting.readme            # rewrite README.md in place
    python -m harness.reporting.readme --check    # exit 1 (and say which block) when README.md is out of date

The README quotes the summaries instead of restating them by hand, so a rerun plus this command is the whole
update, and tests/test_readme.py fails when a summary changed and the README did not follow. Only what git holds
is quoted (committed or staged: `git add results/<exp>` first), and only the experiments SECTIONS lists: a local
`make run`, a scratch folder (`results/default`) or a multirun's folder never reaches the README. Each section ends
with the cost and machine class its summary records, so no figure in the README is restated by hand.
"""
from __future__ import annotations

import argparse
import io
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from harness.reporting.summary import glance_lines
from harness.running.catalog import describe

ROOT = Path(__file__).resolve().parents[2]

# The committed experiments, in reading order (score vs budget first: it is the headline accuracy figure), each with
# the line its README heading carries (None: the first comment line of conf/exp/<name>.yaml). A results folder not
# listed here never reaches the README: a committed run is added here in the commit that adds its summary.
SECTIONS: dict[str, str | None] = {
    "budget_sweep": "score and fidelity vs token budget, one curve per policy (CAKE F5 style)",
    "accuracy_retention": "per-task retention of every policy at one budget (FlexiCache T2/T3, CAKE T1 style)",
    "shared_context": "every policy query-aware, query-agnostic and with k questions reading one compressed "
                      "context (kvpress's query-agnostic protocol, SCBench's shared context)",
    "ruler": "RULER's 11 synthetic tasks per context length, dense vs each policy",
    "needlebench": "S-RT / M-RT / M-RS scores and length × depth heatmaps per system (CAKE F6)",
    "offline_throughput": "tokens/s of engine-dense, vLLM and HF on the same requests (16 × (4000 in + 256 out))",
    "online_sweep": "TTFT / TPOT vs Poisson request rate over HTTP (FlexiCache F6)",
    "decode_roofline": "the whole decode step of dense and every policy against the memory roofline, per batch and "
                       "context",
    "decode_microbench": "per-layer decode latency, dense vs sparse and stability-aware vs naive (FlexiCache F7/F8)",
    "memory": "device-tier KV per request vs length with the analytic bound (FlexiCache F9) and CAKE prefill peak "
              "(CAKE F7)",
    "head_stability": "FlexiCache head profiling: RCO vs offset, unstable sets, cross-task overlap, promoted share "
                      "(F1, T1, T7)",
    "cake_ablation": "CAKE allocation × indicator and τ sweep (CAKE T2, T3, F8, F13)",
    "duo_attention": "DuoAttention-style gate training that picks LServe's streaming heads",
    "model_transfer": "whether the policy ranking carries over from SmolLM2-135M to Gemma-3-270M (Kendall τ, flipped "
                      "pairs)",
    "batch_invariance_cost": None,
    "loaded_host": None,
    "online_sweep_memory": None,
}
EXTRA_LINKS = {"profile.md": "where the engine's time goes"}
# The speed workloads the performance block leads with: per workload its ratio to vLLM (offline, online) and the
# decode step's distance to the memory roofline, each quoted from its committed summary's glance
PERFORMANCE = ("offline_throughput", "online_sweep", "online_sweep_memory", "decode_roofline")
RESULTS_INTRO = ("Every number below is quoted from a committed `results/<exp>/summary.md` of a real run; each section "
                 "closes with the cost and machine class its summary records, and the summary with its command, git "
                 "sha and versions.")


def _regenerate(lines: list[str], name: str) -> str:
    for line in lines:
        match = re.match(r"Regenerate: `([^`]+)`", line)
        if match:
            return match.group(1)
    return f"python -m harness +exp={name} progress=false"


def _describe(name: str, root: Path) -> str:
    if SECTIONS.get(name):
        return str(SECTIONS[name])
    conf = root / "conf" / "exp" / f"{name}.yaml"
    return (describe(conf) if conf.exists() else "") or name


def results_block(root: Path = ROOT) -> str:
    results = root / "results"
    names = [n for n in SECTIONS if (results / n / "summary.md").exists()]
    parts = [RESULTS_INTRO]
    for name in names:
        folder = results / name
        lines = (folder / "summary.md").read_text().splitlines()
        files = ["summary.md", *sorted(p.name for p in folder.glob("*.csv")), "results.json"]
        links = [f"[{f}](results/{name}/{f})" for f in files if (folder / f).exists()]
        links += [f"[{text}](results/{name}/{f})" for f, text in EXTRA_LINKS.items() if (folder / f).exists()]
        text = "\n".join(lines)
        # in the summary's own order, so the figure it leads with (its headline) leads here too
        order = sorted(folder.glob("*.png"), key=lambda p: (text.find(f"({p.name})") % (len(text) + 1), p.name))
        pngs = " ".join(f"![{p.name}](results/{name}/{p.name})" for p in order)
        parts += [f"### `{name}` — {_describe(name, root)}", "\n".join(glance_lines(lines)), " · ".join(links)]
        if pngs:
            parts.append(pngs)
        parts.append(f"Regenerate: `{_regenerate(lines, name)}`")
        parts.append(" ".join(line for line in lines if line.startswith(("Cost:", "Machine class:"))))
    pending = sorted(c.stem for c in (root / "conf" / "exp").glob("*.yaml")
                     if not c.stem.endswith("_paper") and c.stem != "quickstart" and c.stem not in names)
    if pending:
        parts.append("No summary committed yet (a run of each is pending; its summary appears here when it lands): "
                     + ", ".join(f"`{n}`" for n in pending) + ".")
    return "\n\n".join(p for p in parts if p)


def performance_block(root: Path = ROOT) -> str:
    """Per speed workload with a committed summary: its glance (ratio to vLLM, distance to the roofline), the machine
    class it ran on and a link; the workloads not yet committed are named."""
    parts, missing = [], []
    for name in PERFORMANCE:
        path = root / "results" / name / "summary.md"
        if not path.exists():
            missing.append(name)
            continue
        lines = path.read_text().splitlines()
        machine = next((line.removeprefix("Machine class: ") for line in lines if line.startswith("Machine class: ")),
                       "")
        glance = "\n".join(glance_lines(lines)).removeprefix("**At a glance:** ")
        parts.append(f"**`{name}`** ([summary](results/{name}/summary.md); {machine.rstrip('.')}): {glance}")
    if missing:
        parts.append("Not committed yet: " + ", ".join(f"`{n}`" for n in missing) + ".")
    return "\n\n".join(parts)


def quickstart_block(root: Path = ROOT) -> str:
    """The quickstart summary without its title, images and footer (the README has its own), its sections one heading
    level down, closed by the machine class, commit and path the numbers come from."""
    path = root / "results" / "quickstart" / "summary.md"
    lines = path.read_text().splitlines()
    body = []
    for line in lines[1:]:
        if line.startswith(("Regenerate:", "Made by ", "![", "Cost:", "Machine class:")):
            continue
        body.append("####" + line[2:] if line.startswith("## ") else line)
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(body)).strip()
    made = next((line for line in lines if line.startswith("Made by ")), "")
    sha = re.search(r"at git `([0-9a-f]+)", made)
    machine = next((line.removeprefix("Machine class: ").rstrip(".") for line in lines
                    if line.startswith("Machine class: ")), "SmolLM2-135M-Instruct")
    cost = next((line.removeprefix("Cost: ").rstrip(".") for line in lines if line.startswith("Cost: ")), None)
    where = f"git `{sha.group(1)}`, " if sha else ""
    return f"{text}\n\n({machine}; {f'cost {cost}; ' if cost else ''}{where}`results/quickstart/summary.md`.)"


def committed_root(into: Path, root: Path = ROOT) -> Path:
    """results/ and conf/exp/ as git holds them (committed or staged) unpacked under `into`, so a local rerun (`make
    run` rewrites results/quickstart) or a scratch folder never reaches the README; outside a git checkout, `root`."""
    git = ["git", "-C", str(root)]
    try:
        tree = subprocess.run([*git, "write-tree"], capture_output=True, text=True, check=True).stdout.strip()
        tar = subprocess.run([*git, "archive", tree, "results", "conf/exp"], capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return root
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        archive.extractall(into, filter="data")
    return into


def render(readme: str, root: Path = ROOT) -> str:
    if "<!-- performance -->" in readme:          # optional: a README may quote the speed workloads apart
        pattern = re.compile(r"(<!-- performance -->\n).*?(\n<!-- /performance -->)", re.S)
        block = performance_block(root)
        readme = pattern.sub(lambda m: m.group(1) + block + m.group(2), readme)
    for tag, block in (("quickstart", quickstart_block(root)), ("results", results_block(root))):
        pattern = re.compile(rf"(<!-- {tag} -->\n).*?(\n<!-- /{tag} -->)", re.S)
        if not pattern.search(readme):
            raise SystemExit(f"README.md has no <!-- {tag} --> ... <!-- /{tag} --> block; add the two marker lines")
        readme = pattern.sub(lambda m: m.group(1) + block + m.group(2), readme)   # noqa: B023 - used at once
    return readme


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only say whether README.md is up to date")
    args = ap.parse_args(argv)
    path = ROOT / "README.md"
    old = path.read_text()
    with tempfile.TemporaryDirectory() as tmp:
        new = render(old, committed_root(Path(tmp)))
    if args.check:
        if new != old:
            print("README.md is out of date with the committed results/*/summary.md: run `python -m "
                  "harness.reporting.readme`")
            return 1
        return 0
    if new != old:
        path.write_text(new)
        print("README.md: quickstart, performance and results blocks rebuilt")
    return 0


if __name__ == "__main__":
    sys.exit(main())

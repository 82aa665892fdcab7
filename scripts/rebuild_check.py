"""Prove that summaries rebuilt from cells on disk match the ones the run wrote: every experiment kind at toy scale.

The committed summaries under results/ come from raw cells that are not in git, so a refactor of the harness is
checked on toy runs instead: `run` executes each kind on a tiny random model with the code of `--tree` (e.g. a
worktree of the old commit) and keeps the summaries that run wrote; `compare` rebuilds every summary from the same
cells with the code of this checkout (`python -m harness.report`) and diffs them. Only the provenance line ("Made by
... this summary written by code ...") may differ; anything else is printed and makes the exit status 1.

    python scripts/rebuild_check.py model  --out /tmp/kv                     # the tiny model (once)
    python scripts/rebuild_check.py run    --out /tmp/kv --tree ../old-tree  # cells + summaries by the old code
    python scripts/rebuild_check.py compare --out /tmp/kv                    # rebuilt by this checkout, diffed
    python scripts/rebuild_check.py rerun  --out /tmp/kv --kinds accuracy_retention   # run again by this checkout

`rerun` runs the kinds again with this checkout into <out>/rerun/ and compares what every sample generated (the
token ids and score of each row of each accuracy cell) and the summaries (timings and provenance aside): a change
to the runner or a policy that moves a single token shows up here.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOY = ["model.dtype=float32", "model.max_input_tokens=1000", "model.max_model_len=2048", "progress=false"]
SRT = "needlebench_srt:{lengths:[300],depths:[10,50,90],max_new_tokens:4,repeats:1}"
# exp name -> overrides (beside TOY, model.path and results_dir); `None` as the exp runs the default `accuracy` kind
KINDS: dict[str, list[str]] = {
    "accuracy": ["system=dense", "task=needlebench_srt", "task.params.lengths=[300]", "task.params.depths=[10,90]",
                 "task.params.max_new_tokens=4", "+exp.params.reference=engine-dense"],
    "accuracy_retention": ["exp.systems=[dense,snapkv,h2o,tova]", "exp.tasks=[needlebench_srt]",
                           "exp.params.budget=64", f"exp.params.task_params={{{SRT}}}"],
    "budget_sweep": ["exp.systems=[dense,quest,streaming]", "exp.tasks=[needlebench_srt]", "exp.params.budgets=[32,64]",
                     "exp.params.contexts={}", "+exp.params.task_params." + SRT.replace(":", "=", 1)],
    "needlebench": ["exp.systems=[dense,snapkv]", "exp.params.budget=64",
                    f"exp.params.task_params={{{SRT},needlebench_mrt:{{lengths:[300],depths:[10,50],"
                    "max_new_tokens:4},needlebench_mrs:{lengths:[300],depths:[10],needle_counts:[2],"
                    "max_new_tokens:4}}"],
    "cake_ablation": ["exp.params.budgets=[48]", "exp.params.allocations=[preference,uniform]",
                      "exp.params.indicators=[mean_plus_var]", "exp.params.tau1s=[0.5,1.0]", "exp.params.tau2s=[1.0]",
                      f"exp.params.task_params={{{SRT}}}"],
    "ruler": ["exp.systems=[dense,streaming]", "exp.params.budget=64", "exp.params.task_params.ruler.tasks=[vt]",
              "exp.params.task_params.ruler.lengths=[1024]", "exp.params.task_params.ruler.num_samples=2",
              "model.max_input_tokens=1500"],
    "quickstart": ["exp.systems=[dense,streaming]", "++exp.params.task_overrides={limit:3}",
                   "exp.params.fidelity={steps:4,gold:false}", "exp.params.throughput.systems=[dense]",
                   "exp.params.throughput.num_requests=2", "exp.params.throughput.input_len=300",
                   "exp.params.throughput.output_len=4"],
    "offline_throughput": ["exp.systems=[dense,streaming]", "exp.params.num_requests=2", "exp.params.input_len=300",
                           "exp.params.output_lens=[4,8]", "exp.params.reference=engine-dense"],
    "memory": ["exp.systems=[dense,snapkv,cake]", "exp.params.budget=64", "exp.params.lengths=[300,600]",
               "exp.params.output_len=3", "exp.params.warmup=false"],
    "decode_microbench": ["exp.params.systems=[dense,quest,flexicache]", "exp.params.context=256",
                          "exp.params.budget=64", "exp.params.batch_sizes=[1,2]", "exp.params.steps=2",
                          "exp.params.warmup=1"],
    "head_stability": ["exp.systems=[dense]", "exp.tasks=[needlebench_srt,needlebench_mrt]", "exp.params.top_k=4",
                       "exp.params.window=4", "exp.params.decode_steps=12", "exp.params.sink_tokens=16",
                       "exp.params.local_tokens=32", "exp.params.task_overrides.params.lengths=[300]",
                       "+exp.params.task_overrides.params.depths=[50]", "+exp.params.task_overrides.limit=1",
                       "model.max_input_tokens=1500"],
    "duo_attention": ["model.name=tiny", "exp.params.steps=4", "exp.params.pool=2", "exp.params.lengths=2",
                      "exp.params.context_min=120", "exp.params.context_max=160", "exp.params.sink_tokens=8",
                      "exp.params.recent_tokens=16", "exp.params.passkeys=2", "exp.params.passkey_words=4"],
    "loaded_host": ["exp.systems=[dense]", "exp.params.threads=[1,0]", "exp.params.background=[0]",
                    "exp.params.num_requests=2", "exp.params.input_len=300", "exp.params.output_len=4",
                    "+exp.params.repeats=1"],
    "online_sweep": ["exp.systems=[dense]", "exp.params.rates=[4,8]", "exp.params.num_prompts=4",
                     "exp.params.input_len=64", "exp.params.output_len=8"],
}
RESULT_FILES = ("summary.md", "summary.csv")


def overrides(exp: str, out: Path) -> list[str]:
    head = [] if exp == "accuracy" else [f"+exp={exp}"]
    return [*head, f"model.path={out / 'tiny_llama'}", f"results_dir={out / 'results'}", *TOY, *KINDS[exp]]


def folder(exp: str, out: Path) -> Path:
    return out / "results" / ("default" if exp == "accuracy" else exp)


def make_model(out: Path) -> None:
    """The tests' tiny random Llama (tests/conftest.py), with the embedded model's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from harness.integrations.assets import prepare

    path = out / "tiny_llama"
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).to(torch.float32).save_pretrained(path, safe_serialization=True)
    AutoTokenizer.from_pretrained(prepare(progress=False)).save_pretrained(path)


def env_for(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "OMP_NUM_THREADS": "1"}


def run(out: Path, tree: Path, kinds: list[str], rebuild_only: bool = False) -> int:
    failed = 0
    for exp in kinds:
        if not rebuild_only:
            proc = subprocess.run([sys.executable, "-m", "harness", *overrides(exp, out)], cwd=tree,
                                  env=env_for(tree), capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"{exp}: run failed\n{proc.stderr[-3000:]}")
                failed += 1
                continue
            keep(exp, out, "as_run")
        kept = folder(exp, out) / "as_run"
        again = rebuild(exp, out, tree)         # and as the same code rebuilds it from disk
        if again.returncode != 0:
            print(f"{exp}: rebuild by {tree} failed\n{again.stderr[-3000:]}")
            failed += 1
            continue
        keep(exp, out, "as_rebuilt")
        print(f"{exp}: ran, summaries kept in {kept} and as_rebuilt/")
    return failed


# no conf/exp file names the default kind: it is rebuilt through the function (where it lives before and after the
# harness was split into rooms)
REBUILD_DEFAULT = """import sys
try:
    from harness.reporting.rebuild import summarize_from_disk
except ImportError:
    from harness.report import summarize_from_disk
summarize_from_disk(sys.argv[1:])"""


def rebuild(exp: str, out: Path, tree: Path = ROOT) -> subprocess.CompletedProcess:
    """The summary rebuilt from disk by the code of `tree` (`python -m harness.report`)."""
    if exp == "accuracy":
        cmd = [sys.executable, "-c", REBUILD_DEFAULT, *overrides(exp, out)]
    else:
        cmd = [sys.executable, "-m", "harness.report", exp, *overrides(exp, out)[1:]]
    return subprocess.run(cmd, cwd=tree, env=env_for(tree), capture_output=True, text=True)


def keep(exp: str, out: Path, name: str) -> Path:
    """Copy the summary files of the experiment's folder aside, into `name`/."""
    kept = folder(exp, out) / name
    shutil.rmtree(kept, ignore_errors=True)
    kept.mkdir()
    for path in folder(exp, out).iterdir():
        if path.is_file() and (path.name in RESULT_FILES or path.suffix in (".png", ".json")):
            shutil.copy2(path, kept / path.name)
    return kept


def provenance(line: str) -> bool:
    return line.startswith("Made by ")


def differences(kept: Path, rebuilt: Path) -> list[str]:
    """What differs between the kept summary files and the rebuilt ones (the provenance line aside)."""
    notes = []
    for old in sorted(kept.iterdir()):
        new = rebuilt / old.name
        if not new.is_file():
            notes.append(f"{old.name} not rebuilt")
        elif old.suffix in (".md", ".csv"):
            a = [x for x in old.read_text().splitlines() if not provenance(x)]
            b = [x for x in new.read_text().splitlines() if not provenance(x)]
            diff = list(difflib.unified_diff(a, b, f"{kept.name}/{old.name}", f"rebuilt/{old.name}", lineterm="",
                                             n=0))
            if diff:
                notes.append("\n".join(diff))
        elif old.suffix != ".png" and old.read_bytes() != new.read_bytes():
            notes.append(f"{old.name} differs in bytes")
    return notes


def figures_redrawn(kept: Path, rebuilt: Path) -> list[str]:
    """PNGs whose bytes changed: figures, not numbers (e.g. a system's colour), so reported, not failed."""
    return [p.name for p in sorted(kept.glob("*.png")) if (rebuilt / p.name).is_file()
            and p.read_bytes() != (rebuilt / p.name).read_bytes()]


def compare(out: Path, kinds: list[str]) -> int:
    """Rebuild every kind with this checkout; diff against what the old code's run and its rebuild wrote."""
    bad = 0
    for exp in kinds:
        if not (folder(exp, out) / "as_run").is_dir():
            print(f"{exp}: no run kept (run it first)")
            bad += 1
            continue
        proc = rebuild(exp, out)
        if proc.returncode != 0:
            print(f"{exp}: rebuild failed\n{proc.stderr[-3000:]}")
            bad += 1
            continue
        for name in ("as_rebuilt", "as_run"):
            notes = differences(folder(exp, out) / name, folder(exp, out)) if (folder(exp, out) / name).is_dir() \
                else [f"no {name}/ kept"]
            redrawn = figures_redrawn(folder(exp, out) / name, folder(exp, out)) if not notes else []
            print(f"{exp} vs {name}: " + ("identical apart from the provenance line" if not notes
                                          else "DIFFERS\n" + "\n".join(notes))
                  + (f" (figures redrawn: {', '.join(redrawn)})" if redrawn else ""))
            # the old rebuild is the standard: a run's own summary may predate a fix in how it reads its cells
            bad += bool(notes) and name == "as_rebuilt"
    return bad


def rows_by_id(path: Path) -> dict[str, tuple]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["id"]: (r.get("output_ids"), r.get("score")) for r in rows}


def rerun(out: Path, kinds: list[str]) -> int:
    """Run again with this checkout into out/rerun; compare generated tokens and summaries with the kept run."""
    again = out / "rerun"
    again.mkdir(exist_ok=True)
    if not (again / "tiny_llama").exists():
        (again / "tiny_llama").symlink_to(out / "tiny_llama")
    bad = 0
    for exp in kinds:
        proc = subprocess.run([sys.executable, "-m", "harness", *overrides(exp, again)], cwd=ROOT, env=env_for(ROOT),
                              capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{exp}: rerun failed\n{proc.stderr[-3000:]}")
            bad += 1
            continue
        old_dir, new_dir = folder(exp, out), folder(exp, again)
        cells = sorted(p.parent.name for p in old_dir.glob("*/predictions.jsonl"))
        moved = [c for c in cells if not (new_dir / c / "predictions.jsonl").is_file()
                 or rows_by_id(old_dir / c / "predictions.jsonl") != rows_by_id(new_dir / c / "predictions.jsonl")]
        skip = ("Made by ", "Cost: ", "Regenerate: ")       # the rerun's command names its own folders
        a = [x for x in (old_dir / "as_run" / "summary.md").read_text().splitlines() if not x.startswith(skip)]
        b = [x for x in (new_dir / "summary.md").read_text().splitlines() if not x.startswith(skip)]
        diff = list(difflib.unified_diff(a, b, "run/summary.md", "rerun/summary.md", lineterm="", n=0))
        print(f"{exp}: {len(cells) - len(moved)} of {len(cells)} cells generate the same tokens"
              + (f"; differing: {moved}" if moved else "") + ("; summary differs:\n" + "\n".join(diff) if diff
                                                             else "; summary identical (timings aside)"))
        bad += bool(moved)
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", choices=("model", "run", "compare", "rerun"))
    ap.add_argument("--out", type=Path, required=True, help="scratch folder: tiny model and results")
    ap.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose code runs the cells (run)")
    ap.add_argument("--kinds", nargs="*", default=list(KINDS), help=f"default: all of {list(KINDS)}")
    ap.add_argument("--rebuild-only", action="store_true", help="run: only rebuild the kept runs with --tree's code")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.step == "model":
        make_model(args.out)
        return 0
    if args.step == "run":
        return int(run(args.out, args.tree.resolve(), args.kinds, args.rebuild_only) > 0)
    if args.step == "rerun":
        return int(rerun(args.out, args.kinds) > 0)
    return int(compare(args.out, args.kinds) > 0)


if __name__ == "__main__":
    sys.exit(main())

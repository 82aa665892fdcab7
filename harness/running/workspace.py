"""What the cells of one run share: the model folder, its tokenizer, rendered task samples, one live system at a time.

Everything loads on first use, so a run whose cells are all on disk (or a summary rebuilt from disk) loads nothing.
The driver closes the workspace when the run ends, whatever happened; the live system closes with it.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf

from harness.integrations.assets import model_dir as resolve_model_dir
from harness.running.config import UserError, plain
from harness.running.prompts import render_all
from systems.base import System
from systems.hardware import dtype_bytes
from systems.policies.base import Policy
from systems.registry import build_system, check_capacity
from tasks.base import Sample, Task, load_task

T = TypeVar("T")
Prepared = tuple[Task, list[Sample], list[list[int]]]


class Workspace:
    """The model folder and tokenizer of a run, its tasks' rendered samples, and one live system at a time."""

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self._model_dir: Path | None = None
        self._tokenizer: Any = None
        self._system: System | None = None
        self._system_key: str | None = None
        self._memo: dict[str, Any] = {}

    @property
    def model_dir(self) -> Path:
        if self._model_dir is None:
            self._model_dir = Path(resolve_model_dir(self.cfg.model.path, self.cfg.model.name))
        return self._model_dir

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        return self._tokenizer

    def memo(self, key: str, make: Callable[[], T]) -> T:
        """`make()` once per run under `key` (request sets, essay windows: every system sees the same)."""
        if key not in self._memo:
            self._memo[key] = make()
        value: T = self._memo[key]
        return value

    def task(self, task_cfg: DictConfig) -> Prepared:
        """(task, samples, prompts) of a task config, built once per run: every system sees the same samples."""
        cfg = self.cfg

        def prepare() -> Prepared:
            task = load_task(task_cfg.family, task_cfg.name, plain(task_cfg.params), seed=cfg.seed,
                             limit=task_cfg.limit, fraction=task_cfg.fraction)
            longest = task.longest_prompt_tokens()     # before building hours of 128k prompts, not after
            if longest is not None and longest > cfg.model.max_input_tokens:
                raise UserError(f"task {task_cfg.name} builds prompts of up to {longest} tokens > model."
                                f"max_input_tokens={cfg.model.max_input_tokens}: raise model.max_input_tokens (and "
                                "model.max_model_len above it) or drop the longest task.params.lengths")
            samples = task.samples(self.tokenizer)
            short = next((s for s in samples if type(s.max_new_tokens) is not int or s.max_new_tokens < 1), None)
            if short is not None:   # the engine would refuse it mid-run, after other cells were computed
                raise UserError(f"task {task_cfg.name}: sample {short.id} asks for max_new_tokens="
                                f"{short.max_new_tokens!r}; give the task a positive max_new_tokens")
            return task, samples, render_all(samples, self.tokenizer, cfg.model.max_input_tokens,
                                             cfg.model.max_model_len)
        return self.memo("task:" + OmegaConf.to_yaml(task_cfg), prepare)

    def check_fits(self, system_cfg: DictConfig, prompt_len: int, new_tokens: int,
                   policy: Policy | None = None) -> None:
        """Fail before any weights load when the system's device pool cannot hold one request of this size (every
        policy answers from the model's dimensions alone; backends without a checked pool pass)."""
        check_capacity(system_cfg, self.model_dir, dtype_bytes(self.cfg.model.dtype), prompt_len, new_tokens,
                       self.cfg.model.max_model_len, policy, self.cfg.model.name)

    def system(self, system_cfg: DictConfig, policy: Policy | None = None) -> System:
        """The live system of this config (the one already running when it is the same; the previous one is closed
        first, so one model is in memory at a time). `policy`: the config's policy, parsed once by the grid."""
        key = OmegaConf.to_yaml(system_cfg)
        if key != self._system_key or self._system is None:
            self.close()
            self._system = build_system(system_cfg, self.model_dir, self.cfg.model, policy=policy)
            self._system_key = key
        return self._system

    def close(self) -> None:
        if self._system is not None:
            self._system.close()
        self._system, self._system_key = None, None

"""Structured config schema registered with Hydra, so a misspelled key or a wrong type fails before any work."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from systems.engine.config import EngineConfig


@dataclass
class ModelConfig:
    name: str = "smollm2-135m-instruct"
    path: Optional[str] = None           # local HF safetensors folder; null = the embedded SmolLM2 asset
    dtype: str = "auto"                  # auto (bf16 on CUDA / CPUs with avx512_bf16 or AMX, else fp32) | bfloat16 |
                                         # float16 | float32; runs resolve auto to the concrete dtype first
    max_input_tokens: int = 7500         # prompts longer than this are truncated per the task's rule
    max_model_len: int = 8192


@dataclass
class SystemConfig:
    name: str = MISSING                  # label in results: engine-<policy>, hf, vllm
    backend: str = "hf"                  # a name in systems.registry.BACKENDS: hf | engine | vllm
    policy: str = "dense"                # systems/policies/<name>, or an installed kvharness.policies entry point
    params: dict[str, Any] = field(default_factory=dict)  # policy hyperparameters (validated by the policy)
    batch_size: int = 8                  # requests handed to generate() at once
    # serving settings; vllm reads device_memory_gb (its KV cache), max_num_seqs and max_num_batched_tokens from
    # here too, so two systems compared for speed get the same capacity
    engine: EngineConfig = field(default_factory=EngineConfig)
    omp_threads_bind: Optional[str] = None   # vllm's worker cores (VLLM_CPU_OMP_THREADS_BIND); null = every core
                                             # this run may use, the set the engine's threads run on
    vllm_execution: str = "default"      # vllm only: default = as vLLM runs by default (on CPU: traced once and
                                         # compiled by torch.compile's inductor) | eager (--enforce-eager)


@dataclass
class TaskConfig:
    name: str = MISSING
    family: str = MISSING                # module name in tasks/
    params: dict[str, Any] = field(default_factory=dict)  # validated by the family's Params dataclass
    limit: Optional[int] = None
    fraction: Optional[float] = None


@dataclass
class ExpConfig:
    name: str = "default"
    kind: str = "accuracy"               # harness/experiments/<kind> (module or package), or an installed entry point
    systems: list[str] = field(default_factory=list)   # conf/system names; empty = the `system` group choice
    tasks: list[str] = field(default_factory=list)     # conf/task names; empty = the `task` group choice
    params: dict[str, Any] = field(default_factory=dict)  # experiment-specific knobs
    # the same grid on each model (conf/model names, or mappings of model fields), reported across them by a kind
    # that compares models (harness.running.models); empty = the `model` group choice alone
    models: list[Any] = field(default_factory=list)


@dataclass
class TrackingConfig:
    backend: str = "none"                # none | mlflow (harness.integrations.tracking)
    uri: Optional[str] = None            # MLflow tracking URI; null = file:./mlruns (a local folder)
    experiment: Optional[str] = None     # MLflow experiment name; null = kvharness/<exp.name>


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    system: SystemConfig = field(default_factory=SystemConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    exp: ExpConfig = field(default_factory=ExpConfig)
    seed: int = 0
    results_dir: str = "results"
    progress: bool = True
    recompute_damaged: bool = True       # a damaged cell folder is moved aside and run again; false: stop and name it
    library_log_level: str = "error"     # vLLM's, transformers' and torch's console messages at or above this level
    tracking: TrackingConfig = field(default_factory=TrackingConfig)   # `tracking=mlflow` logs cells and summaries


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="system", name="system_schema", node=SystemConfig)
    cs.store(group="task", name="task_schema", node=TaskConfig)
    cs.store(group="exp", name="exp_schema", node=ExpConfig)

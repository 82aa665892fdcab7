"""From a system's config to what the harness needs: its backend class, its policy parsed once, checks, the system.

`BACKENDS` maps a config's `backend` name to a Backend class (systems/backends.py) that declares what it can do;
every other function here asks those classes and the policy, never a name. A system config's policy is parsed into a
Policy once (`check_system`) and that object is handed down: to the dimension and capacity checks and to the engine.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from systems.backends import (
    Backend,
    DimsView,
    EngineBackend,
    HFBackend,
    SystemConfigError,
    VLLMBackend,
    engine_config,
)
from systems.base import System
from systems.policies import policy_class, policy_names
from systems.policies.base import Policy

BACKENDS: dict[str, type[Backend]] = {b.name: b for b in (HFBackend, EngineBackend, VLLMBackend)}

__all__ = ["BACKENDS", "SystemConfigError", "backend_of", "build_system", "check_capacity", "check_dims",
           "check_policy", "check_system", "parse_policy", "policy_backend", "policy_class", "policy_names"]


def backend_of(system_cfg: Any) -> type[Backend]:
    """The Backend class of a system config; a one-line error naming the choices for an unknown one."""
    backend = BACKENDS.get(str(system_cfg.backend))
    if backend is None:
        raise SystemConfigError(f"system {system_cfg.name!r}: unknown backend {system_cfg.backend!r}; "
                                f"use one of {sorted(BACKENDS)}")
    return backend


def policy_backend() -> type[Backend]:
    """The backend that runs KV policies (a policy named without a system file runs there)."""
    return next(b for b in BACKENDS.values() if b.runs_policies)


def parse_policy(policy: str, params: dict) -> Policy:
    """The policy a config names, built from its hyperparameters (one-line errors)."""
    cls = policy_class(policy)
    if cls is None:
        raise SystemConfigError(f"unknown policy {policy!r}: use one of {policy_names()} or add "
                                f"systems/policies/{policy}.py exposing POLICY (or a `kvharness.policies` entry point)")
    try:
        return cls.from_params(params)
    except ValueError as exc:
        raise SystemConfigError(str(exc)) from None


def check_policy(policy: str, params: dict) -> None:
    """The policy exists and its hyperparameter dataclass accepts `params`."""
    parse_policy(policy, params)


VLLM_EXECUTION = ("default", "eager")


def check_system(system_cfg: Any) -> Policy:
    """Cheap checks that need no model, run before any expensive work; returns the system's policy, parsed."""
    backend = backend_of(system_cfg)
    if system_cfg.batch_size <= 0:
        raise SystemConfigError(f"system.batch_size must be positive, got {system_cfg.batch_size}")
    execution = getattr(system_cfg, "vllm_execution", "default")
    if execution not in VLLM_EXECUTION:
        raise SystemConfigError(f"system.vllm_execution must be one of {list(VLLM_EXECUTION)}, got {execution!r}")
    policy = parse_policy(system_cfg.policy, dict(system_cfg.params))
    if not backend.runs_policies and not policy.full_cache:
        raise SystemConfigError(f"system {system_cfg.name!r}: backend {backend.name} runs no KV policy (only one that "
                                f"keeps the full cache); use a backend that runs policies for {system_cfg.policy!r}")
    return policy


def check_dims(system_cfg: Any, model_dir: Path, max_model_len: int, policy: Policy | None = None,
               model_name: str | None = None) -> None:
    """The policy accepts the model's dimensions and the engine's page size (Policy.configure), checked before
    any model loads (backends that run policies)."""
    if not backend_of(system_cfg).runs_policies:
        return
    engine = engine_config(system_cfg)
    policy = policy if policy is not None else parse_policy(system_cfg.policy, dict(system_cfg.params))
    try:
        policy.configure(DimsView.of(model_dir, engine.page_size, max_model_len, model_name))
    except ValueError as exc:
        raise SystemConfigError(f"system {system_cfg.name!r}: {exc}") from None


def check_capacity(system_cfg: Any, model_dir: Path, dtype_bytes: int, prompt_len: int, max_new_tokens: int,
                   max_model_len: int, policy: Policy | None = None, model_name: str | None = None) -> None:
    """Fail before the model loads when the system's device pool cannot hold even the longest single request, for
    every policy: each answers from the model's dimensions alone (Policy.configure, then device_blocks_needed)."""
    backend = backend_of(system_cfg)
    if not backend.kv_capacity:
        return
    policy = policy if policy is not None else parse_policy(system_cfg.policy, dict(system_cfg.params))
    backend.check_capacity(system_cfg, policy, model_dir, dtype_bytes, prompt_len, max_new_tokens, max_model_len,
                           model_name)


def build_system(system_cfg: Any, model_dir: Path, model_cfg: Any, device: str | None = None,
                 policy: Policy | None = None) -> System:
    """The system a config names; `device` (cpu, cuda, cuda:1) overrides the default (CUDA when available);
    `policy` is the config's policy already parsed (check_system), handed to the backend instead of parsing again."""
    policy = policy if policy is not None else check_system(system_cfg)
    return backend_of(system_cfg).build(system_cfg, model_dir, model_cfg, policy, device)

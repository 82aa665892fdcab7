"""Build a System from its config: the one place that maps a backend name to a system class."""
from __future__ import annotations

from pathlib import Path
from typing import Any

BACKENDS = ("hf", "engine", "vllm")


class SystemConfigError(ValueError):
    """Bad system configuration; the message is one line that names the fix."""


def policy_class(policy: str):
    """The Policy class systems.policies.<policy> exposes as POLICY, or None when there is none."""
    import importlib

    from systems.policies.base import Policy

    if not policy.isidentifier():
        return None
    try:
        module = importlib.import_module(f"systems.policies.{policy}")
    except ModuleNotFoundError as exc:
        if exc.name != f"systems.policies.{policy}":
            raise
        return None
    cls = getattr(module, "POLICY", None)
    return cls if isinstance(cls, type) and issubclass(cls, Policy) else None


def check_policy(policy: str, params: dict) -> None:
    """The policy module exists and its hyperparameter dataclass accepts `params`."""
    cls = policy_class(policy)
    if cls is None:
        raise SystemConfigError(f"unknown policy {policy!r}: use one of {policy_names()} or add "
                                f"systems/policies/{policy}.py exposing POLICY")
    try:
        cls.from_params(params)
    except ValueError as exc:
        raise SystemConfigError(str(exc)) from None


def policy_names() -> list[str]:
    """Every policy module (systems/policies/<name>.py exposing POLICY)."""
    folder = Path(__file__).parent / "policies"
    return sorted(p.stem for p in folder.glob("[a-z]*.py") if policy_class(p.stem) is not None)


def check_system(system_cfg: Any) -> None:
    """Cheap checks that need no model: run before any expensive work."""
    if system_cfg.backend not in BACKENDS:
        raise SystemConfigError(f"system {system_cfg.name!r}: unknown backend {system_cfg.backend!r}; "
                                f"use one of {list(BACKENDS)}")
    if system_cfg.batch_size <= 0:
        raise SystemConfigError(f"system.batch_size must be positive, got {system_cfg.batch_size}")
    if system_cfg.backend == "engine":
        check_policy(system_cfg.policy, dict(system_cfg.params))
    elif system_cfg.policy != "dense":
        raise SystemConfigError(f"system {system_cfg.name!r}: backend {system_cfg.backend} runs only the dense "
                                f"policy; use backend=engine for policy {system_cfg.policy!r}")


def build_system(system_cfg: Any, model_dir: Path, model_cfg: Any, device: str | None = None):
    """The system a config names; `device` (cpu, cuda, cuda:1) overrides the default (CUDA when available)."""
    check_system(system_cfg)
    if system_cfg.backend == "hf":
        from systems.hf import HFSystem
        return HFSystem(str(model_dir), dtype=model_cfg.dtype, name=system_cfg.name,
                        batch_size=system_cfg.batch_size, device=device or "cpu")
    if system_cfg.backend == "engine":
        from systems.engine.system import EngineSystem
        return EngineSystem(str(model_dir), policy_name=system_cfg.policy, policy_params=dict(system_cfg.params),
                            engine=system_cfg.engine, dtype=model_cfg.dtype, name=system_cfg.name, device=device,
                            max_model_len=model_cfg.max_model_len)
    from systems.engine.config import EngineConfig
    from systems.hardware import allowed_cpus, cpu_list_text
    from systems.vllm import VLLMSystem

    eng = EngineConfig.coerce(system_cfg.engine)
    return VLLMSystem(str(model_dir), dtype=model_cfg.dtype, max_model_len=model_cfg.max_model_len,
                      name=system_cfg.name, kv_cache_space_gb=eng.device_memory_gb, max_num_seqs=eng.max_num_seqs,
                      max_num_batched_tokens=eng.max_num_batched_tokens, enable_chunked_prefill=eng.chunked_prefill,
                      omp_threads_bind=getattr(system_cfg, "omp_threads_bind", None) or cpu_list_text(allowed_cpus()))


class _DimsView:
    """The model's dimensions and the engine's page size: what Policy.configure needs, before any tensor exists."""

    def __init__(self, cfg: dict, page_size: int, max_model_len: int):
        import torch

        self.page_size, self.num_layers = page_size, cfg["num_hidden_layers"]
        self.num_q_heads = cfg["num_attention_heads"]
        self.num_kv_heads = cfg.get("num_key_value_heads") or self.num_q_heads
        self.head_dim = cfg.get("head_dim") or cfg["hidden_size"] // self.num_q_heads
        self.max_pages = -(-max_model_len // page_size)
        self.device, self.dtype, self.scale = torch.device("cpu"), torch.float32, self.head_dim ** -0.5


def check_dims(system_cfg: Any, model_dir: Path, max_model_len: int) -> None:
    """The policy accepts the model's dimensions and the engine's page size (Policy.configure), checked before
    any model loads."""
    import json

    from systems.engine.config import EngineConfig
    from systems.policies import load_policy

    if system_cfg.backend != "engine":
        return
    try:
        engine = EngineConfig.coerce(system_cfg.engine)
        policy = load_policy(system_cfg.policy, dict(system_cfg.params))
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        policy.configure(_DimsView(cfg, engine.page_size, max_model_len))
    except ValueError as exc:
        raise SystemConfigError(f"system {system_cfg.name!r}: {exc}") from None


def check_capacity(system_cfg: Any, model_dir: Path, dtype_bytes: int, prompt_len: int, max_new_tokens: int,
                   max_model_len: int) -> None:
    """Fail before the model loads when the device pool cannot hold even the longest single request, for every
    policy: each answers from the model's dimensions alone (Policy.configure, then device_blocks_needed)."""
    import json

    from systems.engine.config import EngineConfig

    if system_cfg.backend != "engine":
        return
    from systems.policies import load_policy

    try:
        engine = EngineConfig.coerce(system_cfg.engine)
    except ValueError as exc:
        raise SystemConfigError(str(exc)) from None
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    view = _DimsView(cfg, engine.page_size, max_model_len)
    policy = load_policy(system_cfg.policy, dict(system_cfg.params))
    try:
        policy.configure(view)
    except ValueError as exc:
        raise SystemConfigError(f"system {system_cfg.name!r}: {exc}") from None
    need = policy.device_blocks_needed(prompt_len, max_new_tokens)
    block = 2 * view.page_size * view.head_dim * dtype_bytes
    have = int(engine.device_memory_gb * 2**30) // block
    if need > have:
        gb = need * block / 2**30
        raise SystemConfigError(f"system {system_cfg.name!r}: a {prompt_len}-token prompt needs {need} device blocks "
                                f"({gb:.3f} GB) but engine.device_memory_gb={engine.device_memory_gb} holds "
                                f"{have}; set engine.device_memory_gb >= {gb:.3f}")

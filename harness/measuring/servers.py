"""Servers an online sweep talks to: the engine's OpenAI-compatible server or `vllm serve`, on a free loopback port.

A server is a child process in its own session (so closing kills its whole tree), polled on /health until it answers
or `startup_timeout_s` passes; its log lands in the cell folder.
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

from omegaconf import DictConfig, OmegaConf

REPO = Path(__file__).resolve().parents[2]


@dataclass
class ServerProcess:
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return json.loads(resp.read() or b"{}")
    except (OSError, ValueError):
        return None


def start_engine_server(cell, model_dir: Path, cfg: DictConfig, p, log_dir: Path) -> ServerProcess:
    s, eng = cell.system, cell.system.engine
    name = model_dir.name
    cmd = [sys.executable, "-m", "systems.server", "--model", str(model_dir), "--served-model-name", name,
           "--policy", s.policy, "--params", json.dumps(OmegaConf.to_container(s.params, resolve=True)),
           "--host", "127.0.0.1", "--port", str(free_port()), "--dtype", cfg.model.dtype,
           "--max-model-len", str(cfg.model.max_model_len), "--max-queue", str(p.max_queue),
           "--page-size", str(eng.page_size), "--device-memory-gb", str(eng.device_memory_gb),
           "--host-memory-gb", str(eng.host_memory_gb), "--max-num-seqs", str(eng.max_num_seqs),
           "--max-num-batched-tokens", str(eng.max_num_batched_tokens)]
    if eng.threads:
        cmd += ["--threads", str(eng.threads)]
    if not eng.chunked_prefill:
        cmd += ["--no-chunked-prefill"]
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / "server.log"
    with open(log, "wb") as sink:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
    server = ServerProcess(f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}", name, proc, log)
    deadline = time.monotonic() + p.startup_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-1500:]
            raise RuntimeError(f"engine server exited with code {proc.returncode}; log {log}:\n{tail}")
        if _get_json(server.url + "/health"):
            return server
        time.sleep(0.5)
    server.close()
    raise TimeoutError(f"engine server did not answer /health within {p.startup_timeout_s} s; see {log}")


def start_server(cell, model_dir: Path, cfg: DictConfig, p, log_dir: Path):
    if cell.system.backend == "engine":
        return start_engine_server(cell, model_dir, cfg, p, log_dir)
    from systems.hardware import allowed_cpus, cpu_list_text
    from systems.vllm import serve
    log_dir.mkdir(parents=True, exist_ok=True)
    eng = cell.system.engine       # the same capacity and cores as the engine's server gets
    return serve(model_dir, free_port(), dtype=cfg.model.dtype, max_model_len=cfg.model.max_model_len,
                 kv_cache_space_gb=eng.device_memory_gb, max_num_seqs=eng.max_num_seqs,
                 extra_args=["--max-num-batched-tokens", str(eng.max_num_batched_tokens),
                             "--enable-chunked-prefill" if eng.chunked_prefill else "--no-enable-chunked-prefill"],
                 omp_threads_bind=cell.system.omp_threads_bind or cpu_list_text(allowed_cpus()),
                 served_model_name=model_dir.name, startup_timeout_s=p.startup_timeout_s,
                 log_path=log_dir / "server.log")


def wait_idle(server, timeout_s: float = 60.0) -> None:
    """Let requests cancelled at a cell's time limit drain before the next cell starts (engine: /health counts)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        snap = _get_json(server.url + "/health")
        if not snap or "running" not in snap:      # vLLM's /health has no body: give it a moment
            time.sleep(1.0)
            return
        if snap["running"] == 0 and snap["waiting"] == 0:
            return
        time.sleep(0.2)

"""Servers an online sweep talks to: each system's own server (asked of its backend), on a free loopback port.

A server is a child process in its own session (closing it kills its whole tree), polled on /health until it answers
or `startup_timeout_s` passes; its log lands in the cell folder.
"""
from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

from systems.backends import Server, ServeSettings, free_port
from systems.registry import backend_of


def _get_json(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            body = json.loads(resp.read() or b"{}")
            return body if isinstance(body, dict) else {}
    except (OSError, ValueError):
        return None


def start_server(system_cfg: Any, model_dir: Path, model_cfg: Any, log_dir: Path, startup_timeout_s: float,
                 max_queue: int) -> Server:
    """The system's server with the run's model settings, its log at log_dir/server.log."""
    log_dir.mkdir(parents=True, exist_ok=True)
    settings = ServeSettings(Path(model_dir), model_cfg, free_port(), log_dir / "server.log", startup_timeout_s,
                             max_queue)
    return backend_of(system_cfg).serve(system_cfg, settings)


def wait_idle(server: Server, timeout_s: float = 60.0) -> None:
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


def engine_steps(server: Server) -> dict[str, float] | None:
    """The engine server's forwards by kind since it started (its /health `steps`); None for a server without them
    (vLLM)."""
    snap = _get_json(server.url + "/health")
    steps = snap.get("steps") if snap else None
    return dict(steps) if isinstance(steps, dict) and steps else None

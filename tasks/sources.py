"""Benchmark rows from a local folder of upstream jsonl files or the HF hub; fails fast when neither is there."""
from __future__ import annotations

import json
import os
import pathlib
import socket
import threading
from typing import Any
from urllib.parse import urlparse

from tasks.base import TaskError

_OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def read_jsonl(path: pathlib.Path) -> list[Any]:
    """One parsed object per non-blank line; a line that is not JSON becomes None (a malformed row)."""
    rows = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                rows.append(None)
    return rows


def local_rows(data_dir: str, filename: str, key: str) -> list[Any]:
    path = pathlib.Path(data_dir).expanduser() / filename
    if not path.is_file():
        raise TaskError(f"{path} not found: put the upstream {filename} there or fix {key}")
    return read_jsonl(path)


def _offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on") for v in _OFFLINE_VARS)


def hub_reachable(timeout_s: float) -> bool:
    """TCP connect to the hub endpoint within `timeout_s` (DNS included, hence the thread)."""
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = url.port or (443 if url.scheme == "https" else 80)
    ok = []

    def probe() -> None:
        try:
            socket.create_connection((url.hostname, port), timeout=timeout_s).close()
            ok.append(True)
        except OSError:
            pass
    worker = threading.Thread(target=probe, daemon=True)
    worker.start()
    worker.join(timeout_s)
    return bool(ok)


def hub_rows(repo: str, config: str | None, split: str, key: str, timeout_s: float, revision: str | None = None
             ) -> list[dict]:
    """`datasets.load_dataset(repo, config, split=split)` as plain dicts; the hub's cache serves offline runs."""
    where = f"dataset {repo!r} config {config!r}"
    if not _offline() and not hub_reachable(timeout_s):
        raise TaskError(f"cannot reach the HF hub for {where}: set {key} to a folder of upstream jsonl files")
    try:
        import datasets
        data = datasets.load_dataset(repo, config, split=split, revision=revision)
    except Exception as exc:        # any loader failure (offline cache miss, missing config) means the same fix
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TaskError(f"could not load HF hub {where} ({first[:160]}): set {key} to a folder of upstream "
                        f"jsonl files") from None
    return [dict(row) for row in data]

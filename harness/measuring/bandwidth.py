"""The machine's streaming read bandwidth, measured in the run that uses it (the roofline's attainable GB/s)."""
from __future__ import annotations

import time

import torch

GIB = 1 << 30


def stream_read_gbs(nbytes: int = GIB, repeats: int = 7, device: torch.device | None = None) -> float:
    """Best GB/s (1e9 bytes/s) of `repeats` full reads of an `nbytes` buffer, summed as int64 on the current torch
    threads: a sequential read as wide as the machine allows, far larger than any cache. The best, not the mean,
    because other processes on a shared host only ever slow a read down."""
    device = device or torch.device("cpu")
    buf = torch.ones(nbytes // 8, dtype=torch.int64, device=device)     # written once: its pages are resident
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        total = int(buf.sum())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    assert total == buf.numel()
    return buf.numel() * 8 / best / 1e9

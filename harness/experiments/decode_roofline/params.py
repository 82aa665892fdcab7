"""exp.params of the decode roofline: systems, contexts, batch sizes, steps, synthetic query noise."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from harness.running.params import GridParams


@dataclass
class Params(GridParams):
    systems: list[str] = field(default_factory=list)   # conf/system names; empty = those of exp.systems
    contexts: list[int] = field(default_factory=lambda: [1024, 4096])
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 16, 32])
    steps: int = 12                     # timed decode steps per point (whole steps, as the engine runs them)
    split_steps: int = 6                # further steps timed layer by layer for the selection / attention split
    warmup: int = 3
    query_noise: float = 0.1
    bandwidth_gib: float = 1.0          # the streaming-read buffer (far larger than any cache)
    seed: int = 0
    reference: Optional[str] = None     # the system every other's step is compared to (a dense one)
    floor_target: float = 1.5           # reference at batch 1 must be within this many times its bandwidth floor
    # the run's bandwidth reads, or its reference's first point timed at the start and again at the end, further apart
    # than this share (a quiet host's reads vary ~10 %): another tenant used the machine, and the summary says so
    host_drift: float = 0.2

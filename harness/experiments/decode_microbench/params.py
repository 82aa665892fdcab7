"""exp.params of the decode microbenchmark: context, batch sizes, steps, layers, synthetic query noise, shape."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from harness.running.params import GridParams


@dataclass
class Params(GridParams):
    systems: list[str] = field(default_factory=list)   # conf/system names; empty = those of exp.systems
    context: int = 8192
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 16])
    steps: int = 32
    warmup: int = 4
    layer: int = 2                      # first benchmarked layer (past Quest's dense layers)
    layers: int = 8                     # distinct layers per step: their KV outgrows the last-level cache
    query_noise: float = 0.1
    device: str = "auto"
    seed: int = 0
    reference: Optional[str] = None     # ratios are to this system; None = the first system
    pairs: list[list[str]] = field(default_factory=list)   # [a, b] system pairs: the glance line states time a ÷ b
    num_q_heads: Optional[int] = None   # attention shape; all three set: no model folder is read
    num_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None

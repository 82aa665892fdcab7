"""PyramidKV: SnapKV's scores with a per-layer budget that shrinks linearly from the lowest layer to the highest.

Budget formula and regimes of `PyramidKVCluster` (Zefan-Cai/KVCache-Factory `pyramidkv/pyramidkv_utils.py`), see
`allocation.pyramid_budgets`: n < C no compression; n < 2 (C - S_w) the uniform SnapKV budget; otherwise the pyramid
with beta 20, layer l keeping max_num - l * steps prefix tokens plus the S_w window. Defaults are the official
LongBench runner's (`run_longbench.py`: S_w 8, kernel 7, max pooling, C 512; the class defaults are 64 / 320 / 5 /
avg). Prefill only; per KV head with a named GQA aggregation (the runner's default granularity is per query head),
the group's scores averaged before pooling as KVCache-Factory's per-KV-head mode does (`gqa_pool`).
"""
from __future__ import annotations

from dataclasses import dataclass

from systems.policies.snapkv import SnapKV
from systems.policy_support import allocation as alloc


@dataclass
class PyramidKV(SnapKV):
    name = "pyramidkv"

    budget: int = 512           # C: mean tokens per layer and KV head after prefill, window included
    window: int = 8
    kernel: int = 7
    pooling: str = "maxpool"
    aggregation: str = "mean"
    gqa_pool: str = "group_then_pool"   # KVCache-Factory's per-KV-head mode: average the group, then pool
    beta: int = 20              # min_num = (C - S_w) // beta

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.beta < 1:
            raise ValueError(f"pyramidkv: beta must be >= 1, got {self.beta}")

    def layer_budgets(self, n: int) -> list[int] | None:
        return alloc.pyramid_budgets(n, self.budget, self.window, self.num_managed, self.beta)


POLICY = PyramidKV

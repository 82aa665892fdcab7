"""A free list of fixed-size KV blocks for one tier, with byte accounting (current and peak)."""
from __future__ import annotations

import torch


class OutOfBlocks(RuntimeError):
    """The tier has fewer free blocks than requested."""


class BlockPool:
    """Block ids 1 .. num_blocks-1 (0 is the null block), kept as a tensor stack so alloc/free are batched."""

    def __init__(self, num_blocks: int, bytes_per_block: int, tier: str):
        if num_blocks < 2:
            raise ValueError(f"{tier} tier holds {num_blocks} blocks; raise engine.{tier}_memory_gb")
        self.tier = tier
        self.num_blocks = num_blocks
        self.bytes_per_block = bytes_per_block
        self._stack = torch.arange(num_blocks - 1, 0, -1, dtype=torch.int32)
        self._top = num_blocks - 1
        self.peak_used = 0

    @property
    def capacity(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_used(self) -> int:
        return self.capacity - self._top

    @property
    def used_bytes(self) -> int:
        return self.num_used * self.bytes_per_block

    @property
    def peak_bytes(self) -> int:
        return self.peak_used * self.bytes_per_block

    def alloc(self, n: int) -> torch.Tensor:
        if n > self._top:
            raise OutOfBlocks(f"{self.tier} tier: {n} blocks requested, {self._top} free")
        # the stack top holds ascending runs (see free), so a fresh allocation is usually one contiguous run
        ids = self._stack[self._top - n:self._top].flip(0)
        self._top -= n
        self.peak_used = max(self.peak_used, self.num_used)
        return ids

    def free(self, ids: torch.Tensor) -> None:
        ids = ids.reshape(-1).to(device="cpu", dtype=torch.int32)
        n = ids.numel()
        if n == 0:
            return
        if self._top + n > self.capacity or bool((ids <= 0).any()):
            raise RuntimeError(f"{self.tier} tier: freeing invalid or already-free blocks")
        self._stack[self._top:self._top + n] = ids.sort(descending=True).values
        self._top += n

    def reset_peak(self) -> None:
        self.peak_used = self.num_used

"""A free list of fixed-size KV blocks for one tier, with reference counts and byte accounting (current and peak).

A block may be mapped by several sequences at once (a shared compressed prefix): `share` adds a reference, `free`
drops one and returns the block to the free list only when its last reference goes, so a shared page is allocated,
counted and released once.
"""
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
        self.refs = torch.zeros(num_blocks, dtype=torch.int32)     # mappings of each block (0 = free)
        self.num_shared = 0                                         # blocks mapped more than once
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
        self.refs[ids.long()] = 1
        self.peak_used = max(self.peak_used, self.num_used)
        return ids

    def share(self, ids: torch.Tensor) -> None:
        """One more mapping of each listed (allocated) block; a block listed twice gains two."""
        ids = ids.reshape(-1).to(device="cpu", dtype=torch.long)
        if ids.numel() == 0:
            return
        if bool((ids <= 0).any()) or bool((self.refs[ids] <= 0).any()):
            raise RuntimeError(f"{self.tier} tier: sharing a free or invalid block")
        uniq, counts = ids.unique(return_counts=True)
        before = self.refs[uniq]
        self.refs[uniq] = before + counts.to(torch.int32)
        self.num_shared += int((before == 1).sum())

    def shared(self, ids: torch.Tensor) -> torch.Tensor:
        """Bool mask (same shape): the block is mapped more than once, so writing it needs a private copy."""
        return self.refs[ids.to(device="cpu", dtype=torch.long)] > 1

    def free(self, ids: torch.Tensor) -> None:
        """Drop one mapping of each listed block; blocks left with none return to the free list."""
        ids = ids.reshape(-1).to(device="cpu", dtype=torch.long)
        if ids.numel() == 0:
            return
        if bool((ids <= 0).any()) or bool((ids >= self.num_blocks).any()):
            raise RuntimeError(f"{self.tier} tier: freeing invalid or already-free blocks")
        uniq, counts = ids.unique(return_counts=True)
        before = self.refs[uniq]
        left = before - counts.to(torch.int32)
        if bool((left < 0).any()):
            raise RuntimeError(f"{self.tier} tier: freeing invalid or already-free blocks")
        self.refs[uniq] = left
        self.num_shared -= int(((before > 1) & (left <= 1)).sum())
        released = uniq[left == 0].to(torch.int32)
        n = released.numel()
        if n == 0:
            return
        if self._top + n > self.capacity:
            raise RuntimeError(f"{self.tier} tier: freeing invalid or already-free blocks")
        self._stack[self._top:self._top + n] = released.sort(descending=True).values
        self._top += n

    def free_runs(self, ids: torch.Tensor, runs: torch.Tensor) -> None:
        """free() once per run of equal `runs` values (ascending: e.g. the layer of each block), in run order. Where
        no block is shared or listed twice this is one pass: each run's blocks go onto the free list in descending
        order, runs in order, so the list ends exactly as the separate calls leave it, without their ~15 ops each."""
        ids = ids.reshape(-1).to(device="cpu", dtype=torch.long)
        runs = runs.reshape(-1).to(device="cpu", dtype=torch.long)
        if ids.numel() != runs.numel():
            raise ValueError(f"{self.tier} tier: free_runs needs one run value per block")
        if ids.numel() == 0:
            return
        if bool((runs[1:] < runs[:-1]).any()):
            raise ValueError(f"{self.tier} tier: free_runs needs its runs in ascending order")
        if self.num_shared or ids.unique().numel() != ids.numel():
            _, counts = torch.unique_consecutive(runs, return_counts=True)
            start = 0
            for n in counts.tolist():
                self.free(ids[start:start + n])
                start += n
            return
        if bool((ids <= 0).any()) or bool((ids >= self.num_blocks).any()) or bool((self.refs[ids] != 1).any()) \
                or self._top + ids.numel() > self.capacity:
            raise RuntimeError(f"{self.tier} tier: freeing invalid or already-free blocks")
        self.refs[ids] = 0
        order = torch.argsort(runs * self.num_blocks - ids)             # run ascending, then block id descending
        self._stack[self._top:self._top + ids.numel()] = ids[order].to(torch.int32)
        self._top += ids.numel()

    def reset_peak(self) -> None:
        self.peak_used = self.num_used

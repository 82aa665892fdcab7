"""A policy written only against systems/policies/base.py, as a newcomer would: keep the prompt's first pages.

After prefill each KV head keeps its first `pages` pages of the prompt and evicts the rest for good; decode tokens are
appended and read in full. It has no `budget` knob: a shared budget leaves it as configured, and summaries say so.
tests/test_policy_extension.py installs it (as package `kvx_toy`, entry point `kvharness.policies`) outside the
tree to check the harness runs and reports a policy it was never told about.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from systems.policies.base import KVView, Policy, SeqInfo


@dataclass
class KeepFirstPages(Policy):
    name = "keep_first_pages"

    pages: int = 4

    def _kept(self, prompt_len: int) -> int:
        return min(prompt_len, self.pages * self.page_size)

    def expected_device_blocks(self, prompt_len: int, output_tokens: int) -> int:
        held = self._kept(prompt_len) + output_tokens - 1
        return self.num_layers * self.num_kv_heads * -(-held // self.page_size)

    def after_prefill_layer(self, kv: KVView, seq: SeqInfo, layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        n, keep = k.shape[0], self._kept(k.shape[0])
        if keep < n:
            kv.keep_tokens(seq.slot, layer, [torch.arange(keep, device=k.device)] * k.shape[1])


POLICY = KeepFirstPages

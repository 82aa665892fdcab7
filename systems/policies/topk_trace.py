"""Dense decoding that records per-step top-K page sets of every KV head, the traces head profiles are made from.

Per step and (layer, KV head): the top-K page set under Quest scoring (FlexiCache's head classification) and the
share of attention mass outside the sink + local window (the project's proxy for LServe's streaming heads).

Nothing is evicted or skipped: select_pages returns None, so the output is the dense output. The top-K set is the
one FlexiCache's runtime selects: K pages counting the last (partial) one, which its scorer always ranks first;
`num_pages` records N_t, every page the head holds at step t (the partial one included), the N of FlexiCache's
random-corrected overlap (TopK-Analysis: ceil((prompt + t) / page_size)). Finished traces wait in
`finished[request_id]` for the profiler (harness/experiments/head_stability.py) to collect.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from systems.policies.base import DecodeStep, KVView, Policy, SeqInfo
from systems.policy_support import selection


@dataclass
class TopKTrace(Policy):
    top_k: int = 64                 # pages per set (FlexiCache analysis runs topK 64 / 128 with 16-token pages)
    sink_tokens: int = 128          # LServe's streaming window, for the attention-mass proxy
    local_tokens: int = 256
    attention_mass: bool = True     # also measure the out-of-window attention share (one extra dense pass)

    name = "topk_trace"

    def bind(self, kv: KVView) -> None:
        super().bind(kv)
        self._live: dict[int, dict[str, list]] = {}
        self.finished: dict[str, dict[str, Any]] = {}

    def reset(self, slot: int) -> None:
        self._live[slot] = {"sets": [], "pages": [], "mass": []}

    def fork(self, kv: KVView, src: int, dst: int) -> None:
        live = self._live.get(src, {"sets": [], "pages": [], "mass": []})
        self._live[dst] = {key: [t.clone() if isinstance(t, torch.Tensor) else t for t in v] for key, v in live.items()}

    def select_pages(self, kv: KVView, step: DecodeStep) -> None:
        layer, slots = step.layer, step.slots
        num_pages = selection.pages_of(kv.num_tokens[slots, layer], kv.page_size)
        top = kv.top_pages(slots, layer, step.q, self.top_k, keep_last=True)
        top = torch.nn.functional.pad(top, (0, self.top_k - top.shape[-1]), value=selection.PAD).to(torch.int16)
        mass = self._outside_mass(kv, step) if self.attention_mass else None
        for b, seq in enumerate(step.seqs):
            live = self._live[seq.slot]
            if layer == self.managed_layers[0]:       # a step's first traced layer (windowed ones are skipped)
                live["sets"].append(torch.full((self.num_layers, self.num_kv_heads, self.top_k), selection.PAD,
                                               dtype=torch.int16))
                live["pages"].append(int(num_pages[b, 0]))            # N_t: every page, the partial one too
                live["mass"].append(torch.full((self.num_layers, self.num_kv_heads), float("nan")))
            live["sets"][-1][layer] = top[b].cpu()
            if mass is not None:
                live["mass"][-1][layer] = mass[b].cpu()
        return None

    def _outside_mass(self, kv: KVView, step: DecodeStep) -> torch.Tensor:
        """[B, Hkv] share of softmax mass outside the first sink and last local tokens, max over each query group;
        NaN while a head holds no more than sink + local tokens."""
        k, _, counts = kv.gather_tokens(step.slots, step.layer)                            # [B, Hkv, N, D]
        B, H, N, D = k.shape
        G = kv.num_q_heads // H
        q = step.q.view(B, H, G, D).to(k.dtype)
        logits = (q @ k.transpose(-1, -2)).float() * kv.scale                             # [B, H, G, N]
        pos = torch.arange(N, device=k.device).view(1, 1, 1, N)
        n = counts.view(B, H, 1, 1)
        probs = torch.softmax(logits.masked_fill(pos >= n, float("-inf")), dim=-1)
        inside = (pos < self.sink_tokens) | (pos >= n - self.local_tokens)
        outside = probs.masked_fill(inside, 0).sum(-1).amax(-1)
        return torch.where(counts > self.sink_tokens + self.local_tokens, outside, torch.nan)

    def kv_stats(self, kv: KVView, seq: SeqInfo) -> dict[str, Any]:
        live = self._live.pop(seq.slot, {"sets": [], "pages": [], "mass": []})
        steps = len(live["sets"])
        if steps:
            self.finished[seq.request_id] = {
                "sets": torch.stack(live["sets"]), "num_pages": torch.tensor(live["pages"]),
                "outside_mass": torch.stack(live["mass"])}
        stats = super().kv_stats(kv, seq)
        stats.update(trace_steps=steps, top_k=self.top_k)
        return stats


POLICY = TopKTrace

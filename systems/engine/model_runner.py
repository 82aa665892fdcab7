"""Runs the model over a prefill or decode batch, storing K/V in pages and calling the policy hooks per layer.

A prompt chunk is either prefill (positions before the sequence's compress_end: stored in position order, the
policy's after-prefill hooks at its end) or, in query-agnostic mode, an extension: tokens after a compressed context
appended to every head's cache (engine/extension.py) with the policy's after-extend hooks. The hooks run on the layers
the policy manages; a sliding-window layer it leaves to its window returns the pages its window left behind as soon as
a prompt chunk is read there, and after every decode step (kv_window.py)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from systems.engine import fused_decode, fused_mixed
from systems.engine.config import DECODE_TILE, PREFILL_TILE
from systems.engine.extension import appended_attention
from systems.engine.kv_cache import TieredKVCache
from systems.engine.models.llama import LlamaModel
from systems.engine.probe import PositionProbe
from systems.engine.sequence import Sequence
from systems.policies.base import DecodeStep, Policy, SeqInfo

# prompt rows per logits call when scoring a prompt: a whole 8k-token chunk at once would hold [8k, vocab] fp32
PROMPT_SCORE_ROWS = 256


class ModelRunner:
    def __init__(self, model: LlamaModel | None, kv: TieredKVCache, policy: Policy, attention_ops: Any,
                 batch_invariant: bool = False, fused: bool = True) -> None:
        """`model` may be None for a runner that only runs decode_layer (decode_microbench). `fused`: pure decode
        steps run as fused C++ layers where the model and machine allow it (see fused_decode.unsupported)."""
        self.model, self.kv, self.policy, self.ops = model, kv, policy, attention_ops
        self.device = model.device if model is not None else kv.device
        # per layer: its sliding window (None: full attention), handed to every attention op
        self.windows = model.spec.layer_windows if model is not None else (None,) * kv.num_layers
        self.last_selected: torch.Tensor | None = None     # the last layer's page sets (microbenchmarks count them)
        # fixed matmul shapes per phase (see config.PREFILL_TILE): a row's numbers never depend on its batch
        self.prefill_tile = PREFILL_TILE if batch_invariant else None
        self.decode_tile = DECODE_TILE if batch_invariant else None
        # policies without a prompt hook need no prompt queries kept across chunks (set_policy keeps the class)
        self._prompt_hook = policy.hooks_prefill()
        self._extend_hook = policy.overrides("after_extend_layer")
        self.fused_unsupported = "turned off" if not fused else "no model" if model is None else \
            fused_decode.unsupported(model, kv)
        self.fused = fused_decode.FusedDecode(model, kv, policy) if model is not None and \
            self.fused_unsupported is None else None
        # mixed and prefill steps as fused calls where the decode rows run as the fused decode step runs them
        self.mixed: fused_mixed.FusedMixed | None = None
        self.mixed_unsupported = self.fused_unsupported or ("batch-invariant tiles" if batch_invariant else None)
        if self.fused is not None and self.mixed_unsupported is None:
            self.mixed_unsupported = fused_mixed.unsupported(self.fused.model, kv, self.fused)
            if self.mixed_unsupported is None:
                self.mixed = fused_mixed.FusedMixed(self.fused.model, kv, self.fused, self._prompt_hook)
        self.probe: PositionProbe | None = None     # set by the engine once a request asks for positions

    def _model(self) -> LlamaModel:
        if self.model is None:
            raise RuntimeError("this runner was made without a model: it only runs decode_layer")
        return self.model

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """Whole-prompt prefill of each sequence (no cached prefix); returns last-position logits [B, V]."""
        return self.run_step([], [(s, 0, s.prefill_len) for s in seqs])

    @torch.inference_mode()
    def run_step(self, decodes: list[Sequence], chunks: list[tuple[Sequence, int, int]]) -> torch.Tensor:
        """One forward over decode tokens and prompt chunks (sequence, start, end) together; returns logits [R, V]
        for the rows that yield them: every decode, then every chunk that completes its prompt or a prefix it keeps
        (Sequence.logits_at)."""
        if not chunks:
            return self.decode(decodes)
        dev = self.device
        ids = [s.token_ids[-1] for s in decodes] + [t for s, a, b in chunks for t in s.token_ids[a:b]]
        positions = torch.cat([torch.tensor([len(s.token_ids) - 1 for s in decodes], dtype=torch.long)]
                              + [torch.arange(a, b) for _, a, b in chunks]).to(dev)
        bounds = [len(decodes)]
        for _, a, b in chunks:
            bounds.append(bounds[-1] + b - a)
        slots = torch.tensor([s.slot for s in decodes], device=dev)
        dec_infos = [s.info() for s in decodes]
        # an extension's hooks see the tokens processed so far (the chunk included), like a decode step's
        infos = [s.info(seq_len=b) if a >= s.compress_end else s.info() for s, a, b in chunks]

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            nd = len(decodes)
            outs = [self.decode_layer(layer, q[:nd], k[:nd], v[:nd], slots, dec_infos)] if nd else []
            for i, (seq, a, b) in enumerate(chunks):
                r0, r1 = bounds[i], bounds[i + 1]
                part = self._extend_layer if a >= seq.compress_end else self._prefill_layer
                outs.append(part(seq, infos[i], layer, a, b, q[r0:r1], k[r0:r1], v[r0:r1]))
            return torch.cat(outs) if len(outs) > 1 else outs[0]

        hidden = None
        if self.mixed is not None and self.probe is None and self.mixed.takes(chunks):
            hidden = self.mixed.hidden(torch.tensor(ids, device=dev), positions, slots, dec_infos,
                                       [(seq, info, a, b) for info, (seq, a, b) in zip(infos, chunks)])
            if hidden is not None and decodes:          # as decode_layer leaves it
                self.last_selected = self.mixed.last_selected
        if hidden is None:
            hidden = self._model().forward(torch.tensor(ids, device=dev), positions, attend, tile=self.prefill_tile)
        self.kv.release_out_of_window(slots)           # the decodes' windowed layers (chunks released per layer)
        for i, (seq, a, b) in enumerate(chunks):
            if seq.request.prompt_logprobs is not None:
                self._score_prompt(seq, a, b, hidden[bounds[i]:bounds[i + 1]])
        rows = list(range(len(decodes))) + [bounds[i + 1] - 1 for i, (s, _, b) in enumerate(chunks)
                                            if s.logits_at(b)]
        return self._model().logits(hidden[torch.tensor(rows, dtype=torch.long, device=dev)], tile=self.decode_tile)

    def _score_prompt(self, seq: Sequence, a: int, b: int, hidden: torch.Tensor) -> None:
        """Prompt positions a..b-1 of one sequence scored from this prefill forward (dense: the policy evicts only
        after the prompt's last chunk): log p of each next prompt token and the top-N, appended to
        seq.prompt_logprobs. Positions already scored (a prefill again after a preemption) are skipped."""
        top = seq.request.prompt_logprobs or 0
        start, end = max(a, len(seq.prompt_logprobs)), min(b, seq.num_prompt_tokens - 1)
        for lo in range(start, end, PROMPT_SCORE_ROWS):
            hi = min(lo + PROMPT_SCORE_ROWS, end)
            logp = torch.log_softmax(self._model().logits(hidden[lo - a:hi - a], tile=self.decode_tile), dim=-1)
            target = torch.tensor(seq.token_ids[lo + 1:hi + 1], device=logp.device)
            own = logp.gather(1, target[:, None])[:, 0].cpu().tolist()
            vals, ids = logp.topk(top, dim=-1)
            seq.prompt_logprobs.extend(zip(own, ids.cpu().tolist(), vals.cpu().tolist()))

    def _prefill_layer(self, seq: Sequence, info: SeqInfo, layer: int, a: int, b: int, q: torch.Tensor,
                       k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Prompt positions a..b-1 of one sequence at one layer: store their K/V, attend causally to the prompt so
        far, and when the prompt is complete hand the policy the whole prompt's queries and keys."""
        kv = self.kv
        kv.store_prefill(info.slot, layer, k, v, start=a)
        if a == 0:
            keys, values = k, v
        else:       # earlier chunks are stored (all resident): read them back
            k_prev, v_prev = kv.prompt_kv(info.slot, layer, a)
            keys, values = torch.cat([k_prev, k]), torch.cat([v_prev, v])
        out = self.ops.prompt_attention(q, keys, values, kv.scale, window=self.windows[layer])
        if layer in kv.released_windows:        # left to its window: the pages before it go as soon as it is read
            kv.release_out_of_window(torch.tensor([info.slot], device=self.device), layer)
        if not self._prompt_hook or not self.policy.manages(layer):
            return out
        if b < seq.compress_end:     # the hook sees the whole prompt: keep this chunk's queries (keys stay stored)
            seq.prompt_q.setdefault(layer, []).append(q.clone())
        else:
            parts = seq.prompt_q.pop(layer, [])
            q_all = torch.cat([*parts, q]) if parts else q
            k_all = kv.prompt_kv(info.slot, layer, b)[0] if parts else k
            self.policy.after_prefill_layer(kv, info, layer, q_all, k_all)
        return out

    def _extend_layer(self, seq: Sequence, info: SeqInfo, layer: int, a: int, b: int, q: torch.Tensor,
                      k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Positions a..b-1 after a compressed context: append them to every head, attend to what each head holds
        on the device, then the policy's after-extend hook (they are not compressed)."""
        self.kv.append_tokens(info.slot, layer, k, v)
        out = appended_attention(q, self.kv, info.slot, layer, window=self.windows[layer])
        if self._extend_hook and self.policy.manages(layer):
            self.policy.after_extend_layer(self.kv, info, layer, q, k)
        if layer in self.kv.released_windows:
            self.kv.release_out_of_window(torch.tensor([info.slot], device=self.device), layer)
        return out

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """One token per sequence, the whole batch in one forward per layer; returns logits [B, V]."""
        ids = torch.tensor([s.token_ids[-1] for s in seqs], device=self.device)
        positions = torch.tensor([len(s.token_ids) - 1 for s in seqs], device=self.device)
        slots = torch.tensor([s.slot for s in seqs], device=self.device)
        return self.decode_tokens(ids, positions, slots, [s.info() for s in seqs])

    @torch.inference_mode()
    def decode_tokens(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, infos: list[SeqInfo],
                      clock: Callable[[str], None] | None = None) -> torch.Tensor:
        """`decode` on explicit tensors (token ids, positions and slots [B]): what benchmarks on synthetic caches
        call. `clock(phase)` after each phase of each layer (append, select, attention, then "rest" on the fused
        path or "after_append" on the per-op path); logits [B, V]."""
        if self.fused is not None:
            logits = self.fused.logits(ids, positions, slots, infos, clock, probe=self.probe)
            self.last_selected = self.fused.last_selected
            self.kv.release_out_of_window(slots)
            return logits

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return self.decode_layer(layer, q, k, v, slots, infos, clock)

        hidden = self._model().forward(ids, positions, attend, tile=self.decode_tile, decode=True)
        # after the step, all windowed layers at once: the next query's window starts one token later
        self.kv.release_out_of_window(slots)
        return self._model().logits(hidden, tile=self.decode_tile)

    def decode_layer(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                     infos: list[SeqInfo], clock: Callable[[str], None] | None = None) -> torch.Tensor:
        """One layer of a decode step, as the engine runs it: append the new K/V, ask the policy which pages each
        head reads, attend to exactly those (all pages when it answers None), let the policy evict or promote.
        `clock(phase)` is called after append, select, attention and after_append (decode_microbench times them)."""
        kv, policy, ops = self.kv, self.policy, self.ops
        kv.append_decode(slots, layer, k, v)
        if clock:
            clock("append")
        step = DecodeStep(layer=layer, slots=slots, seqs=infos, q=q)
        managed = policy.manages(layer)
        selected = policy.select_pages(kv, step) if managed else None
        if self.probe is not None:
            self.probe.observe(layer, infos, selected, self.windows[layer])
        if clock:
            clock("select")
        out = ops.layer_decode_attention(q, kv.k_pool, kv.v_pool, kv.block_table, kv.num_tokens, kv.kmin, kv.kmax,
                                         slots, layer, selected, kv.scale, window=self.windows[layer])
        self.last_selected = selected
        if clock:
            clock("attention")
        if managed:
            policy.after_append(kv, step)
        if clock:
            clock("after_append")
        return out

"""One request's life inside the engine: its tokens, slot, timestamps, sampling state and the prefixes it shares."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from systems.base import GenerationRequest
from systems.policies.base import SeqInfo


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request: GenerationRequest, arrival_time: float, order: int):
        self.request = request
        self.arrival_time = arrival_time
        self.order = order                      # submission order, restores the caller's ordering
        self.token_ids = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.token_times: list[float] = []
        self.status = Status.WAITING
        self.slot: int | None = None
        self.prefill_len = 0
        self.num_computed = 0                   # prompt tokens stored so far (chunked prefill), prefill_len when done
        # query-agnostic: the policy compresses the first context_len tokens alone, the rest is appended after them
        self.context_len: int | None = request.context_len
        self.reads: Prefix | None = None        # the shared context (or kept prefix) it reads, see engine/prefix.py
        self.keeps: Prefix | None = None        # the prefix it keeps for later requests (keep_prefill)
        self.builds: list[Prefix] = []          # prefixes this admission snapshots when num_computed reaches them
        self.forked = False                     # its last admission forked a prefix instead of prefilling it
        self.prefix_logits: torch.Tensor | None = None   # the forked prefix's next-token logits
        # chunked prefill: each layer's query rows of the chunks so far, for the hooks that see the whole prompt
        self.prompt_q: dict[int, list[torch.Tensor]] = {}
        self.decode_step = 0
        self.finish_reason = "length"            # "length" | "stop" | "eos" | "abort" | "error"
        self.error = ""                         # why it failed (finish_reason "error"), for its caller alone
        self.text = ""
        self.kv_stats: dict = {}
        # filled only for forced or logprob requests: log p of each output token, the model's own argmax at each
        # step (differs from the token under teacher forcing), full log-softmax rows of the first logprob_steps
        self.token_logprobs: list[float] = []
        self.argmax_ids: list[int] = []
        self.logprob_rows: list[torch.Tensor] = []
        # request.prompt_logprobs: per prompt position 1.. (log p of the token, top-N ids, top-N log p)
        self.prompt_logprobs: list[tuple[float, list[int], list[float]]] = []
        self.generator: torch.Generator | None = None
        if request.temperature > 0:
            self.generator = torch.Generator().manual_seed(request.seed)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.prefill_len

    @property
    def compress_end(self) -> int:
        """Tokens the policy compresses on their own: the context (query-agnostic), else the whole prefill."""
        return self.prefill_len if self.context_len is None else self.context_len

    def next_boundary(self) -> int:
        """Where the next prompt chunk must stop: the end of the context (its hooks run before anything is
        appended), a prefix to keep, or the end of the prefill."""
        stops = [self.prefill_len] + [p.length for p in self.builds if p.length > self.num_computed]
        if self.num_computed < self.compress_end:
            stops.append(self.compress_end)
        return min(stops)

    def logits_at(self, end: int) -> bool:
        """Whether a chunk ending at `end` yields next-token logits: the end of the prefill, or a kept prefix."""
        return end == self.prefill_len or any(p.length == end for p in self.builds)

    @property
    def remaining_tokens(self) -> int:
        return self.request.max_new_tokens - self.num_output_tokens

    def info(self, seq_len: int | None = None) -> SeqInfo:
        assert self.slot is not None, "only a scheduled sequence has a slot"
        return SeqInfo(slot=self.slot, request_id=self.request.request_id, prefill_len=self.compress_end,
                       seq_len=len(self.token_ids) if seq_len is None else seq_len, decode_step=self.decode_step,
                       max_new_tokens=self.request.max_new_tokens)


@dataclass(eq=False)
class Prefix:
    """A compressed context several sequences read (or a prefix one keeps for later requests), held in its own
    slot once built; the engine's prefix manager (engine/prefix.py) builds, forks and frees it."""

    key: str
    tokens: tuple[int, ...]                 # the first `length` tokens of every reader's prompt
    compress_end: int                       # tokens the policy compressed alone (the context)
    pinned: bool                            # kept until released (keep_prefill), else freed with its last reader
    slot: int | None = None                 # holder slot once built
    logits: torch.Tensor | None = None      # fp32 [V] next-token logits after the last prefix token
    builder: Sequence | None = None         # the sequence that keeps it when its prefill reaches `length`
    users: set[Sequence] = field(default_factory=set)    # unfinished sequences that read or keep it
    forks: int = 0                          # readers forked from it so far

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def ready(self) -> bool:
        return self.slot is not None

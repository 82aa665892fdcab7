"""One request's life inside the engine: its tokens, slot, timestamps and sampling state."""
from __future__ import annotations

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
    def remaining_tokens(self) -> int:
        return self.request.max_new_tokens - self.num_output_tokens

    def info(self) -> SeqInfo:
        assert self.slot is not None, "only a scheduled sequence has a slot"
        return SeqInfo(slot=self.slot, request_id=self.request.request_id, prefill_len=self.prefill_len,
                       seq_len=len(self.token_ids), decode_step=self.decode_step,
                       max_new_tokens=self.request.max_new_tokens)

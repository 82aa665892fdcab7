"""The contract every system honours: requests in, completions (with token timestamps) and a memory report out."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass
class GenerationRequest:
    """One prompt, already rendered and tokenized by the harness (systems never see tasks)."""

    request_id: str
    prompt_token_ids: list[int]
    max_new_tokens: int
    temperature: float = 0.0          # 0 -> greedy
    top_p: float = 1.0
    seed: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()        # stop strings: generation ends and the text is cut before them
    arrival_time: float | None = None  # perf_counter() when the request arrived; None = at generate() call
    # record which prompt positions each (layer, KV head) holds and reads at the first decode step (the answer-survival
    # diagnostic; Completion.positions); systems that cannot look inside their cache ignore it
    probe_positions: bool = False
    # teacher forcing: the system runs exactly as when generating (the KV policy acts the same) but feeds these
    # tokens back instead of its own choice; EOS and stop strings do not end it
    forced_output_ids: tuple[int, ...] | None = None
    logprob_steps: int = 0            # keep the full next-token log-probabilities of the first N output steps
    # this request's KV budget (tokens per layer and KV head, mapped onto the policy's knobs by Policy.at_budget);
    # None: the system's configured policy. Systems that run no KV policy keep the full cache and ignore it
    kv_budget: int | None = None
    # score the prompt: at each prompt position the log-probability of the prompt's own next token and the top-N
    # alternatives, from the prefill forward (before the KV policy evicts anything); None = not computed
    prompt_logprobs: int | None = None
    # (the next three fields are honoured by systems with `supports_shared_context`; others run the prompt whole)
    # query-agnostic compression: the first context_len prompt tokens (the context) are prefilled and compressed by
    # the KV policy on their own; the rest (the question) is then prefilled onto the compressed cache, uncompressed,
    # its positions continuing after the whole context. None: the whole prompt at once, question in view (today's)
    context_len: int | None = None
    # requests naming the same shared_context (their first context_len tokens equal) read one compressed context:
    # prefilled and compressed once, its pages shared (counted once), freed when its last reader finishes. A key kept
    # by keep_prefill is read the same way (context_len = the keeper's, whose whole prompt must open this one)
    shared_context: str | None = None
    # keep this request's cache as it stands right after its prompt (compressed, policy state included) under this
    # key, for later requests naming it in shared_context (a teacher-forced pass reusing the generation's prefill),
    # until the system's release_prefix(key)
    keep_prefill: str | None = None


@dataclass
class PositionRecord:
    """The original token positions (int64, ascending) each [layer][KV head] held and read at a request's first
    decode step: `held` every token still stored in either tier, `read` the tokens that step's attention read (a
    retrieval policy's selected pages; all held tokens where a policy reads everything)."""

    held: list[list[Any]]
    read: list[list[Any]]
    seq_len: int                      # tokens processed at that step: the prompt and the first output token


@dataclass
class Completion:
    request_id: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    output_tokens: int
    arrival_time: float                 # perf_counter() clock, same clock as token_times
    token_times: list[float]            # perf_counter() when each output token became available
    finish_reason: str = "length"       # "length" | "stop" | "eos"
    kv_stats: dict[str, Any] = field(default_factory=dict)  # policy-specific realized counts
    positions: PositionRecord | None = None   # a probe_positions request's record (None: not asked or not possible)
    # for forced or logprob requests (empty otherwise): log p of each output token under the system, the system's
    # own argmax at each step, and [min(N, steps), vocab] fp32 log-probabilities of the first logprob_steps steps
    token_logprobs: list[float] = field(default_factory=list)
    argmax_ids: list[int] = field(default_factory=list)
    logprobs: Any = None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival_time if self.token_times else None

    @property
    def tpot(self) -> float | None:
        """vLLM convention: (E2EL - TTFT) / (output_tokens - 1), undefined for a single token."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)


@dataclass
class MemoryReport:
    """KV bytes per tier; `mode` is 'physical' unless savings are only masked ('simulated')."""

    mode: str = "physical"
    device_kv_capacity_bytes: int | None = None
    device_kv_peak_bytes: int | None = None
    host_kv_peak_bytes: int | None = None
    bytes_host_to_device: int = 0
    bytes_device_to_host: int = 0
    execution: str = ""          # how the system ran its forward passes, in words (summaries name it)
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@runtime_checkable
class System(Protocol):
    name: str

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Completion]:
        """Run all requests to completion (batched as the system sees fit); one completion per request, same order."""

    def memory_report(self) -> MemoryReport:
        """Peak/total KV accounting since construction or the last reset_stats()."""

    def reset_stats(self) -> None: ...

    def close(self) -> None: ...


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """Cut `text` before the earliest stop string; returns (text, whether a stop was found)."""
    cut = min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)

"""The engine's loop: takes new requests and aborts through a port, steps, sends each step's new tokens back.

The engine is not thread-safe, so every engine call happens on one thread, the one that runs `run()`; the HTTP side
(systems.openai_server) reaches it only through a port (systems.engine_link): a queue when both live in one process,
a pipe when HTTP runs in a process of its own (`python -m systems.server --front-end process`). That thread is best
the one that built the engine: torch's OpenMP runtime keeps one worker team per thread that ran parallel work, and
two teams on a machine's cores throttle the workers' spin-waiting, so the hundreds of short parallel ops of a step
each wake sleeping workers (on 2 cores a 256-token mixed step took 8-20 % longer and kept 1.7 cores busy instead of
2.0 when stepped from a second thread).

One request's failure is its own: the engine finishes a failing sequence with finish_reason "error" and goes on
with the rest of the batch (Engine.step), and this loop sends that error to that request alone. A request the
engine refuses at add_request (a value the HTTP checks missed), or one that alone would outgrow the device tier by
the policy's own rule, gets ('invalid', msg, param) and never joins a batch. Only a failure outside any one sequence
(a bug in the step itself) still fails every live request. When the loop ends, every request it still holds gets
('error', ...) and is taken out of the engine, so none waits forever.

Events, per request id: ('tokens', ids, finish, entries, prompt_entries), ('error', msg) or ('invalid', msg, param).
`entries`: the new tokens' log-probabilities when the request keeps them (logprob_steps), else None;
`prompt_entries`: the prompt's (request.prompt_logprobs), in the first event only. Each send also carries the
engine's state (`EngineStats`), which is all /health and /metrics know of the engine.
"""
from __future__ import annotations

import dataclasses
import logging
import traceback
from dataclasses import dataclass, field
from typing import Protocol

from systems.base import GenerationRequest
from systems.engine.engine import Engine
from systems.engine.sequence import Sequence, Status
from systems.openai_logprobs import Entry, output_entries

log = logging.getLogger("kvharness.server")
FINISH = {"length": "length", "stop": "stop", "eos": "stop"}
Event = tuple[str, tuple]        # (request id, event)


@dataclass(frozen=True)
class EngineStats:
    """What the HTTP side shows of the engine: serving or not, batch size, both KV tiers' use, the last failure, and
    its forwards by kind."""

    serving: bool = False
    running: int = 0
    device_blocks_free: int = 0
    device_blocks_used: int = 0
    host_blocks_free: int = 0
    host_blocks_used: int = 0
    last_error: str = ""
    # the engine's StepTally, as a dict: it changes every step, so it rides along with each send without causing one
    steps: dict[str, float] = field(default_factory=dict, compare=False)


def engine_stats(engine: Engine, serving: bool, last_error: str = "") -> EngineStats:
    dev, host = engine.kv.device_blocks, engine.kv.host_blocks
    return EngineStats(serving, len(engine.scheduler.running), dev.num_free, dev.num_used, host.num_free, host.num_used,
                       last_error, dataclasses.asdict(engine.tally))


class EnginePort(Protocol):
    """The engine loop's end of a link to the HTTP side."""

    def receive(self, timeout: float) -> list[tuple]:
        """Messages sent so far: ('add', request, top_logprobs) or ('abort', request_id); waits up to `timeout`
        seconds for the first when there are none. Raises EOFError once the other side is gone (so does send)."""

    def send(self, events: list[Event], stats: EngineStats) -> None:
        """Hand events (in order) and the engine's state to the HTTP side."""


@dataclass
class Tracked:
    """A request the engine holds for the HTTP side."""

    request: GenerationRequest
    top_logprobs: int           # alternatives per generated token in `entries`
    seq: Sequence
    sent: int = 0               # output tokens already sent


class EngineLoop:
    """The loop that drives the engine; all engine access happens on the thread that runs it."""

    def __init__(self, engine: Engine, port: EnginePort) -> None:
        self.engine, self.port = engine, port
        self._live: dict[str, Tracked] = {}
        self._stop = False
        self._serving = False
        self.last_error = ""      # the latest failure (one request's, or a whole step's); the loop kept serving
        self.http_gone = False    # the loop ended because the HTTP side went away, not because it was asked to
        self._stats_sent: EngineStats | None = None

    def run(self) -> None:
        """Step until stop_soon() or until the HTTP side is gone, on the calling thread."""
        self._serving = True
        try:
            self._run()
        except EOFError:
            self.http_gone = True
            log.error("the HTTP side is gone; the engine loop ends")
        finally:
            self._serving = False
            ended = list(self._live)
            for rid in ended:
                self._drop(rid)
            try:
                self.port.send([(rid, ("error", "the engine loop ended")) for rid in ended], self.stats())
            except EOFError:      # nobody left to tell
                pass

    def stop_soon(self) -> None:
        """Ask the loop to end after its current step; safe in a signal handler (one flag, no lock: an idle loop
        notices within its 0.1 s wait)."""
        self._stop = True

    def stats(self) -> EngineStats:
        return engine_stats(self.engine, self._serving, self.last_error)

    def _run(self) -> None:
        self.port.send([], self.stats())       # serving from now on
        while not self._stop:
            busy = self.engine.scheduler.has_work()
            self._take(self.port.receive(0.0 if busy else 0.1))
            if not self.engine.scheduler.has_work():
                self._send([])               # an abort may have freed blocks: /health shows it
                continue
            try:
                self.engine.step()
            except Exception as exc:  # noqa: BLE001 - fail the live requests, keep serving
                log.error("engine step failed:\n%s", traceback.format_exc())
                self.last_error = f"{type(exc).__name__}: {exc}"
                failed = list(self._live.values())
                for tracked in failed:
                    self._drop(tracked.request.request_id)
                self._send([(t.request.request_id, ("error", self.last_error)) for t in failed])
                continue
            self._publish()

    def _send(self, events: list[Event]) -> None:
        """Events always go; the state alone only when it changed (each send wakes the HTTP side)."""
        stats = self.stats()
        if events or stats != self._stats_sent:
            self.port.send(events, stats)
            self._stats_sent = stats

    def _take(self, messages: list[tuple]) -> None:
        refused: list[Event] = []
        for message in messages:
            if message[0] == "abort":
                self._drop(message[1])
                continue
            _, request, top_logprobs = message
            rid = request.request_id
            too_big = self._outgrows_device_tier(request)
            if too_big:
                refused.append((rid, ("invalid", too_big, "max_tokens")))
                continue
            try:
                seq = self.engine.add_request(request, arrival_time=request.arrival_time)
            except ValueError as exc:         # the engine's own gate: the request is refused, the batch untouched
                refused.append((rid, ("invalid", str(exc), None)))
                continue
            except Exception as exc:  # noqa: BLE001 - the request is refused, the engine is untouched
                refused.append((rid, ("error", f"{type(exc).__name__}: {exc}")))
                continue
            self._live[rid] = Tracked(request, top_logprobs, seq)
        if refused:
            self._send(refused)

    def _outgrows_device_tier(self, request: GenerationRequest) -> str:
        """Why the request alone would outgrow the device tier once all its tokens are decoded (by the policy's own
        rule: a budget caps it for eviction policies), failing the step it runs in; '' when it fits."""
        need = self.engine.policy.device_blocks_needed(len(request.prompt_token_ids) + request.max_new_tokens, 0)
        capacity = self.engine.kv.device_blocks.capacity
        if need <= capacity:
            return ""
        return (f"the request needs {need} device KV blocks but the server's device tier holds {capacity}; lower "
                "max_tokens, shorten the prompt, or restart the server with a larger --device-memory-gb")

    def _publish(self) -> None:
        events: list[Event] = []
        try:
            for rid, tracked in list(self._live.items()):
                seq = tracked.seq
                if seq.finish_reason == "error":     # failed alone: its error goes to its client only
                    self.last_error = seq.error
                    events.append((rid, ("error", seq.error)))
                    del self._live[rid]
                    continue
                n = seq.num_output_tokens
                finished = seq.status is Status.FINISHED
                if n > tracked.sent or finished:
                    ids = seq.token_ids[seq.num_prompt_tokens + tracked.sent:seq.num_prompt_tokens + n]
                    entries = self._entries(tracked, n)
                    prompt = (seq.prompt_logprobs if tracked.sent == 0 and tracked.request.prompt_logprobs is not None
                              else None)
                    tracked.sent = n
                    events.append((rid, ("tokens", ids, FINISH.get(seq.finish_reason, "stop") if finished else None,
                                         entries, prompt)))
                if finished:
                    del self._live[rid]
        finally:        # what was gathered before a failure still reaches its clients
            self._send(events)

    @staticmethod
    def _entries(tracked: Tracked, n: int) -> list[Entry] | None:
        """The new tokens' log-probabilities; their full vocabulary rows are taken off the sequence here, every step,
        so a long generation holds one row at a time, not one per token."""
        seq = tracked.seq
        if not tracked.request.logprob_steps:
            return None
        rows, seq.logprob_rows = seq.logprob_rows, []
        return output_entries(rows, seq.token_logprobs[tracked.sent:n], tracked.top_logprobs)

    def _drop(self, rid: str) -> None:
        """Take a sequence out of the engine wherever it is, freeing its KV blocks."""
        tracked = self._live.pop(rid, None)
        if tracked is not None:
            self.engine.abort(tracked.seq)

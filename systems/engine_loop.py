"""The engine's loop: takes new requests and aborts from an inbox, steps, posts each step's new tokens.

The engine is not thread-safe, so every engine call happens on one thread; the HTTP side (systems.openai_server)
talks to it only through submit/abort and each request's asyncio queue. That thread is best the one that built the
engine (`run()` on it; `python -m systems.server` does so on its main thread): torch's OpenMP runtime keeps one
worker team per thread that ran parallel work, and two teams on a machine's cores throttle the workers' spin-
waiting, so the hundreds of short parallel ops of a step each wake sleeping workers (on 2 cores a 256-token mixed
step took 8-20 % longer and kept 1.7 cores busy instead of 2.0 when stepped from a second thread). `start()` runs it
on a thread of its own, for servers inside a test or notebook.

One request's failure is its own: the engine finishes a failing sequence with finish_reason "error" and goes on
with the rest of the batch (Engine.step), and this loop posts that error to that request alone. A request the
engine refuses at add_request (a value the HTTP checks missed) gets ('invalid', msg) and never joins a batch. Only a
failure outside any one sequence (a bug in the step itself) still fails every live request.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import traceback
from dataclasses import dataclass, field

from systems.base import GenerationRequest
from systems.engine.engine import Engine
from systems.engine.sequence import Sequence, Status
from systems.openai_logprobs import Entry, output_entries

log = logging.getLogger("kvharness.server")
FINISH = {"length": "length", "stop": "stop", "eos": "stop"}

@dataclass
class Live:
    """A request between HTTP and engine: the engine thread posts ('tokens', ids, finish, entries, prompt_entries),
    ('error', msg) or ('invalid', msg). `entries`: the new tokens' log-probabilities when the request keeps them
    (logprob_steps), else None; `prompt_entries`: the prompt's (request.prompt_logprobs), in the first event only."""

    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    seq: Sequence | None = None     # the engine's, set by the engine thread
    sent: int = 0               # output tokens already posted
    top_logprobs: int = 0       # alternatives per generated token in `entries`
    done: bool = False          # finished, failed or aborted: nothing more will be posted


def _deliver(batch: list[tuple[Live, tuple]]) -> None:
    for live, event in batch:
        live.events.put_nowait(event)


class EngineLoop:
    """The loop that drives the engine; all engine access happens on the thread that runs it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._live: dict[str, Live] = {}
        self._stop = False
        self._serving = False     # run() is stepping (on whichever thread called it)
        self.last_error = ""      # the latest failure (one request's, or a whole step's); the loop kept serving
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Run the loop on a thread of its own."""
        self._serving = True          # healthy from now on, not only once the thread gets its first turn
        self._thread = threading.Thread(target=self.run, name="engine-loop", daemon=True)
        self._thread.start()

    def run(self) -> None:
        """Step until stop(), on the calling thread."""
        self._serving = True
        try:
            self._run()
        finally:
            self._serving = False

    def stop_soon(self) -> None:
        """Ask the loop to end after its current step; safe in a signal handler (one flag, no lock: an idle loop
        notices within its 0.1 s wait)."""
        self._stop = True

    def stop(self) -> None:
        """End the loop after its current step and wait for its thread."""
        self.stop_soon()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def submit(self, live: Live) -> None:
        self._inbox.put(("add", live))
        self._wake.set()

    def abort(self, live: Live) -> None:
        self._inbox.put(("abort", live))
        self._wake.set()

    @property
    def healthy(self) -> bool:
        return self._serving

    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    def _post(self, live: Live, event: tuple) -> None:
        self._post_all([(live, event)])

    @staticmethod
    def _post_all(posts: list[tuple[Live, tuple]]) -> None:
        """Hand a step's events to their HTTP loops, one wake-up per loop: each call_soon_threadsafe wakes that loop's
        thread, which then contends for the GIL and a core with this one while the step's parallel work waits."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Live, tuple]]] = {}
        for live, event in posts:
            by_loop.setdefault(live.loop, []).append((live, event))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:      # the HTTP loop is gone (shutdown): nobody is listening
                pass

    def _run(self) -> None:
        while not self._stop:
            self._drain()
            if not self.engine.scheduler.has_work():
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            try:
                self.engine.step()
            except Exception as exc:  # noqa: BLE001 - fail the live requests, keep serving
                log.error("engine step failed:\n%s", traceback.format_exc())
                self.last_error = f"{type(exc).__name__}: {exc}"
                failed = list(self._live.values())
                self._post_all([(live, ("error", self.last_error)) for live in failed])
                for live in failed:
                    self._drop(live)
                continue
            self._publish()

    def _drain(self) -> None:
        while True:
            try:
                kind, live = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "abort":
                self._drop(live)
                continue
            try:
                live.seq = self.engine.add_request(live.request, arrival_time=live.request.arrival_time)
            except ValueError as exc:         # the engine's own gate: the request is refused, the batch untouched
                self._post(live, ("invalid", str(exc)))
                continue
            except Exception as exc:  # noqa: BLE001 - the request is refused, the engine is untouched
                self._post(live, ("error", f"{type(exc).__name__}: {exc}"))
                continue
            self._live[live.request.request_id] = live

    def _publish(self) -> None:
        posts: list[tuple[Live, tuple]] = []
        try:
            for rid, live in list(self._live.items()):
                seq = live.seq
                assert seq is not None          # only admitted requests are live
                if seq.finish_reason == "error":     # failed alone: its error goes to its client only
                    self.last_error = seq.error
                    posts.append((live, ("error", seq.error)))
                    del self._live[rid]
                    continue
                n = seq.num_output_tokens
                finished = seq.status is Status.FINISHED
                if n > live.sent or finished:
                    ids = seq.token_ids[seq.num_prompt_tokens + live.sent:seq.num_prompt_tokens + n]
                    entries = self._entries(live, seq, n)
                    prompt = (seq.prompt_logprobs if live.sent == 0 and live.request.prompt_logprobs is not None
                              else None)
                    live.sent = n
                    posts.append((live, ("tokens", ids, FINISH.get(seq.finish_reason, "stop") if finished else None,
                                         entries, prompt)))
                if finished:
                    del self._live[rid]
        finally:        # what was gathered before a failure still reaches its clients
            self._post_all(posts)

    @staticmethod
    def _entries(live: Live, seq: Sequence, n: int) -> list[Entry] | None:
        """The new tokens' log-probabilities; their full vocabulary rows are taken off the sequence here, every step,
        so a long generation holds one row at a time, not one per token."""
        if not live.request.logprob_steps:
            return None
        rows, seq.logprob_rows = seq.logprob_rows, []
        return output_entries(rows, seq.token_logprobs[live.sent:n], live.top_logprobs)

    def _drop(self, live: Live) -> None:
        """Take a sequence out of the engine wherever it is, freeing its KV blocks."""
        self._live.pop(live.request.request_id, None)
        if live.seq is not None:
            self.engine.abort(live.seq)

"""How the HTTP side and the engine loop talk, in one process (a queue) or across two (a pipe).

Both sides see the same API whichever the link: EngineClient on the HTTP side, EnginePort on the engine's. The HTTP
side never touches the engine object: what it checks requests against is `EngineFacts` (fixed when the server starts)
and what /health shows is the latest `EngineStats` the loop sent. Once the loop has served and stopped, every request
still waiting and every new one gets ('error', ...) at once, so no client waits forever.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from systems.base import GenerationRequest
from systems.engine_loop import EngineStats, Event, engine_stats


@dataclass(frozen=True)
class EngineFacts:
    """What the HTTP side needs to know of the engine to check a request before sending it."""

    model_dir: str              # the weights served (its tokenizer; /v1/models' `root`)
    policy: str                 # the KV policy's class name
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    device_blocks: int          # the device tier's capacity
    idle: EngineStats           # the engine's state before its loop first sends one (not serving yet)


def facts_of(system: Any) -> EngineFacts:
    """An EngineSystem's facts."""
    engine = system.engine
    return EngineFacts(system.model_dir, type(engine.policy).__name__, engine.model.spec.vocab_size,
                       engine.max_model_len, engine.scheduler.max_num_seqs, engine.kv.device_blocks.capacity,
                       engine_stats(engine, serving=False))


@dataclass
class Live:
    """A request on the HTTP side: submitted once, its events arrive on `events` in order."""

    request: GenerationRequest
    top_logprobs: int = 0       # alternatives per generated token in the events' entries
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    done: bool = False          # finished, failed or aborted: nothing more will arrive


class EngineClient:
    """The HTTP side's end; every method runs on the HTTP event loop's thread."""

    def __init__(self, stats: EngineStats | None = None) -> None:
        self.lives: dict[str, Live] = {}
        self.stats = stats or EngineStats()
        self.ended = ""           # why the engine loop is over ('' while it may still serve)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Begin taking the engine's sends on `loop`."""

    def submit(self, live: Live) -> None:
        if self.ended:
            live.events.put_nowait(("error", self.ended))
            return
        self.lives[live.request.request_id] = live
        self._send(("add", live.request, live.top_logprobs))

    def abort(self, live: Live) -> None:
        """Take the request out of the engine, freeing its KV blocks at the loop's next turn."""
        self._send(("abort", live.request.request_id))

    def release(self, live: Live) -> None:
        """The HTTP side is done with the request; aborted unless it ended."""
        self.lives.pop(live.request.request_id, None)
        if not live.done:
            self.abort(live)

    @property
    def healthy(self) -> bool:
        return self.stats.serving

    def deliver(self, events: list[Event], stats: EngineStats) -> None:
        served, self.stats = self.stats.serving, stats
        for rid, event in events:
            live = self.lives.get(rid)
            if live is not None:           # else released already: nobody is listening
                live.events.put_nowait(event)
        if served and not stats.serving:
            self.end("the engine loop ended")

    def end(self, why: str) -> None:
        """The engine loop is over: fail whoever still waits, and every request from now on."""
        self.ended = why
        self.stats = EngineStats(serving=False, running=0, last_error=self.stats.last_error or why)
        for live in self.lives.values():
            live.events.put_nowait(("error", why))
        self.lives.clear()

    def _send(self, message: tuple) -> None:
        raise NotImplementedError


class QueuePort:
    """The engine loop's end in the same process: messages on a queue, sends posted onto the HTTP event loop."""

    def __init__(self) -> None:
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.client: EngineClient | None = None

    def receive(self, timeout: float) -> list[tuple]:
        if timeout > 0 and self.inbox.empty():
            self.wake.wait(timeout)
        self.wake.clear()
        out = []
        while True:
            try:
                out.append(self.inbox.get_nowait())
            except queue.Empty:
                return out

    def send(self, events: list[Event], stats: EngineStats) -> None:
        """One wake-up of the HTTP loop per send: each call_soon_threadsafe wakes its thread, which then contends
        for the GIL and a core with the engine's while the step's parallel work waits."""
        if self.loop is None or self.client is None:
            return
        try:
            self.loop.call_soon_threadsafe(self.client.deliver, events, stats)
        except RuntimeError:      # the HTTP loop is gone (shutdown)
            pass


class QueueClient(EngineClient):
    """The HTTP side's end of a QueuePort."""

    def __init__(self, port: QueuePort, stats: EngineStats | None = None) -> None:
        super().__init__(stats)
        self.port = port

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.port.loop, self.port.client = loop, self

    def _send(self, message: tuple) -> None:
        self.port.inbox.put(message)
        self.port.wake.set()


class PipePort:
    """The engine loop's end of a pipe to an HTTP process; a dead or closed other end reads as EOFError."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def receive(self, timeout: float) -> list[tuple]:
        out = []
        try:
            if self.conn.poll(timeout):
                out.append(self.conn.recv())
                while self.conn.poll():
                    out.append(self.conn.recv())
        except OSError as exc:          # reset by a process that died with messages unread
            raise EOFError(str(exc)) from exc
        return out

    def send(self, events: list[Event], stats: EngineStats) -> None:
        try:
            self.conn.send((events, stats))
        except OSError as exc:          # broken pipe: the HTTP process is gone
            raise EOFError(str(exc)) from exc


class PipeClient(EngineClient):
    """The HTTP process's end of a pipe to the engine loop. Sends go through a thread of their own, so the event
    loop never blocks writing while the engine blocks writing the other way; `engine_gone` is done once the engine's
    end is closed, and every live request then fails."""

    def __init__(self, conn: Connection, stats: EngineStats | None = None) -> None:
        super().__init__(stats)
        self.conn = conn
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.engine_gone: asyncio.Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sender = threading.Thread(target=self._send_all, name="engine-pipe-send", daemon=True)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop, self.engine_gone = loop, loop.create_future()
        loop.add_reader(self.conn.fileno(), self._readable)
        self._sender.start()

    def _send(self, message: tuple) -> None:
        self.outbox.put(message)

    def _send_all(self) -> None:
        while (message := self.outbox.get()) is not None:
            try:
                self.conn.send(message)
            except OSError:             # the engine is gone; _readable sees the same and fails the requests
                return

    def _readable(self) -> None:
        try:
            while self.conn.poll():
                self.deliver(*self.conn.recv())
        except (EOFError, OSError):
            self._gone()

    def _gone(self) -> None:
        assert self._loop is not None and self.engine_gone is not None
        self._loop.remove_reader(self.conn.fileno())
        self.end(self.ended or "the engine process closed its end")
        if not self.engine_gone.done():
            self.engine_gone.set_result(None)

    def close(self) -> None:
        self.outbox.put(None)
        self.conn.close()

"""HTTP in a process of its own (`python -m systems.server --front-end process`), as vLLM splits off its API server.

The engine's process then keeps its GIL to the step: no SSE write, JSON parse or detokenize runs between its ops, and
an HTTP crash cannot take the engine's memory with it. It is not faster here: at 4 req/s of streamed 16 x (512 + 64)
requests on 2 cores (3 alternating rounds), mean TPOT was 73.1-80.9 ms against 71.4-71.9 ms with HTTP on a thread
(both with libgomp's default spin; torch's ops release the GIL, and a process switch costs more than a thread's), so
the thread stays the default. The two processes share one pipe (systems.engine_link): requests and aborts one way,
each step's tokens and the engine's state the other.

The HTTP process ignores SIGINT and SIGTERM: it ends when the engine's end of the pipe closes, so stopping the
engine process (however it is stopped, even killed) stops both, and a request in flight gets an error, not a hang;
an HTTP process that dies ends the engine loop (`python -m systems.server` then exits 1).
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from systems.engine_link import EngineFacts, PipeClient, PipePort, facts_of

log = logging.getLogger("kvharness.server")
STARTUP_TIMEOUT_S = 120


@dataclass(frozen=True)
class FrontEnd:
    """Everything the HTTP process is started with (it has no engine)."""

    facts: EngineFacts
    model_name: str
    host: str
    port: int
    max_queue: int
    retry_after_s: int
    max_body_bytes: int | None


@dataclass
class HttpProcess:
    """A running HTTP process; `engine_end` is the engine loop's end of its pipe."""

    url: str
    process: BaseProcess
    engine_end: PipePort

    def close(self) -> None:
        """Close the pipe (the HTTP process then finishes its responses and exits) and wait for it."""
        self.engine_end.conn.close()
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=10)


def start(system: Any, model_name: str, host: str = "127.0.0.1", port: int = 0, max_queue: int = 64,
          retry_after_s: int = 1, max_body_bytes: int | None = None) -> HttpProcess:
    """Serve `system` (an EngineSystem) on host:port from a new process; the caller runs an EngineLoop on the
    returned port. Raises OSError when the address cannot be bound."""
    front = FrontEnd(facts_of(system), model_name, host, port, max_queue, retry_after_s, max_body_bytes)
    ctx = multiprocessing.get_context("spawn")       # a fork would copy the engine's threads and OpenMP state
    engine_end, http_end = ctx.Pipe()
    process = ctx.Process(target=serve, args=(http_end, front), name="kvharness-http", daemon=True)
    process.start()
    http_end.close()
    try:
        if not engine_end.poll(STARTUP_TIMEOUT_S):
            raise RuntimeError(f"the HTTP process did not start within {STARTUP_TIMEOUT_S} s")
        kind, detail = engine_end.recv()
    except EOFError:
        process.join(timeout=10)
        raise RuntimeError(f"the HTTP process exited with code {process.exitcode} before serving; its log says "
                           "why") from None
    except BaseException:
        process.terminate()
        raise
    if kind == "failed":
        process.join(timeout=10)
        raise OSError(detail)
    return HttpProcess(detail, process, PipePort(engine_end))


def serve(conn: Connection, front: FrontEnd) -> None:
    """The HTTP process: bind, report ('ready', url) or ('failed', why), serve until the engine's end closes."""
    from aiohttp import web
    from transformers import AutoTokenizer

    from systems.openai_server import OpenAIServer

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    tokenizer = AutoTokenizer.from_pretrained(front.facts.model_dir)
    client = PipeClient(conn, front.facts.idle)
    server = OpenAIServer(client, front.facts, tokenizer, front.model_name, max_queue=front.max_queue,
                          retry_after_s=front.retry_after_s, max_body_bytes=front.max_body_bytes)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    try:
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, front.host, front.port).start())
    except OSError as exc:
        conn.send(("failed", str(exc)))
        return
    host, port = runner.addresses[0][:2]
    conn.send(("ready", f"http://{host}:{port}"))
    assert client.engine_gone is not None            # set by the app's startup
    try:
        loop.run_until_complete(client.engine_gone)
        loop.run_until_complete(runner.cleanup())
    finally:
        client.close()
        loop.close()

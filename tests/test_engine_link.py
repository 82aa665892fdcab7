"""The link between the HTTP side and the engine loop: one wake-up per send, events in order, an ended loop fails
whoever waits."""
from __future__ import annotations

import asyncio
import threading

from systems.base import GenerationRequest
from systems.engine_link import EngineClient, Live, QueueClient, QueuePort
from systems.engine_loop import EngineStats


def test_queue_port_hands_a_send_to_the_http_loop_with_one_wake_up_in_order():
    """In one process, each send of the engine loop is one call_soon_threadsafe onto the HTTP loop; every request
    gets its own events in order, the engine's state is the last sent, and events of a released request drop."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    wakeups = [0]
    plain = loop.call_soon_threadsafe

    def counted(callback, *args):
        wakeups[0] += callback == client.deliver
        return plain(callback, *args)
    loop.call_soon_threadsafe = counted       # type: ignore[method-assign]
    port = QueuePort()
    client = QueueClient(port)
    lives = [Live(GenerationRequest(f"r{i}", [1, 2], 4)) for i in range(3)]

    async def submit_all():
        client.start(asyncio.get_running_loop())
        for live in lives:
            client.submit(live)
        client.release(lives[2])        # never ended: also aborted
    try:
        asyncio.run_coroutine_threadsafe(submit_all(), loop).result(timeout=5)
        assert port.receive(1.0) == [("add", live.request, 0) for live in lives] + [("abort", "r2")]
        token = [("tokens", [t], None, None, None) for t in (5, 6, 7)]
        port.send([("r0", token[0]), ("r1", token[1]), ("r2", token[2]), ("r0", ("error", "boom"))],
                  EngineStats(serving=True, running=2))
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(timeout=5)
        got = [[live.events.get_nowait() for _ in range(live.events.qsize())] for live in lives]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
    assert got == [[token[0], ("error", "boom")], [token[1]], []]
    assert wakeups[0] == 1 and client.stats.running == 2 and client.healthy


def test_an_ended_engine_loop_fails_waiting_and_new_requests_at_once():
    """Once the loop has served and says it no longer does, every request still waiting gets an error, and so does
    every request submitted after; before the loop first serves, a request waits for it."""
    sent = []

    class Recorder(EngineClient):
        def _send(self, message: tuple) -> None:
            sent.append(message)

    async def scenario():
        client = Recorder()
        early = Live(GenerationRequest("early", [1], 2))
        client.submit(early)                           # not serving yet: queued for the loop, no error
        client.deliver([], EngineStats(serving=True))
        assert early.events.empty() and client.healthy
        client.deliver([("early", ("tokens", [3], None, None, None))], EngineStats(serving=False))
        late = Live(GenerationRequest("late", [1], 2))
        client.submit(late)
        return ([early.events.get_nowait() for _ in range(early.events.qsize())], late.events.get_nowait(),
                client.healthy, client.lives)

    early_events, late_event, healthy, lives = asyncio.run(scenario())
    assert early_events == [("tokens", [3], None, None, None), ("error", "the engine loop ended")]
    assert late_event == ("error", "the engine loop ended") and not healthy and lives == {}
    assert [m[0] for m in sent] == ["add"]             # the late request never reached the engine

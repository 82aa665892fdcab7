"""How the engine server runs: the engine loop on the thread that calls run() (the command line's main thread, which
built the engine), HTTP on another thread or in a process of its own, and both ending together."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest


@pytest.fixture(scope="module")
def system(tiny_llama_dir):
    from systems.engine.system import EngineSystem

    engine = SimpleNamespace(device_memory_gb=0.01, host_memory_gb=0.01, max_num_seqs=2, page_size=16)
    return EngineSystem(str(tiny_llama_dir), "dense", {}, engine=engine, dtype="float32")


def test_engine_loop_steps_on_the_thread_that_runs_it(system):
    """engine_thread=False: the app starts no engine thread; whoever calls loop.run() steps the engine (the command
    line's main thread, which built it), /health is 200 while it runs and 503 once stop_soon() ended it."""
    from systems.openai_server import start_in_thread

    running = start_in_thread(system, "tiny", engine_thread=False)
    loop, stepped_on = running.engine_loop, set()
    engine_step = loop.engine.step

    def step():
        stepped_on.add(threading.current_thread().name)
        return engine_step()

    loop.engine.step = step
    try:
        assert httpx.get(running.url + "/health").status_code == 503      # nobody steps yet
        runner = threading.Thread(target=loop.run, name="caller")
        runner.start()
        reply = httpx.post(running.url + "/v1/completions", timeout=30,
                           json={"model": "tiny", "prompt": "The quick", "max_tokens": 3, "temperature": 0})
        assert reply.status_code == 200 and httpx.get(running.url + "/health").status_code == 200
        loop.stop_soon()
        runner.join(timeout=10)
        assert not runner.is_alive() and stepped_on == {"caller"}
        assert httpx.get(running.url + "/health").status_code == 503
    finally:
        del loop.engine.step
        loop.stop_soon()
        running.close()


@pytest.mark.parametrize("front_end", ["thread", "process"])
def test_cli_server_stops_cleanly_on_sigterm(tiny_llama_dir, front_end):
    """`python -m systems.server` steps its engine on the main thread and serves HTTP from a second thread or a
    process of its own; SIGTERM ends the engine loop, then HTTP, and the process exits 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "systems.server", "--model", str(tiny_llama_dir),
                             "--served-model-name", "tiny", "--port", str(port), "--dtype", "float32",
                             "--device-memory-gb", "0.05", "--host-memory-gb", "0.05", "--front-end", front_end])
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        reply = httpx.post(url + "/v1/completions", timeout=30,
                           json={"model": "tiny", "prompt": "The quick", "max_tokens": 4, "temperature": 0})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_cli_server_exits_1_when_its_http_process_dies(tiny_llama_dir):
    """With --front-end process, an HTTP process that dies ends the engine loop and the command exits 1, not 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "systems.server", "--model", str(tiny_llama_dir),
                             "--served-model-name", "tiny", "--port", str(port), "--dtype", "float32",
                             "--device-memory-gb", "0.05", "--host-memory-gb", "0.05", "--front-end", "process"])
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        http = [c for c in children if b"kvharness-http" in Path(f"/proc/{c}/cmdline").read_bytes()
                or b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
        assert http, children
        os.kill(int(http[0]), signal.SIGKILL)
        assert proc.wait(30) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_http_process_and_engine_loop_end_together(system):
    """HTTP in a process of its own: /health follows the engine loop (503 once it ended), closing the pipe ends the
    HTTP process with code 0, and an HTTP process that dies ends the engine loop instead of leaving it serving
    no one."""
    from systems import http_process
    from systems.engine_loop import EngineLoop

    front = http_process.start(system, "tiny")
    loop = EngineLoop(system.engine, front.engine_end)
    runner = threading.Thread(target=loop.run)
    runner.start()
    try:
        reply = httpx.post(front.url + "/v1/completions", timeout=30,
                           json={"model": "tiny", "prompt": "The quick", "max_tokens": 3, "temperature": 0})
        assert reply.status_code == 200 and httpx.get(front.url + "/health").status_code == 200
        loop.stop_soon()
        runner.join(timeout=10)
        deadline = time.monotonic() + 10
        while httpx.get(front.url + "/health").status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(front.url + "/health").json()["status"] == "error"
    finally:
        loop.stop_soon()
        front.close()
    assert front.process.exitcode == 0

    front = http_process.start(system, "tiny")
    loop, failures = EngineLoop(system.engine, front.engine_end), []

    def run() -> None:
        try:
            loop.run()
        except BaseException as exc:  # noqa: BLE001 - the test asserts there is none
            failures.append(exc)
    runner = threading.Thread(target=run)
    runner.start()
    def stream() -> None:
        try:
            httpx.post(front.url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": "The quick", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                "stream": True})
        except httpx.HTTPError:        # the HTTP process is killed under it, as meant
            pass
    streaming = threading.Thread(target=stream)
    try:
        streaming.start()
        deadline = time.monotonic() + 30
        while httpx.get(front.url + "/health").json()["running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        front.process.kill()                  # mid-stream: the engine has a sequence and sends every step
        runner.join(timeout=10)
        assert not runner.is_alive() and failures == [] and loop.http_gone
        assert system.engine.kv.device_blocks.num_used == 0       # its sequence was taken out of the engine
    finally:
        loop.stop_soon()
        front.close()
        streaming.join(timeout=30)


def test_a_port_in_use_is_refused_before_serving(system):
    from systems import http_process

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(OSError):
            http_process.start(system, "tiny", port=s.getsockname()[1])


def test_the_command_line_sets_the_spin_count_before_torch_loads(tmp_path):
    """GOMP_SPINCOUNT is read once, when torch loads libgomp: importing the server module must not load torch, and
    main() sets the count (over the environment's) before anything that does."""
    probe = ("import os, sys\n"
             "import systems.server as server\n"
             "assert 'torch' not in sys.modules, 'importing systems.server loaded torch'\n"
             "import builtins\n"
             "real = builtins.__import__\n"
             "def watch(name, *a, **k):\n"
             "    if name.partition('.')[0] == 'torch' and 'torch' not in sys.modules:\n"
             "        print('spin at torch load', os.environ.get('GOMP_SPINCOUNT'), flush=True)\n"
             "    return real(name, *a, **k)\n"
             "builtins.__import__ = watch\n"
             f"sys.exit(server.main(['--model', {str(tmp_path)!r}, '--omp-spin-count', '12345']))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "GOMP_SPINCOUNT": "7"})
    assert out.returncode == 2 and "has no config.json" in out.stderr, out.stderr
    assert "spin at torch load 12345" in out.stdout

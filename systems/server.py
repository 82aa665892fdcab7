"""`python -m systems.server`: the OpenAI-compatible engine server (systems/openai_server.py) from the command line.

Arguments are checked before any model load; then the engine loop runs on the main thread, which built the engine
(systems/engine_loop.py says why), and HTTP on a second thread, or with `--front-end process` in a process of its
own (systems/http_process.py says what that buys and costs). SIGINT / SIGTERM end the engine loop after its current
step, then HTTP.

OpenMP spin-waiting: the server's engine process keeps libgomp's own default (spin 300,000 iterations before a
worker sleeps), as vLLM's worker does, not the short spin the `systems` package sets for shared offline runs. Here
the engine is the machine's one heavy job and a step is hundreds of short parallel ops: with the short spin each op
woke a sleeping worker, and at 4 req/s of streamed 512 + 64-token requests on 2 cores the server kept 1.80-1.82
cores busy with a mean TPOT of 77-87 ms, against 1.93-1.94 and 71-79 ms with the default (3 alternating rounds).
The count is set before torch loads its OpenMP runtime, so this module imports nothing that loads torch at the top.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

from systems import SERVER_SPIN_COUNT

log = logging.getLogger("kvharness.server")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m systems.server",
                                description="OpenAI-compatible HTTP server over the paged engine and a KV policy.")
    p.add_argument("--model", required=True, help="local HF safetensors folder (python -m harness.integrations.serve)")
    p.add_argument("--served-model-name", help="the `model` clients send (default: the folder's name)")
    p.add_argument("--model-name", help="the name the policy's profile is found by (default: the served name)")
    p.add_argument("--policy", default="dense", help="module name in systems/policies")
    p.add_argument("--params", default="{}", help="policy hyperparameters as JSON, e.g. '{\"budget\": 512}'")
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback unless you open it on purpose)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="auto", help="auto | bfloat16 | float32")
    p.add_argument("--max-model-len", type=int, help="context limit (default: the model's)")
    p.add_argument("--max-queue", type=int, default=64, help="waiting requests beyond which the server answers 503")
    p.add_argument("--retry-after", type=int, default=1, help="seconds sent in Retry-After with a 503")
    p.add_argument("--engine", default="{}", help="the engine config (systems/engine/config.py) as one JSON object")
    p.add_argument("--max-body-mb", type=float, help="request bodies beyond this many MiB get 413 unread "
                                                     "(default: 128 bytes per context token, at least 1 MiB)")
    for flag, kind in (("page-size", int), ("device-memory-gb", float), ("host-memory-gb", float),
                       ("max-num-seqs", int), ("max-num-batched-tokens", int), ("threads", int)):
        p.add_argument(f"--{flag}", type=kind, help="engine setting, over --engine (default: the engine's)")
    p.add_argument("--front-end", choices=("thread", "process"), default="thread",
                   help="where HTTP runs: a thread beside the engine loop (default, faster on 2 cores) or a process "
                        "of its own")
    p.add_argument("--omp-spin-count", type=int, default=SERVER_SPIN_COUNT,
                   help="GOMP_SPINCOUNT for the engine's OpenMP team, over the environment's (default: libgomp's "
                        f"own, {SERVER_SPIN_COUNT})")
    p.add_argument("--no-chunked-prefill", action="store_true",
                   help="prefill each prompt whole in its own step instead of in chunks beside the decodes")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.omp_spin_count < 0:
        print(f"error: --omp-spin-count {args.omp_spin_count} must be >= 0", file=sys.stderr)
        return 2
    os.environ["GOMP_SPINCOUNT"] = str(args.omp_spin_count)     # read once, when torch loads libgomp (below)
    from systems.engine.config import EngineConfig
    from systems.registry import SystemConfigError, parse_policy

    try:
        params = json.loads(args.params)
        if not isinstance(params, dict):
            raise ValueError("not an object")
    except ValueError as exc:
        print(f"error: --params must be a JSON object such as '{{\"budget\": 512}}' ({exc})", file=sys.stderr)
        return 2
    if args.max_queue < 0 or not 0 < args.port < 65536:
        print("error: --max-queue must be >= 0 and --port in 1..65535", file=sys.stderr)
        return 2
    if args.max_body_mb is not None and not args.max_body_mb * (1 << 20) >= 1:
        print(f"error: --max-body-mb {args.max_body_mb} must be positive", file=sys.stderr)
        return 2
    try:
        policy = parse_policy(args.policy, params)   # a typo costs a second, not a model load
    except SystemConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from pathlib import Path

    from systems.engine.system import EngineSystem

    if not (Path(args.model) / "config.json").is_file():
        print(f"error: --model {args.model} has no config.json; pass a local HF safetensors folder", file=sys.stderr)
        return 2
    try:
        engine_cfg = EngineConfig.coerce({**json.loads(args.engine), **{k: v for k, v in (
            ("page_size", args.page_size), ("device_memory_gb", args.device_memory_gb),
            ("host_memory_gb", args.host_memory_gb), ("max_num_seqs", args.max_num_seqs),
            ("max_num_batched_tokens", args.max_num_batched_tokens), ("threads", args.threads),
            ("chunked_prefill", False if args.no_chunked_prefill else None)) if v is not None}})
    except (ValueError, TypeError) as exc:
        print(f"error: --engine: {exc}", file=sys.stderr)
        return 2
    name = args.served_model_name or Path(args.model).resolve().name
    system = EngineSystem(args.model, args.policy, params, engine=engine_cfg, dtype=args.dtype, policy=policy,
                          name=f"engine-{args.policy}", max_model_len=args.max_model_len,
                          model_name=args.model_name or name)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    max_body = None if args.max_body_mb is None else int(args.max_body_mb * (1 << 20))
    from systems import openai_server

    try:
        if args.front_end == "process":
            from systems import http_process
            from systems.engine_loop import EngineLoop

            front = http_process.start(system, name, args.host, args.port, args.max_queue, args.retry_after, max_body)
            engine_loop, url, close = EngineLoop(system.engine, front.engine_end), front.url, front.close
        else:
            running = openai_server.start_in_thread(system, name, args.host, args.port, args.max_queue,
                                                    args.retry_after, max_body, engine_thread=False)
            engine_loop, url, close = running.engine_loop, running.url, running.close
    except OSError as exc:
        print(f"error: cannot listen on {args.host}:{args.port} ({exc}); pick a free --port", file=sys.stderr)
        return 2
    for sig in (signal.SIGINT, signal.SIGTERM):      # end the engine loop; HTTP is closed after it
        signal.signal(sig, lambda *_: engine_loop.stop_soon())
    log.info("serving %s (policy %s %s) on %s, HTTP on a %s, GOMP_SPINCOUNT %d", name, args.policy,
             params, url, args.front_end, args.omp_spin_count)
    try:
        engine_loop.run()        # the engine steps on the thread that built it
    finally:
        close()
    return 1 if engine_loop.http_gone else 0

if __name__ == "__main__":
    sys.exit(main())

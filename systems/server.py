"""`python -m systems.server`: the OpenAI-compatible engine server (systems/openai_server.py) from the command line.

Arguments are checked before any model load; then the engine loop runs on the main thread, which built the engine,
and HTTP on a second one (systems/engine_loop.py says why). SIGINT / SIGTERM end the engine loop after its current
step, then HTTP."""
from __future__ import annotations

import argparse
import json
import logging
import signal
import sys

from systems import openai_server

log = logging.getLogger("kvharness.server")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m systems.server",
                                description=(openai_server.__doc__ or "").splitlines()[0])
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
    p.add_argument("--no-chunked-prefill", action="store_true",
                   help="prefill each prompt whole in its own step instead of in chunks beside the decodes")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
    try:
        running = openai_server.start_in_thread(system, name, args.host, args.port, args.max_queue, args.retry_after,
                                  None if args.max_body_mb is None else int(args.max_body_mb * (1 << 20)),
                                  engine_thread=False)
    except OSError as exc:
        print(f"error: cannot listen on {args.host}:{args.port} ({exc}); pick a free --port", file=sys.stderr)
        return 2
    for sig in (signal.SIGINT, signal.SIGTERM):      # end the engine loop; HTTP is closed after it
        signal.signal(sig, lambda *_: running.server.loop.stop_soon())
    log.info("serving %s (policy %s %s) on %s", name, args.policy, params, running.url)
    try:
        running.server.loop.run()        # the engine steps on the thread that built it
    finally:
        running.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

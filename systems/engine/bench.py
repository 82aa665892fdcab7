"""Quick offline throughput check of the engine: `python -m systems.engine.bench MODEL_DIR --requests 16 ...`.

Prompts are random token ids and EOS is ignored, so every request runs exactly input + output tokens; the
harness's offline_throughput experiment is the real comparison (real prompts, vLLM and HF beside the engine).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from systems.base import GenerationRequest
from systems.engine.engine import Engine
from systems.policies import load_policy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--input", type=int, default=4000)
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--policy", default="dense")
    ap.add_argument("--params", default="{}", help="policy hyperparameters as JSON")
    ap.add_argument("--device-memory-gb", type=float, default=2.0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = SimpleNamespace(page_size=16, device_memory_gb=args.device_memory_gb, host_memory_gb=8.0,
                          max_num_seqs=args.requests, max_num_batched_tokens=8192)
    # an embedded model's folder is named for it: its policy's profile is found by that name
    engine = Engine(args.model_dir, load_policy(args.policy, json.loads(args.params)), cfg, dtype=args.dtype,
                    model_name=Path(args.model_dir).resolve().name)
    g = torch.Generator().manual_seed(0)
    vocab = engine.model.spec.vocab_size
    requests = [GenerationRequest(str(i), torch.randint(100, vocab, (args.input,), generator=g).tolist(),
                                  args.output, ignore_eos=True) for i in range(args.requests)]
    start = time.perf_counter()
    seqs = engine.generate(requests)
    wall = time.perf_counter() - start
    prefill_done = max(s.token_times[0] for s in seqs) - start
    out_tokens = sum(s.num_output_tokens for s in seqs)
    total = out_tokens + sum(s.num_prompt_tokens for s in seqs)
    print(json.dumps({"wall_s": round(wall, 2), "total_tok_s": round(total / wall, 1),
                      "output_tok_s": round(out_tokens / wall, 1), "req_s": round(len(seqs) / wall, 3),
                      "last_first_token_s": round(prefill_done, 2),
                      "device_kv_peak_bytes": engine.kv.device_blocks.peak_bytes,
                      "preemptions": engine.scheduler.num_preemptions, "dtype": str(engine.dtype),
                      "threads": args.threads}))


if __name__ == "__main__":
    main()

"""vLLM vs HF transformers greedy agreement on essay needle prompts, plus vLLM's offline time for a fixed batch.

    .venv/bin/python scripts/vllm_agreement.py                # 10 needle prompts of ~2k tokens, bf16
    .venv/bin/python scripts/vllm_agreement.py --throughput   # also 8 x (2048 in + 64 out), EOS ignored
    .venv/bin/python scripts/vllm_agreement.py --throughput --n 0 --omp-threads-bind 0-1   # timing only

Agreement is reported three ways: whole greedy continuations equal, mean fraction of the continuation before
the first differing token, and whether each system's answer contains the planted number. bf16 kernels differ
between the two runtimes, so a continuation may fork after a near-tie; the needle answer should not.
The `__main__` guard is required: vLLM spawns its engine process.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CITIES = ["Lisbon", "Nairobi", "Osaka", "Quito", "Tallinn", "Perth", "Accra", "Hanoi", "Bergen", "Cusco",
          "Dakar", "Riga"]


def needle_prompts(tokenizer, n: int, context_tokens: int) -> list[tuple[list[int], str]]:
    """(chat-rendered token ids, planted number) with the needle at depths spread from 10% to 90%."""
    from tasks.base import chat_prompt_ids
    from tasks.haystack import build_context, char_at_depth

    out = []
    for i in range(n):
        rng = random.Random(i)
        city, number = CITIES[i % len(CITIES)], str(rng.randint(1000000, 9999999))
        context = build_context(tokenizer, context_tokens, rng)
        at = char_at_depth(tokenizer, context, 10 + 80 * i / max(n - 1, 1))
        needle = f" The special magic number for {city} is {number}. "
        text = (context[:at] + needle + context[at:] +
                f"\n\nWhat is the special magic number for {city} mentioned in the text above? "
                "Answer with the number only.")
        out.append((chat_prompt_ids(tokenizer, text), number))      # as the harness renders prompts
    return out


def prefix_fraction(a: list[int], b: list[int]) -> float:
    same = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return same / max(len(a), len(b), 1)


def fixed_batch(tokenizer, n: int, input_tokens: int) -> list[list[int]]:
    """`n` distinct essay cuts of exactly `input_tokens` tokens."""
    from tasks.haystack import essays

    ids = tokenizer.encode(" ".join(text for _, text in essays()), add_special_tokens=False)
    stride = max((len(ids) - input_tokens) // max(n, 1), 1)
    return [ids[k * stride:k * stride + input_tokens] for k in range(n)]


def compare(prompts, v_out, h_out, report: dict) -> None:
    """Add the three agreement measures (and one row per prompt) to `report`."""
    rows = []
    for (_ids, number), v, h in zip(prompts, v_out, h_out):
        rows.append({"equal": v.token_ids == h.token_ids, "prefix": prefix_fraction(v.token_ids, h.token_ids),
                     "vllm_correct": number in v.text, "hf_correct": number in h.text,
                     "vllm": v.text.strip()[:90], "hf": h.text.strip()[:90], "needle": number})
    n = len(rows)
    report.update({
        "exact_agreement": sum(r["equal"] for r in rows) / n,
        "mean_prefix_fraction": sum(r["prefix"] for r in rows) / n,
        "vllm_needle_accuracy": sum(r["vllm_correct"] for r in rows) / n,
        "hf_needle_accuracy": sum(r["hf_correct"] for r in rows) / n,
        "rows": rows})
    for r in rows:
        print(f"{'=' if r['equal'] else '!'} {r['prefix']:.2f} needle={r['needle']} vllm={r['vllm']!r} hf={r['hf']!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=10, help="needle prompts (0: skip the agreement check)")
    ap.add_argument("--context-tokens", type=int, default=2000)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--throughput", action="store_true", help="also time 8 x (2048 in + 64 out) through vLLM")
    ap.add_argument("--omp-threads-bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND, e.g. 0-1 (default: auto)")
    ap.add_argument("--out", type=Path, default=None, help="write the numbers as JSON here")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from harness.integrations.assets import model_dir
    from systems.base import GenerationRequest
    from systems.hf import HFSystem
    from systems.vllm import VLLMSystem

    path = model_dir()
    tok = AutoTokenizer.from_pretrained(path)
    prompts = needle_prompts(tok, args.n, args.context_tokens)
    reqs = [GenerationRequest(f"needle{i}", ids, args.new_tokens) for i, (ids, _) in enumerate(prompts)]
    report: dict = {"dtype": args.dtype, "prompts": len(reqs),
                    "prompt_tokens": [len(r.prompt_token_ids) for r in reqs], "new_tokens": args.new_tokens}

    t0 = time.perf_counter()
    vllm = VLLMSystem(path, dtype=args.dtype, max_model_len=8192, kv_cache_space_gb=2,
                      omp_threads_bind=args.omp_threads_bind)
    report["vllm_startup_s"] = time.perf_counter() - t0
    v_out = vllm.generate(reqs) if reqs else []
    if args.throughput:
        batch = [GenerationRequest(f"tp{i}", ids, 64, ignore_eos=True)
                 for i, ids in enumerate(fixed_batch(tok, 8, 2048))]
        vllm.reset_stats()
        t0 = time.perf_counter()
        done = vllm.generate(batch)
        wall = time.perf_counter() - t0
        n_in, n_out = sum(c.prompt_tokens for c in done), sum(c.output_tokens for c in done)
        report["throughput_8x2048+64"] = {
            "wall_s": wall, "total_tok_s": (n_in + n_out) / wall, "output_tok_s": n_out / wall,
            "req_s": len(done) / wall, "device_kv_peak_bytes": vllm.memory_report().device_kv_peak_bytes,
            "mean_ttft_s": sum(c.ttft for c in done) / len(done)}
    vllm.close()
    if reqs:
        compare(prompts, v_out, HFSystem(str(path), dtype=args.dtype, batch_size=1).generate(reqs), report)
    print(json.dumps({k: v for k, v in report.items() if k != "rows"}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

"""The fused mixed step (ops/cpu_mixed.cpp): decode rows beside prompt chunks, and prefill steps, in one C++ call.

It makes the per-op path's kernel calls on the same tensors, so the two must agree bit for bit: every chosen token,
the bits of every log-probability and of every prompt score, in bf16 and fp32, through each of the three ways a
product is multiplied (oneDNN's prepacked kernel, the widened fp32 GEMM, at::linear), with a QKV bias, and with the
later chunks of a prompt (whose attention is masked) beside running decodes.
"""
import random
from types import SimpleNamespace

import pytest
import torch

from systems.base import GenerationRequest
from systems.engine.engine import Engine
from systems.engine.ops import cpu_kernels
from systems.policies import load_policy

pytestmark = pytest.mark.skipif(not cpu_kernels.has_fused_decode(), reason="CPU kernels not built")


def _engine(path, dtype: str, fused: bool, policy: str = "dense", budget: int = 40) -> Engine:
    P = 4
    cfg = SimpleNamespace(page_size=P, device_memory_gb=4096 * 2 * P * 16 * 4 / 2 ** 30,
                          host_memory_gb=4096 * 2 * P * 16 * 4 / 2 ** 30, max_num_seqs=4,
                          max_num_batched_tokens=budget, batch_invariant=False, fused_decode=fused)
    module = {"quest": "quest"}.get(policy, policy)
    return Engine(str(path), load_policy(module, {}), cfg, dtype=dtype)


def _multiply(engine: Engine, gemm: str) -> None:
    """Make every product take one way of multiplying (on any CPU): the widened fp32 GEMM or plain at::linear."""
    for lw in engine.model.layers:
        for linear in (lw.qkv, lw.o, lw.gate_up, lw.down):
            if gemm in ("widened", "plain"):
                linear.packed = None
            if gemm == "widened":
                linear.wide = (linear.weight.float(), None if linear.bias is None else linear.bias.float())
            elif gemm == "plain":
                linear.wide = None


def _generate(engine: Engine) -> list:
    rng = random.Random(5)
    # prompts longer than the 40-token step budget: each enters in chunks (the later ones masked) while the
    # earlier requests decode beside them
    requests = [GenerationRequest(f"r{i}", [rng.randrange(3, 49000) for _ in range(n)], 10, ignore_eos=True,
                                  logprob_steps=2, prompt_logprobs=2 if i == 1 else None)
                for i, n in enumerate((37, 90, 61, 18))]
    seqs = engine.generate(requests)
    return [(s.output_ids, s.token_logprobs, s.prompt_logprobs, [t.tolist() for t in s.logprob_rows])
            for s in seqs]


@pytest.mark.parametrize("gemm", ["as built", "widened", "plain"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fused_mixed_step_equals_the_per_op_step(tiny_llama_dir, dtype, gemm):
    runs = {}
    for fused in (True, False):
        engine = _engine(tiny_llama_dir, dtype, fused)
        _multiply(engine, gemm)
        runs[fused] = _generate(engine), engine.runner.mixed
    (fused_out, mixed), (per_op_out, none) = runs[True], runs[False]
    assert none is None and mixed is not None
    assert mixed.steps >= 5, "the workload must run mixed and prefill steps through the fused call"
    assert fused_out == per_op_out


def test_fused_mixed_step_with_a_qkv_bias(tiny_qwen2_dir):
    fused = _engine(tiny_qwen2_dir, "bfloat16", True)
    assert fused.runner.mixed is not None
    assert _generate(fused) == _generate(_engine(tiny_qwen2_dir, "bfloat16", False))
    assert fused.runner.mixed.steps >= 5


def test_policies_with_hooks_inside_a_layer_keep_the_per_op_step(tiny_llama_dir):
    """A page choice at decode time (Quest) runs between a layer's pieces: the runner says so and keeps the per-op
    mixed step; batch-invariant mode (tiled GEMMs) keeps it too."""
    engine = _engine(tiny_llama_dir, "bfloat16", True, policy="quest")
    assert engine.runner.mixed is None and "select_pages" in engine.runner.mixed_unsupported
    cfg = SimpleNamespace(page_size=4, device_memory_gb=0.01, host_memory_gb=0.01, max_num_seqs=4,
                          max_num_batched_tokens=40, batch_invariant=True)
    invariant = Engine(str(tiny_llama_dir), load_policy("dense", {}), cfg, dtype="bfloat16")
    assert invariant.runner.mixed is None and "batch-invariant" in invariant.runner.mixed_unsupported


def test_a_chunk_without_pages_fails_before_the_cache_changes(tiny_llama_dir):
    """The op checks every chunk's pages in every layer before the first layer writes anything."""
    engine = _engine(tiny_llama_dir, "float32", True)
    kv, model = engine.kv, engine.model
    spec = model.spec
    before = (kv.k_pool.clone(), kv.num_tokens.clone())
    ids = torch.tensor([5, 6, 7])
    cos, sin = model.rope(torch.arange(3), next(iter(model.rope_tables)))
    kind, flat = engine.runner.mixed._weights(3)
    with pytest.raises(RuntimeError, match="no device block"):
        torch.ops.kvharness_cpu.mixed_layers(
            torch.nn.functional.embedding(ids, model.embed), None, flat, kind, cos, sin, kv.k_pool, kv.v_pool,
            kv.block_table, kv.num_tokens, kv.kmin, kv.kmax, torch.empty(0, dtype=torch.long), [0], [0], [3],
            spec.num_q_heads, spec.intermediate_size, spec.rms_norm_eps, kv.scale)
    assert torch.equal(kv.k_pool, before[0]) and torch.equal(kv.num_tokens, before[1])

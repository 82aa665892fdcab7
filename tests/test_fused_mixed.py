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

# policies whose decode rows run whole in the fused step (a page rule, or an eviction deferred to the step's end)
# and, but Quest, an after-prefill hook; small budgets so their pages move in mixed steps (as test_engine_invariants)
_POLICIES = {
    "quest": ("quest", dict(budget=12, skip_layers=0)),
    "quest_efficiency": ("quest", dict(budget=12, skip_layers=0, selection_rule="efficiency_kernels",
                                       granularity="kv_head")),
    "flexicache": ("flexicache", dict(budget=8, rerank_interval=3, unstable_heads=[[1, 0]])),
    "flexicache_naive": ("flexicache", dict(budget=8, naive=True, unstable_heads=[[0, 0], [0, 1]])),
    "snapkv": ("snapkv", dict(budget=40, window=8)),
    "pyramidkv": ("pyramidkv", dict(budget=40, window=8)),
    "h2o": ("h2o", dict(budget=40)),
    "tova": ("tova", dict(budget=40)),
    "streaming": ("streaming", dict(budget=40)),
    "cake": ("cake", dict(budget=48, window=8)),
    "lserve": ("lserve", dict(budget=16, sink_tokens=4, local_tokens=8, physical_page=8, reuse_interval=2,
                              streaming_heads=[[0, 1], [1, 0]])),
}


def _engine(path, dtype: str, fused: bool, policy: str = "dense", budget: int = 40, blocks: int = 4096) -> Engine:
    P = 4
    cfg = SimpleNamespace(page_size=P, device_memory_gb=blocks * 2 * P * 16 * 4 / 2 ** 30,
                          host_memory_gb=4096 * 2 * P * 16 * 4 / 2 ** 30, max_num_seqs=4,
                          max_num_batched_tokens=budget, batch_invariant=False, fused_decode=fused)
    name, params = _POLICIES.get(policy, (policy, {}))
    return Engine(str(path), load_policy(name, dict(params)), cfg, dtype=dtype)


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


def _record_steps(engine: Engine, finishing: list[bool] | None = None) -> list[tuple[int, list[tuple[int, int, int]]]]:
    """Each fused step's decode-row count and chunks (slot, start, end), as the call saw them; `finishing` gets, per
    step, whether a chunk finished its prompt."""
    mixed, seen = engine.runner.mixed, []
    hidden = mixed.hidden

    def recorded(ids, positions, slots, infos, chunks):
        seen.append((len(slots), [(info.slot, a, b) for _, info, a, b in chunks]))
        if finishing is not None:
            finishing.append(any(b >= seq.compress_end for seq, _, _, b in chunks))
        return hidden(ids, positions, slots, infos, chunks)

    mixed.hidden = recorded
    return seen


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
    _check_equal(tiny_llama_dir, dtype, gemm)


def _check_equal(path, dtype: str, gemm: str) -> None:
    per_op = _engine(path, dtype, False)
    assert per_op.runner.mixed is None
    _multiply(per_op, gemm)
    fused = _engine(path, dtype, True)
    _multiply(fused, gemm)
    steps = _record_steps(fused)
    assert _generate(fused) == _generate(per_op)
    assert fused.runner.mixed.steps == len(steps)
    # the cases the call must get right all ran through it: a prefill step of several chunks, decode rows beside a
    # later chunk (masked attention, read-back of stored pages) that starts inside a page
    assert any(nd == 0 and len(chunks) >= 2 for nd, chunks in steps)
    assert any(nd > 0 and any(a > 0 and a % 4 for _, a, _ in chunks) for nd, chunks in steps)


@pytest.mark.parametrize("gemm", ["as built", "widened", "plain"])
def test_fused_mixed_step_with_a_qkv_bias(tiny_qwen2_dir, gemm):
    _check_equal(tiny_qwen2_dir, "bfloat16", gemm)


@pytest.fixture(scope="module")
def tiny_head64_dir(tmp_path_factory, tokenizer_dir):
    """A tiny Llama with 64-dim heads, the size this project's bf16 prompt kernel is built for."""
    from transformers import LlamaConfig

    from tests.conftest import _save_tiny
    cfg = LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    return _save_tiny(tmp_path_factory.mktemp("tiny_head64"), cfg, tokenizer_dir)


@pytest.mark.skipif(not hasattr(torch.ops.kvharness_cpu, "prompt_attention"), reason="no AVX512-BF16 prompt kernel")
def test_fused_mixed_step_takes_the_prompt_kernel_the_per_op_step_takes(tiny_head64_dir, monkeypatch):
    """Where prompt attention runs this project's bf16 kernel (CPUs with AVX512-BF16; on AMX tiles where the CPU has
    them), the fused call runs it too, and the two paths still agree bit for bit."""
    monkeypatch.setitem(cpu_kernels._state, "prompt", True)
    with monkeypatch.context() as patch:
        patch.setattr(cpu_kernels.torch_attention, "prompt_attention",
                      lambda *a, **k: pytest.fail("the per-op path must take the bf16 kernel here"))
        expected = _generate(_engine(tiny_head64_dir, "bfloat16", False))
    fused = _engine(tiny_head64_dir, "bfloat16", True)
    assert _generate(fused) == expected and fused.runner.mixed.steps > 0
    # torch's SDPA in the fused call gives other bits: the equality above was the kernel's
    monkeypatch.setitem(cpu_kernels._state, "prompt", False)
    assert _generate(_engine(tiny_head64_dir, "bfloat16", True)) != expected


def test_products_of_mixed_kinds_keep_the_per_op_step(tiny_llama_dir):
    """Where the products would not all multiply one way (one Linear widened, the rest plain), the step runs op by
    op rather than through one GEMM kind for all; below the widened GEMM's row threshold all are plain again."""
    from systems.engine.models.linear import WIDEN_MIN_ROWS

    fused, per_op = _engine(tiny_llama_dir, "bfloat16", True), _engine(tiny_llama_dir, "bfloat16", False)
    for engine in (fused, per_op):
        _multiply(engine, "plain")
        lw = engine.model.layers[1]
        lw.down.wide = (lw.down.weight.float(), None)
    steps = _record_steps(fused)
    assert _generate(fused) == _generate(per_op)
    rows = [nd + sum(b - a for _, a, b in chunks) for nd, chunks in steps]
    assert max(rows) >= WIDEN_MIN_ROWS           # such steps were offered, and declined (nothing counted)
    assert fused.runner.mixed.steps == sum(r < WIDEN_MIN_ROWS for r in rows)


def _lockstep_mixed(path, policy: str, requests: list, arrive_at: list[int], blocks: int = 4096,
                    kept: str | None = None) -> tuple[Engine, list, list[bool], list[dict]]:
    """Two engines over the same arrivals, one with the fused mixed step and one per op, compared after every step
    (test_deferred_eviction.lockstep): a policy that moves pages after the step (promotions, evictions) frees blocks
    the per-op step's later layers take again, so its blocks may differ while what every head holds does not; Quest
    moves none, and is held to the same blocks too."""
    from tests.test_deferred_eviction import instrument, lockstep, pages_state

    fused, per_op = (_engine(path, "float32", True, policy=policy, budget=24, blocks=blocks) for _ in range(2))
    per_op.runner.mixed = None
    assert fused.runner.mixed is not None, fused.runner.mixed_unsupported
    finishing: list[bool] = []
    steps = _record_steps(fused, finishing)
    logs = [instrument(engine, ("after_prefill_layer",)) for engine in (fused, per_op)]
    lockstep((fused, per_op), logs, requests, arrive_at, state=None if policy.startswith("quest") else pages_state)
    if kept is not None:
        assert fused.release_prefix(kept) and per_op.release_prefix(kept)
        assert fused.kv.device_blocks.num_free == per_op.kv.device_blocks.num_free
    assert fused.runner.mixed.steps == len(steps)
    return fused, steps, finishing, logs


@pytest.mark.parametrize("policy", ["quest", "quest_efficiency", "flexicache", "flexicache_naive", "snapkv",
                                    "pyramidkv", "h2o", "tova", "streaming", "cake"])
def test_policy_mixed_steps_equal_the_per_op_step(tiny_llama_dir, policy):
    """The decode rows beside prompt chunks choose their pages by the policy's rule inside the call (Quest,
    FlexiCache) or evict after it (the ScoreAndKeep policies, Streaming, CAKE), and the chunks that finish a prompt
    hand the policy's after-prefill hook its queries and keys layer by layer: after every step the two engines hold
    the same cache (every head's pages on both tiers, free blocks, ledgers), logits bits and MinMax bytes read, and
    end with the same tokens and kv_stats."""
    rng = random.Random(9)
    g = torch.Generator().manual_seed(9)
    # prompts longer than the 24-token step budget enter in chunks while earlier requests decode beside them
    requests = [GenerationRequest(f"r{i}", torch.randint(3, 200, (rng.randint(5, 70),), generator=g).tolist(),
                                  rng.randint(6, 30), ignore_eos=True, logprob_steps=0) for i in range(7)]
    _, steps, finishing, logs = _lockstep_mixed(tiny_llama_dir, policy, requests,
                                                [rng.randint(0, 25) for _ in requests])
    # decode rows ran beside a later chunk, and beside a chunk that finished its prompt
    assert any(nd > 0 and any(a > 0 for _, a, _ in chunks) for nd, chunks in steps)
    assert any(nd > 0 and done for (nd, _), done in zip(steps, finishing))
    if not policy.startswith("quest"):
        assert logs[0]["after_prefill_layer"] == logs[1]["after_prefill_layer"] > 0


@pytest.mark.parametrize("policy", ["quest", "h2o", "cake"])
def test_policy_mixed_steps_under_preemption(tiny_llama_dir, policy):
    """The same equality where the device pool is tight enough to preempt (a Quest sequence, which drops nothing,
    can hold 104 blocks)."""
    preemptions = 0
    for seed in (0, 1):
        rng = random.Random(seed)
        g = torch.Generator().manual_seed(seed)
        requests = [GenerationRequest(f"r{i}", torch.randint(3, 200, (rng.randint(3, 72),), generator=g).tolist(),
                                      rng.randint(1, 30), ignore_eos=True, logprob_steps=0) for i in range(9)]
        fused, *_ = _lockstep_mixed(tiny_llama_dir, policy, requests, [rng.randint(0, 20) for _ in requests],
                                    blocks={"quest": 112, "cake": 90}.get(policy, 70))
        preemptions += fused.scheduler.num_preemptions
    assert preemptions > 0                                  # the pool was tight enough to preempt


@pytest.mark.parametrize("policy", ["quest", "flexicache", "h2o", "cake"])
def test_policy_mixed_steps_with_forks(tiny_llama_dir, policy):
    """The same equality over shared contexts (forks), with a kept prefix released at the end."""
    from tests.test_engine_invariants import _shared_requests

    rng = random.Random(3)
    requests = _shared_requests(rng, torch.Generator().manual_seed(3), 3)
    _lockstep_mixed(tiny_llama_dir, policy, requests, [rng.randint(0, 30) for _ in requests], blocks=160,
                    kept="3-kept")


def test_policies_with_hooks_inside_a_layer_keep_the_per_op_step(tiny_llama_dir):
    """A page choice at decode time stated by no rule (LServe's select_pages) runs between a layer's pieces: the
    runner says so and keeps the per-op mixed step; batch-invariant mode (tiled GEMMs) keeps it too."""
    engine = _engine(tiny_llama_dir, "bfloat16", True, policy="lserve")
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
    state = (kv.k_pool, kv.v_pool, kv.kmin, kv.kmax, kv.block_table, kv.num_tokens)
    before = [t.clone() for t in state]
    ids = torch.tensor([5, 6, 7])
    cos, sin = model.rope(torch.arange(3), next(iter(model.rope_tables)))
    kind, flat = engine.runner.mixed._weights(3)
    with pytest.raises(RuntimeError, match="no device block"):
        torch.ops.kvharness_cpu.mixed_layers(
            torch.nn.functional.embedding(ids, model.embed), None, flat, kind, cos, sin, kv.k_pool, kv.v_pool,
            kv.block_table, kv.num_tokens, kv.kmin, kv.kmax, torch.empty(0, dtype=torch.long), [0], [0], [3],
            spec.num_q_heads, spec.intermediate_size, spec.rms_norm_eps, kv.scale, False)
    # bit patterns, not values: the pools start uninitialised, and a NaN pattern never equals itself
    assert all(torch.equal(now.flatten().view(torch.uint8), then.flatten().view(torch.uint8))
               for now, then in zip(state, before))


def test_set_policy_refuses_another_class(tiny_llama_dir):
    """The runner chose its paths by the policy class's hooks (which steps run fused, which keep prompt queries):
    swapping in another class must not keep that choice."""
    engine = _engine(tiny_llama_dir, "bfloat16", True)
    with pytest.raises(ValueError, match="Dense .*not a Quest"):
        engine.set_policy(load_policy("quest", {}))
    engine.set_policy(load_policy("dense", {}))          # the same class is what Policy.at_budget hands over
    assert engine.runner.mixed is not None

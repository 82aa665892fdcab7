"""Engine invariants under a seeded fuzz loop over arrivals, lengths and every policy, checked after each step.

No block leaks once all requests finish; block tables only point at allocated blocks (never a freed one, never one
block twice in a slot); a block mapped by several slots (a shared context, a kept prefix) counts exactly that many
references and is allocated once; the device tier never holds more than its capacity; a policy at budget >= context
equals dense. The shared-context fuzz mixes query-aware, query-agnostic and shared-context requests (k readers per
context, kept prefixes read by later requests) under preemption.
"""
import random
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from systems.base import GenerationRequest
from systems.engine.engine import Engine
from systems.policies import load_policy

P = 4
TINY = dict(layers=2, kv_heads=2, head_dim=16)
STREAM = [[0, 1], [1, 0]]
POLICIES = {  # small budgets so every mechanism (eviction, offload, promotion, streaming drops) runs
    "dense": {},
    "quest": dict(budget=3 * P, skip_layers=0),
    "flexicache": dict(budget=2 * P, rerank_interval=3, unstable_heads=[[1, 0]]),
    "flexicache_naive": dict(budget=2 * P, naive=True, unstable_heads=[[1, 0]]),
    "lserve": dict(budget=4 * P, sink_tokens=4, local_tokens=8, physical_page=8, reuse_interval=2,
                   streaming_heads=STREAM),
    "cake": dict(budget=48, window=8),
    "cake_nocascade": dict(budget=48, window=8, cascading=False),
    "snapkv": dict(budget=40, window=8),
    "pyramidkv": dict(budget=40, window=8),
    "h2o": dict(budget=40),
    "tova": dict(budget=40),
    "streaming": dict(budget=40),
}
MODULE = {"flexicache_naive": "flexicache", "cake_nocascade": "cake"}


def _engine(path, policy, blocks, max_num_seqs=4):
    block_bytes = 2 * P * TINY["head_dim"] * 4
    cfg = SimpleNamespace(page_size=P, device_memory_gb=blocks * block_bytes / 2 ** 30,
                          host_memory_gb=2048 * block_bytes / 2 ** 30, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=512)
    return Engine(str(path), policy, cfg, dtype="float32")


def _check(engine):
    kv = engine.kv
    for table, pool in ((kv.block_table, kv.device_blocks), (kv.host_table, kv.host_blocks)):
        assert 0 <= pool.num_used <= pool.capacity
        free = set(pool._stack[:pool.num_free].tolist())
        assert len(free) == pool.num_free                               # the free list holds no duplicate
        active = {s.slot for s in engine.scheduler.running if s.slot is not None}
        active |= set(engine.scheduler.prefixes.holder_slots())
        for slot in range(table.shape[0]):
            ids = table[slot][table[slot] != 0].tolist()
            if slot not in active:
                assert not ids, "a finished or free slot still maps blocks"
                continue
            assert not (set(ids) & free), "a block table points at a freed block"
            assert len(ids) == len(set(ids)), "one block mapped twice in a slot"
        used = Counter(table[table != 0].tolist())
        assert len(used) == pool.num_used, "allocated blocks that no table maps (a leak)"
        assert all(int(pool.refs[b]) == n for b, n in used.items()), "a reference count differs from its mappings"
        assert int((pool.refs > 0).sum()) == pool.num_used
        assert pool.num_shared == sum(n > 1 for n in used.values())


def _fuzz(engine, seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    lengths = [rng.randint(3, 110) for _ in range(9)]
    reqs = [GenerationRequest(f"r{i}", torch.randint(3, 200, (n,), generator=g).tolist(), rng.randint(1, 24),
                              ignore_eos=True) for i, n in enumerate(lengths)]
    arrive_at = sorted(rng.randint(0, 30) for _ in reqs)              # engine steps at which each request arrives
    start = (engine.kv.free_device_blocks(), engine.kv.free_host_blocks())
    seqs, step, pending = [], 0, list(zip(arrive_at, reqs))
    while pending or engine.scheduler.has_work():
        while pending and pending[0][0] <= step:
            seqs.append(engine.add_request(pending.pop(0)[1]))
        engine.step()
        _check(engine)
        step += 1
        assert step < 5000
    assert (engine.kv.free_device_blocks(), engine.kv.free_host_blocks()) == start
    assert all(s.num_output_tokens == s.request.max_new_tokens for s in seqs)
    return {s.request.request_id: s.output_ids for s in seqs}


@pytest.mark.parametrize("name", list(POLICIES))
def test_invariants_hold_after_every_step(tiny_llama_dir, name):
    policy = load_policy(MODULE.get(name, name), POLICIES[name])
    engine = _engine(tiny_llama_dir, policy, blocks=160)                 # tight: forces preemption
    for seed in (0, 1):
        _fuzz(engine, seed)
    if name == "dense":
        assert engine.scheduler.num_preemptions > 0                  # the pool was tight enough to preempt


@pytest.mark.parametrize("name", [n for n in POLICIES if n != "dense"])
def test_budget_at_least_context_equals_dense(tiny_llama_dir, name):
    big = dict(POLICIES[name])
    if "budget" in big:
        big["budget"] = 1024
    if "sink_tokens" in big:
        big.update(sink_tokens=512, local_tokens=512)
    dense = _fuzz(_engine(tiny_llama_dir, load_policy("dense", {}), blocks=4096), seed=5)
    other = _fuzz(_engine(tiny_llama_dir, load_policy(MODULE.get(name, name), big), blocks=4096), seed=5)
    assert other == dense


def _shared_requests(rng, g, round_: int):
    """Contexts read by 1-3 questions each (shared, query-agnostic), query-agnostic and query-aware requests alone,
    and a prompt kept by one request and read by a forced pass."""
    reqs = []
    for c in range(3):
        ctx = torch.randint(3, 200, (rng.randint(6, 90),), generator=g).tolist()
        for j in range(rng.randint(1, 3)):
            q = torch.randint(3, 200, (rng.randint(1, 15),), generator=g).tolist()
            reqs.append(GenerationRequest(f"c{c}q{j}", ctx + q, rng.randint(1, 16), ignore_eos=True,
                                          context_len=len(ctx), shared_context=f"{round_}-ctx{c}"))
    lone = torch.randint(3, 200, (rng.randint(20, 80),), generator=g).tolist()
    reqs.append(GenerationRequest("agnostic", lone, rng.randint(1, 16), ignore_eos=True,
                                  context_len=rng.randint(1, len(lone))))
    kept = torch.randint(3, 200, (rng.randint(5, 60),), generator=g).tolist()
    reqs.append(GenerationRequest("keeper", kept, 6, ignore_eos=True, keep_prefill=f"{round_}-kept"))
    reqs.append(GenerationRequest("forced", kept, 4, forced_output_ids=(5, 6, 7, 8), ignore_eos=True,
                                  context_len=len(kept), shared_context=f"{round_}-kept"))
    reqs.append(GenerationRequest("plain", torch.randint(3, 200, (40,), generator=g).tolist(), 8, ignore_eos=True))
    rng.shuffle(reqs)
    return reqs


def _fuzz_shared(engine, seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    start = (engine.kv.free_device_blocks(), engine.kv.free_host_blocks())
    reqs = _shared_requests(rng, g, seed)
    arrive_at = sorted(rng.randint(0, 30) for _ in reqs)
    seqs, step, pending = [], 0, list(zip(arrive_at, reqs))
    while pending or engine.scheduler.has_work():
        while pending and pending[0][0] <= step:
            seqs.append(engine.add_request(pending.pop(0)[1]))
        engine.step()
        _check(engine)
        step += 1
        assert step < 5000
    assert all(s.num_output_tokens == s.request.max_new_tokens and not s.error for s in seqs)
    assert engine.release_prefix(f"{seed}-kept")
    _check(engine)
    assert not engine.scheduler.prefixes.by_key, "a prefix outlived its last reader"
    assert (engine.kv.free_device_blocks(), engine.kv.free_host_blocks()) == start
    return seqs


@pytest.mark.parametrize("name", list(POLICIES))
def test_invariants_hold_with_shared_contexts(tiny_llama_dir, name):
    engine = _engine(tiny_llama_dir, load_policy(MODULE.get(name, name), POLICIES[name]), blocks=160)
    forked = 0
    for seed in (0, 1):
        forked += sum(s.forked for s in _fuzz_shared(engine, seed))
    assert forked > 0 and engine.scheduler.prefixes.kept > 0           # readers did share built prefixes
    if name == "dense":
        assert engine.scheduler.num_preemptions > 0                  # the pool was tight enough to preempt


@pytest.mark.parametrize("name", ["dense", "flexicache"])
def test_the_step_tally_counts_every_decode_row_once_by_the_kind_of_its_step(tiny_llama_dir, name):
    """Without preemption every output token but a request's first comes from a decode row; staggered arrivals put
    some rows beside a later request's prompt chunks (chunked prefill, 512 tokens per step)."""
    engine = _engine(tiny_llama_dir, load_policy(MODULE.get(name, name), POLICIES[name]), blocks=2000)
    g = torch.Generator().manual_seed(0)
    seqs, step = [], 0
    arrivals = {0: 700, 3: 900, 6: 40}                                    # engine step -> prompt length
    while step in arrivals or engine.scheduler.has_work() or step < max(arrivals):
        if step in arrivals:
            prompt = torch.randint(3, 200, (arrivals[step],), generator=g).tolist()
            seqs.append(engine.add_request(GenerationRequest(f"r{step}", prompt, 12, ignore_eos=True)))
        engine.step()
        step += 1
    t = engine.tally
    assert engine.scheduler.num_preemptions == 0
    assert t.decode_rows + t.mixed_rows == sum(s.num_output_tokens - 1 for s in seqs) == 3 * 11
    assert t.mixed_steps > 0 and t.mixed_rows >= t.mixed_steps and t.decode_steps > 0 and t.prompt_steps > 0
    assert engine.steps == {"prefill": t.mixed_steps + t.prompt_steps, "decode": t.decode_steps}
    assert min(t.decode_s, t.mixed_s, t.prompt_s) > 0

"""Query-agnostic requests, shared compressed contexts and kept prefixes in the engine, for every policy.

- query-agnostic: the context is compressed alone and the question appended after it; for dense (nothing
  compressed) that is the query-aware output, and chunking the context or the question changes nothing;
- shared context: k questions read one compressed context and each equals its own query-agnostic run token for
  token (k = 1 included); its pages are allocated once and freed with the last reader;
- kept prefix: a teacher-forced pass forked from the generation's kept prefill gives bit-identical log-probabilities
  to a fresh forced pass, and costs no second prefill.
"""
import pytest
import torch
from test_engine_invariants import MODULE, POLICIES, TINY, _check

from systems.base import GenerationRequest
from systems.engine.engine import Engine
from systems.policies import load_policy

P = 4
CONTEXT, QUESTIONS = 70, (5, 9, 3)


def _engine(path, name, blocks=4096, **cfg):
    block_bytes = 2 * P * TINY["head_dim"] * 4
    config = dict(page_size=P, device_memory_gb=blocks * block_bytes / 2 ** 30,
                  host_memory_gb=2048 * block_bytes / 2 ** 30, max_num_seqs=4, max_num_batched_tokens=512)
    config.update(cfg)
    return Engine(str(path), load_policy(MODULE.get(name, name), POLICIES[name]), config, dtype="float32")


def _parts(seed=0):
    g = torch.Generator().manual_seed(seed)
    context = torch.randint(3, 200, (CONTEXT,), generator=g).tolist()
    return context, [torch.randint(3, 200, (n,), generator=g).tolist() for n in QUESTIONS]


def _agnostic(rid, context, question, shared=None, n=12):
    return GenerationRequest(rid, context + question, n, ignore_eos=True, context_len=len(context),
                             shared_context=shared)


@pytest.mark.parametrize("chunk", [512, 21])              # 21: the context and the question both arrive in chunks
def test_dense_query_agnostic_equals_query_aware(tiny_llama_dir, chunk):
    context, questions = _parts()
    aware = _engine(tiny_llama_dir, "dense")
    agnostic = _engine(tiny_llama_dir, "dense", max_num_batched_tokens=chunk)
    expect = [s.output_ids for s in aware.generate([GenerationRequest(f"a{i}", context + q, 12, ignore_eos=True)
                                                    for i, q in enumerate(questions)])]
    got = agnostic.generate([_agnostic(f"g{i}", context, q) for i, q in enumerate(questions)])
    assert [s.output_ids for s in got] == expect
    assert all(s.kv_stats["compression"] == "query_agnostic" and s.kv_stats["context_tokens"] == CONTEXT
               for s in got)


@pytest.mark.parametrize("name", list(POLICIES))
def test_chunked_query_agnostic_equals_whole(tiny_llama_dir, name):
    context, questions = _parts(1)
    reqs = lambda: [_agnostic(f"g{i}", context, q) for i, q in enumerate(questions)]  # noqa: E731
    whole = [s.output_ids for s in _engine(tiny_llama_dir, name, chunked_prefill=False).generate(reqs())]
    chunked = _engine(tiny_llama_dir, name, max_num_batched_tokens=21)
    assert [s.output_ids for s in chunked.generate(reqs())] == whole


@pytest.mark.parametrize("name", list(POLICIES))
def test_policies_compress_the_context_alone(tiny_llama_dir, name):
    """What the policy kept after the context does not depend on the question: two questions leave the same
    per-head token counts minus their own (uncompressed) length."""
    context, questions = _parts(2)
    engine = _engine(tiny_llama_dir, name, batch_invariant=True)
    kept = []
    for i, q in enumerate(questions[:2]):
        seq = engine.add_request(_agnostic(f"g{i}", context, q, n=2))
        while not seq.num_output_tokens:             # the question is appended: one token, one more to go
            engine.step()
        kept.append(engine.kv.num_tokens[seq.slot].clone() - len(q))
        engine.run()
    assert torch.equal(kept[0], kept[1])


@pytest.mark.parametrize("fused", [True, False])              # the fused C++ decode step and the per-op path
@pytest.mark.parametrize("name", list(POLICIES))
def test_each_shared_reader_equals_its_own_query_agnostic_run(tiny_llama_dir, name, fused):
    context, questions = _parts()
    engine = _engine(tiny_llama_dir, name, batch_invariant=True, fused_decode=fused)
    alone = [engine.generate([_agnostic(f"s{i}", context, q)])[0].output_ids for i, q in enumerate(questions)]
    free = engine.kv.free_device_blocks()
    one = engine.generate([_agnostic("k1", context, questions[0], shared="one")])
    assert one[0].output_ids == alone[0]                                  # k = 1
    shared = engine.generate([_agnostic(f"k{i}", context, q, shared="ctx") for i, q in enumerate(questions)])
    assert [s.output_ids for s in shared] == alone
    assert [s.forked for s in shared] == [False, True, True]              # built once, then read twice
    assert all(s.kv_stats["shared_context"] == "ctx" for s in shared)
    assert engine.kv.free_device_blocks() == free and not engine.scheduler.prefixes.by_key


def test_shared_pages_are_allocated_once_and_freed_with_the_last_reader(tiny_llama_dir):
    context, questions = _parts()
    engine = _engine(tiny_llama_dir, "dense", batch_invariant=True)
    pool, row = engine.kv.device_blocks, TINY["layers"] * TINY["kv_heads"]
    free = engine.kv.free_device_blocks()
    # independent query-agnostic runs hold the context once per question
    engine.generate([_agnostic(f"s{i}", context, q, n=8) for i, q in enumerate(questions)])
    independent = pool.peak_used
    pool.reset_peak()
    reqs = [_agnostic(f"k{i}", context, q, shared="ctx", n=8 + 30 * (i == 2)) for i, q in enumerate(questions)]
    seqs = [engine.add_request(r) for r in reqs]
    while not all(s.num_output_tokens for s in seqs):
        engine.step()
        _check(engine)
    context_pages = CONTEXT // P                                        # 70 tokens: 17 full pages + a partial one
    assert pool.num_shared == row * context_pages                       # every full context page mapped by all
    holder = engine.scheduler.prefixes.by_key["ctx"].slot
    assert int(pool.refs[engine.kv.block_table[holder, 0, 0, 0]]) == 4  # the holder and three readers
    while not (seqs[0].num_output_tokens == 8 and seqs[1].num_output_tokens == 8):
        engine.step()
    assert seqs[2].status.name == "RUNNING" and "ctx" in engine.scheduler.prefixes.by_key  # the last reader holds it
    engine.run()
    assert pool.peak_used < independent - row * context_pages          # the context counted once, not three times
    assert not engine.scheduler.prefixes.by_key and engine.kv.free_device_blocks() == free


def test_requests_that_contradict_a_shared_context_are_refused(tiny_llama_dir):
    context, questions = _parts()
    engine = _engine(tiny_llama_dir, "dense")
    engine.add_request(_agnostic("a", context, questions[0], shared="ctx"))
    with pytest.raises(ValueError, match="does not open with them"):
        engine.add_request(_agnostic("b", context[:-1] + [7], questions[1], shared="ctx"))
    with pytest.raises(ValueError, match="needs context_len"):
        engine.add_request(GenerationRequest("c", context, 4, shared_context="ctx"))
    with pytest.raises(ValueError, match="context_len"):
        engine.add_request(GenerationRequest("d", context, 4, context_len=len(context) + 1))
    engine.run()
    engine.add_request(GenerationRequest("e", context, 4, keep_prefill="kept"))
    with pytest.raises(ValueError, match="in use"):
        engine.add_request(GenerationRequest("f", context, 4, keep_prefill="kept"))


@pytest.mark.parametrize("agnostic", [False, True])
@pytest.mark.parametrize("name", list(POLICIES))
def test_forced_pass_from_the_kept_prefill_is_bit_identical(tiny_llama_dir, name, agnostic):
    """Deliverable: the teacher-forced pass reuses the generation's prefill (a kept prefix) instead of its own."""
    context, questions = _parts(3)
    prompt = context + questions[1]
    ctx = len(context) if agnostic else None
    engine = _engine(tiny_llama_dir, name, batch_invariant=True)
    gen = engine.generate([GenerationRequest("gen", prompt, 10, ignore_eos=True, context_len=ctx,
                                             keep_prefill="gen#prefill")])[0]
    forced = tuple((gen.output_ids[::-1] * 2)[:10])                     # not the policy's own choices
    fresh = engine.generate([GenerationRequest("fresh", prompt, 10, forced_output_ids=forced, logprob_steps=10,
                                               ignore_eos=True, context_len=ctx)])[0]
    prefills = engine.steps["prefill"]
    reused = engine.generate([GenerationRequest("reuse", prompt, 10, forced_output_ids=forced, logprob_steps=10,
                                                ignore_eos=True, context_len=ctx if agnostic else len(prompt),
                                                shared_context="gen#prefill")])[0]
    assert reused.forked and engine.steps["prefill"] == prefills         # no forward over the prompt again
    assert reused.token_logprobs == fresh.token_logprobs and reused.argmax_ids == fresh.argmax_ids
    assert torch.equal(torch.stack(reused.logprob_rows), torch.stack(fresh.logprob_rows))
    assert engine.release_prefix("gen#prefill") and not engine.release_prefix("gen#prefill")
    assert not engine.scheduler.prefixes.by_key and engine.kv.device_blocks.num_used == 0


def test_a_parked_context_gives_way_when_nothing_else_fits(tiny_llama_dir):
    """A built context waiting for a reader queued behind a big request holds the pool while nothing runs: it is
    given up (the reader rebuilds it) instead of stalling the engine."""
    g = torch.Generator().manual_seed(5)
    context = torch.randint(3, 200, (60,), generator=g).tolist()        # 15 full pages in each (layer, KV head)
    big = GenerationRequest("big", torch.randint(3, 200, (90,), generator=g).tolist(), 4, ignore_eos=True)
    first, second = (_agnostic(f"r{i}", context, [7 + i, 8, 9], shared="ctx", n=4) for i in range(2))
    alone = _engine(tiny_llama_dir, "dense").generate([_agnostic("solo", context, [8, 8, 9], n=4)])[0].output_ids
    engine = _engine(tiny_llama_dir, "dense", blocks=121)
    seqs = [engine.add_request(r) for r in (first, big, second)]       # FIFO: the reader waits behind "big"
    while engine.scheduler.has_work():
        engine.step()
        _check(engine)
    assert all(s.num_output_tokens == 4 and not s.error for s in seqs)
    assert engine.scheduler.prefixes.kept == 1 and not seqs[2].forked   # kept once, given up, rebuilt unshared
    assert seqs[2].output_ids == alone and engine.kv.device_blocks.num_used == 0


@pytest.mark.parametrize("name", ["cake", "h2o", "snapkv"])
def test_a_context_forks_after_its_ledger_grew_in_a_step(tiny_llama_dir, name, monkeypatch):
    """A policy's decode ledger grows (doubling) inside a step; forking that context for a second reader, or
    resetting it, updates the grown tensor in place: the engine runs every entry that reaches the hooks in inference
    mode, so both happen (a ledger starting at 4 tokens grows on the first prompt)."""
    from systems.policy_support import indicators

    monkeypatch.setattr(indicators.TokenLedger.__init__, "__defaults__", (False, 4))
    context, questions = _parts(3)
    engine = _engine(tiny_llama_dir, name, batch_invariant=True)
    alone = [engine.generate([_agnostic(f"s{i}", context, q)])[0].output_ids for i, q in enumerate(questions)]
    shared = engine.generate([_agnostic(f"k{i}", context, q, shared="ctx") for i, q in enumerate(questions)])
    assert [s.output_ids for s in shared] == alone and [s.forked for s in shared] == [False, True, True]

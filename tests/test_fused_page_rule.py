"""A page rule run inside the fused step (Policy.decode_page_rule) equals select_pages answered layer by layer.

Two engines run the same requests in lockstep (test_deferred_eviction.lockstep), one running Quest's rule inside the
fused C++ step and one asking select_pages between each layer's halves; after every engine step they must hold the
same logits bits, cache state and MinMax bytes read, and finish with the same tokens and the same kv_stats (pages
read per head step included), for both of Quest's selection rules, both granularities, with and without dense first
layers, and over managed layers that are not contiguous. FlexiCache's rule (its stable heads read the pages they
hold, its unstable heads their top-K) runs on the steps without tier traffic and must equal its per-layer hooks too.
"""
import random

import pytest
import torch

from systems.base import GenerationRequest
from systems.engine.ops import cpu_kernels
from systems.policies import load_policy
from systems.policies.flexicache import FlexiCache
from systems.policies.quest import Quest
from tests.conftest import save_tiny_llama
from tests.test_deferred_eviction import instrument, lockstep
from tests.test_engine_invariants import POLICIES, P, _engine

pytestmark = pytest.mark.skipif(not cpu_kernels.has_fused_decode(), reason="CPU kernels not built")


def _instrumented(path, params: dict, rules: bool, policy_class: type = Quest):
    engine = _engine(path, policy_class(**params), blocks=400)
    assert engine.runner.fused is not None
    engine.runner.fused.rules = rules
    engine.runner.mixed = None      # mixed steps per op on both sides (test_fused_mixed compares the fused one)
    return engine, instrument(engine, ("decode_page_rule", "select_pages"))


@pytest.mark.parametrize("rule", ["accuracy_path", "efficiency_kernels"])
@pytest.mark.parametrize("granularity", ["query_head", "kv_head"])
@pytest.mark.parametrize("skip_layers", [0, 1])
def test_rule_in_the_fused_step_equals_select_pages_per_layer(tiny_llama_dir, rule, granularity, skip_layers):
    params = dict(budget=3 * P, skip_layers=skip_layers, granularity=granularity, selection_rule=rule)
    (fused, flog), (layered, llog) = (_instrumented(tiny_llama_dir, params, rules) for rules in (True, False))
    rng = random.Random(7)
    g = torch.Generator().manual_seed(7)
    # prompts shorter and longer than the budget, arriving over time: batches mix dense and sparse sequences
    requests = [GenerationRequest(f"r{i}", torch.randint(3, 200, (rng.randint(3, 60),), generator=g).tolist(),
                                  rng.randint(4, 24), ignore_eos=True, logprob_steps=0) for i in range(7)]
    lockstep((fused, layered), (flog, llog), requests, [rng.randint(0, 12) for _ in requests])
    assert fused.kv.minmax_bytes_read > 0                                      # some layers did choose pages
    assert flog["decode_page_rule"] > 0 and llog["decode_page_rule"] == 0      # each engine ran its kind of choice
    assert llog["select_pages"] > 0 and flog["select_pages"] < llog["select_pages"]   # (mixed steps: per layer)


@pytest.mark.parametrize("unstable", [[[1, 0]], [[0, 0], [0, 1]], []])
@pytest.mark.parametrize("rerank_interval,naive", [(3, False), (8, False), (3, True)])
def test_flexicache_rule_equals_its_hooks_per_layer(tiny_llama_dir, unstable, rerank_interval, naive):
    # layers with stable heads only, unstable only, and both; the reranks and host copies a rule's step does after
    # its last layer (pages_chosen) must move the same pages into the same blocks as the per-layer hooks
    params = dict(budget=2 * P, rerank_interval=rerank_interval, naive=naive, unstable_heads=unstable)
    (fused, flog), (layered, llog) = (_instrumented(tiny_llama_dir, params, rules, FlexiCache)
                                      for rules in (True, False))
    held_rules = []
    stated = fused.policy.decode_page_rule
    fused.policy.decode_page_rule = lambda kv, step: held_rules.append(stated(kv, step)) or held_rules[-1]
    rng = random.Random(5)
    g = torch.Generator().manual_seed(5)
    requests = [GenerationRequest(f"r{i}", torch.randint(3, 200, (rng.randint(3, 60),), generator=g).tolist(),
                                  rng.randint(4, 30), ignore_eos=True, logprob_steps=0) for i in range(6)]
    out, _ = lockstep((fused, layered), (flog, llog), requests, [rng.randint(0, 12) for _ in requests])
    assert any(rule.held is not None for rule in held_rules)                # steps beyond K pages ran as rules
    assert flog["select_pages"] < llog["select_pages"]                      # select_pages: mixed steps only
    assert sum(seq.kv_stats["reranks"] for seq in out) > 0                  # stable heads reranked and promoted
    assert sum(seq.kv_stats["promoted_pages"] for seq in out) > 0


class OddLayersQuest(Quest):
    """Quest on layers 0 and 2 only: the rule's layers skip one, which the fused step must index, not count."""

    def configure(self, dims) -> None:
        super().configure(dims)
        self.managed_layers = (0, 2)
        self._rank = {layer: i for i, layer in enumerate(self.managed_layers)}


@pytest.fixture(scope="module")
def three_layer_llama_dir(tmp_path_factory, tokenizer_dir):
    return save_tiny_llama(tmp_path_factory.mktemp("three_layer_llama"), tokenizer_dir, num_layers=3)


@pytest.mark.parametrize("granularity", ["query_head", "kv_head"])
def test_rule_over_layers_that_skip_one(three_layer_llama_dir, granularity):
    params = dict(budget=3 * P, skip_layers=0, granularity=granularity)
    (fused, flog), (layered, llog) = (_instrumented(three_layer_llama_dir, params, rules, OddLayersQuest)
                                      for rules in (True, False))
    assert [fused.policy.manages(layer) for layer in range(3)] == [True, False, True]
    rng = random.Random(11)
    g = torch.Generator().manual_seed(11)
    requests = [GenerationRequest(f"r{i}", torch.randint(3, 200, (rng.randint(30, 70),), generator=g).tolist(),
                                  rng.randint(4, 16), ignore_eos=True, logprob_steps=0) for i in range(4)]
    lockstep((fused, layered), (flog, llog), requests, [rng.randint(0, 6) for _ in requests])
    assert fused.kv.minmax_bytes_read > 0 and flog["decode_page_rule"] > 0 and llog["decode_page_rule"] == 0


def test_a_policy_without_a_rule_still_runs_layer_by_layer(tiny_llama_dir):
    for name in ("lserve", "quest"):
        engine = _engine(tiny_llama_dir, load_policy(name, POLICIES[name]), blocks=100)
        fused = engine.runner.fused
        assert fused.page_rule == (name == "quest") and fused.per_layer == (name == "lserve")
        fused.rules = False
        assert fused.per_layer


def test_a_bad_rule_fails_before_the_step_changes_the_cache(tiny_llama_dir):
    from systems.policies.view import PageRule

    engine = _engine(tiny_llama_dir, load_policy("quest", dict(budget=P, skip_layers=0)), blocks=100)
    seq = engine.add_request(GenerationRequest("r", list(range(3, 40)), 8, ignore_eos=True))
    engine.step()                                                        # the prefill
    seq.token_ids.append(5)                                              # the next token to decode
    slots = torch.tensor([seq.slot])
    engine.kv.allocate_decode(slots, engine.kv.decode_blocks_needed(slots))
    before = engine.kv.num_tokens.clone(), engine.kv.k_pool.clone()
    bad = PageRule(layers=(0, 1), k=[1], heads=torch.tensor([0, 99]), width=10)
    engine.policy.decode_page_rule = lambda kv, step: bad
    with pytest.raises(RuntimeError, match="not a KV head"), torch.inference_mode():
        engine.runner.fused.logits(torch.tensor([5]), torch.tensor([len(seq.token_ids) - 1]), slots, [seq.info()])
    assert torch.equal(engine.kv.num_tokens, before[0]) and torch.equal(engine.kv.k_pool, before[1])


@pytest.mark.parametrize("page,width,error", [(-1, 1, "held width"), (999, 2, "held page outside")])
def test_a_bad_held_rule_fails_before_the_step(tiny_llama_dir, page, width, error):
    from systems.policies.view import PageRule

    engine = _engine(tiny_llama_dir, FlexiCache(budget=2 * P, unstable_heads=[[1, 0]]), blocks=100)
    seq = engine.add_request(GenerationRequest("r", list(range(3, 40)), 8, ignore_eos=True))
    engine.step()
    seq.token_ids.append(5)
    slots = torch.tensor([seq.slot])
    engine.kv.allocate_decode(slots, engine.kv.decode_blocks_needed(slots))
    before = engine.kv.num_tokens.clone(), engine.kv.k_pool.clone()
    # one column where layer 1's top needs two, or a page no head can hold
    held = torch.full((2, 1, 2, width), page, dtype=torch.long)
    bad = PageRule(layers=(0, 1), k=[2], heads=torch.arange(2), width=10, ranked=False, held=held,
                   held_widths=(width, width), scored=engine.policy.unstable)
    engine.policy.decode_page_rule = lambda kv, step: bad
    with pytest.raises(RuntimeError, match=error), torch.inference_mode():
        engine.runner.fused.logits(torch.tensor([5]), torch.tensor([len(seq.token_ids) - 1]), slots, [seq.info()])
    assert torch.equal(engine.kv.num_tokens, before[0]) and torch.equal(engine.kv.k_pool, before[1])

"""The score-and-keep base: KNorm keeps the smallest keys, a scorer of a few lines evicts at prefill and decode."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from test_policies_eviction_rules import HKV, _decode, _kept, _kv, _prefill

from systems.policies import load_policy
from systems.policy_support.score_and_keep import ScoreAndKeep


def test_knorm_keeps_the_keys_of_smallest_norm_per_head_plus_its_window():
    n, budget, window = 40, 12, 3
    kv = _kv(2)
    policy = load_policy("knorm", {"budget": budget, "window": window})
    _, ks = _prefill(policy, kv, 2, n, seed=5)
    for layer in range(2):
        norms = ks[layer].norm(dim=-1)                                    # [n, Hkv]
        ref = [set(norms[:n - window, h].argsort()[:budget - window].tolist()) | set(range(n - window, n))
               for h in range(HKV)]
        assert _kept(kv, layer) == ref
    for _ in _decode(policy, kv, n, 5, seed=5):                           # prefill only: decode tokens append
        pass
    assert all(len(h) == budget + 5 for h in _kept(kv, 0))


def test_a_short_prompt_is_kept_whole():
    kv = _kv(1)
    policy = load_policy("knorm", {"budget": 64})
    _prefill(policy, kv, 1, 30, seed=0)
    assert _kept(kv, 0) == [set(range(30))] * HKV


@dataclass
class KeepOldest(ScoreAndKeep):
    """A scorer in a few lines: older tokens are worth more, at prefill and at every decode step."""

    name = "keep_oldest"

    def prefill_scores(self, kv, q, k):
        return -torch.arange(k.shape[0], dtype=torch.float32)

    def decode_scores(self, kv, step, rows):
        n = int(kv.num_tokens[step.slots[rows], step.rows_at(rows)].max())
        return -torch.arange(n, dtype=torch.float32).expand(len(rows), -1).clone()


def test_a_scorer_of_a_few_lines_evicts_at_prefill_and_while_decoding():
    n, budget = 30, 10
    kv = _kv(1)
    policy = KeepOldest(budget=budget)
    _prefill(policy, kv, 1, n, seed=0)
    assert _kept(kv, 0) == [set(range(budget))] * HKV
    for _ in _decode(policy, kv, n, 3, seed=0):
        assert all(len(h) == budget + 1 for h in _kept(kv, 0))           # appended, the hook not yet run
    # storage order: the newest token lands in the last slot and scores lowest, so it is the one that leaves
    assert _kept(kv, 0) == [set(range(budget))] * HKV


def test_the_eviction_policies_are_scorers():
    for name in ("h2o", "tova", "snapkv", "pyramidkv", "knorm"):
        assert isinstance(load_policy(name, {}), ScoreAndKeep), name

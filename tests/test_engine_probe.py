"""The position probe (systems/engine/probe.py): the original positions each head holds and reads at decode step 1.

Oracle: prefill is dense for every policy, so the key a policy keeps for prompt position p is bit for bit the key the
dense engine stores at storage index p; every held position must carry exactly that key. Beside it: the tracker
against a list simulation of keeps, drops and appends; StreamingLLM's positions written out; retrieval reads within
what is held; the fused step records what the per-op step records.
"""
import random
from types import SimpleNamespace

import pytest
import torch

from systems.base import GenerationRequest
from systems.engine.engine import Engine
from systems.engine.ops import cpu_kernels
from systems.engine.probe import PositionTracker
from systems.policies import load_policy
from tests.test_engine_invariants import MODULE, POLICIES

P = 4
PROMPTS = [[(i * 7919 + 13 * j) % 48000 + 3 for j in range(n)] for i, n in enumerate((57, 71))]


def _engine(path, name, fused=False):
    cfg = SimpleNamespace(page_size=P, device_memory_gb=0.01, host_memory_gb=0.01, max_num_seqs=4,
                          max_num_batched_tokens=512, batch_invariant=True, fused_decode=fused)
    return Engine(str(path), load_policy(MODULE.get(name, name), POLICIES[name]), cfg, dtype="float32")


def _probed_run(path, name, fused=False, keys=False):
    """Records of both prompts (generated together), and per request the keys [L][H] -> {position: key} each head
    held when the record was made."""
    engine = _engine(path, name, fused)
    requests = [GenerationRequest(f"r{i}", p, 6, ignore_eos=True, probe_positions=True)
                for i, p in enumerate(PROMPTS)]
    seen: dict[str, list] = {}
    if keys:
        engine.add_request(GenerationRequest("warm", [5, 6, 7], 1, probe_positions=True))
        engine.run()                       # the probe exists now: wrap its observe to read the keys it describes
        probe = engine.runner.probe
        observe = probe.observe
        probed = {r.request_id for r in requests}

        def spy(layer, infos, selected, window):
            for info in infos:
                if info.decode_step == 1 and info.request_id in probed:
                    k, _, counts = engine.kv.gather_tokens(torch.tensor([info.slot]), layer)
                    heads = []
                    for h, count in enumerate(counts[0].tolist()):
                        pos = probe.tracker.positions_of(info.slot, layer, h, count)
                        resident = engine.kv.block_table[info.slot, layer, h, torch.arange(count) // P] != 0
                        heads.append({p: k[0, h, i].clone() for i, p in enumerate(pos.tolist()) if resident[i]})
                    seen.setdefault(info.request_id, []).append(heads)
            observe(layer, infos, selected, window)
        probe.observe = spy
    seqs = engine.generate(requests)
    return [engine.runner.probe.take(s) for s in seqs], seen


@pytest.fixture(scope="module")
def dense_keys(tiny_llama_dir):
    return _probed_run(tiny_llama_dir, "dense", keys=True)[1]


@pytest.mark.parametrize("name", [n for n in POLICIES if n != "dense"])
def test_every_held_position_carries_the_key_of_that_prompt_position(tiny_llama_dir, dense_keys, name):
    records, seen = _probed_run(tiny_llama_dir, name, keys=True)
    assert sorted(seen) == ["r0", "r1"]
    for rec, rid in zip(records, ("r0", "r1")):
        assert rec is not None and len(rec.held) == len(seen[rid]) == 2
        for layer, heads in enumerate(seen[rid]):
            for h, keys_at in enumerate(heads):
                assert keys_at, (name, layer, h)
                for p, key in keys_at.items():
                    if p >= rec.seq_len - 1:     # the decoded token's key follows the policy's layers below
                        continue
                    assert torch.equal(key, dense_keys[rid][layer][h][p]), (name, layer, h, p)
                held, read = rec.held[layer][h], rec.read[layer][h]
                assert set(keys_at) <= set(held.tolist())
                assert held.unique().numel() == held.numel() and bool((held < rec.seq_len).all())
                assert bool(torch.isin(read, held).all())        # a head reads only what it holds


def test_streaming_holds_its_sinks_and_the_recent_window(tiny_llama_dir):
    records, _ = _probed_run(tiny_llama_dir, "streaming")
    budget, sinks = POLICIES["streaming"]["budget"], 4
    for rec, prompt in zip(records, PROMPTS):
        n = len(prompt)
        expected = list(range(sinks)) + list(range(n - (budget - sinks), n)) + [n]    # + the first output token
        assert rec.seq_len == n + 1
        for layer in range(2):
            for h in range(2):
                assert rec.held[layer][h].tolist() == expected
                assert rec.read[layer][h].tolist() == expected


def test_dense_holds_and_reads_everything_and_quest_reads_its_budget(tiny_llama_dir):
    dense, _ = _probed_run(tiny_llama_dir, "dense")
    quest, _ = _probed_run(tiny_llama_dir, "quest")
    for d, q, prompt in zip(dense, quest, PROMPTS):
        everything = list(range(len(prompt) + 1))
        assert all(t.tolist() == everything for heads in d.held + d.read + q.held for t in heads)
        budget = POLICIES["quest"]["budget"] * 2      # per query head; a KV head reads its group's (2) union
        assert all(len(t) <= budget for heads in q.read for t in heads)
        assert any(len(t) < len(everything) for heads in q.read for t in heads)


@pytest.mark.skipif(not cpu_kernels.has_fused_decode(), reason="CPU kernels not built")
@pytest.mark.parametrize("name", ["dense", "quest", "flexicache", "snapkv", "h2o", "lserve"])
def test_fused_step_records_what_the_per_op_step_records(tiny_llama_dir, name):
    fused, _ = _probed_run(tiny_llama_dir, name, fused=True)
    per_op, _ = _probed_run(tiny_llama_dir, name, fused=False)
    for a, b in zip(fused, per_op):
        assert a.seq_len == b.seq_len
        for part in ("held", "read"):
            assert [[t.tolist() for t in heads] for heads in getattr(a, part)] == \
                   [[t.tolist() for t in heads] for heads in getattr(b, part)]


def test_unprobed_requests_pay_nothing(tiny_llama_dir):
    engine = _engine(tiny_llama_dir, "snapkv")
    seq, = engine.generate([GenerationRequest("r", PROMPTS[0], 4, ignore_eos=True)])
    assert engine.runner.probe is None and engine.kv.positions is None


def test_tracker_follows_keeps_drops_and_appended_tails():
    """Random keeps, drops and appends (decode tokens the tracker is never told about) against a list model."""
    rng = random.Random(0)
    tracker = PositionTracker(num_layers=1, num_kv_heads=2, capacity=256)
    tracker.watch(3)
    tracker.stored(3, 0, 0, 30)
    tracker.stored(3, 0, 30, 10)                # a second prefill chunk
    model = [list(range(40)), list(range(40))]
    next_pos = 40
    for _ in range(200):
        op = rng.choice(["append", "keep", "drop"])
        if op == "append":                      # both heads get the next position, unannounced
            for h in range(2):
                model[h].append(next_pos)
            next_pos += 1
        elif op == "keep":
            h = rng.randrange(2)
            count = len(model[h])
            index = sorted(rng.sample(range(count), rng.randint(1, count)))
            tracker.kept(3, 0, h, torch.tensor(index), count)
            model[h] = [model[h][i] for i in index]
        elif all(len(m) > 1 for m in model):
            h = rng.randrange(2)
            hole, last = rng.randrange(len(model[h])), len(model[h]) - 1
            tracker.dropped(torch.tensor([3]), 0, torch.tensor([h]), torch.tensor([hole]), torch.tensor([last]))
            model[h][hole] = model[h][last]
            model[h].pop()
        for h in range(2):
            assert tracker.positions_of(3, 0, h, len(model[h])).tolist() == model[h]

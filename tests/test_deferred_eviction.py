"""Deferred decode-time eviction (after_decode_step once per fused step) equals the per-layer after_append it replaces.

Two engines run the same requests in lockstep, one with each kind of eviction; after every engine step they must
hold the same logits bits, token counts, block tables, pool contents, MinMax bounds of resident pages, free lists
(block ids in order) and policy ledgers, through preemption, shared contexts (forks) and kept prefixes.
"""
import random

import pytest
import torch

from systems.base import GenerationRequest
from systems.engine.kv_cache import TieredKVCache
from systems.engine.ops import cpu_kernels
from systems.policies import load_policy
from tests.test_engine_invariants import MODULE, POLICIES, _engine, _shared_requests

DEFERRING = ["streaming", "tova", "h2o", "cake", "cake_nocascade", "snapkv"]
needs_kernels = pytest.mark.skipif(not cpu_kernels.has_fused_decode(), reason="CPU kernels not built")


def instrument(engine, hooks: tuple[str, ...]) -> dict:
    """Record each engine step's logits and count the calls of the named policy hooks (the record, by name)."""
    record: dict = {"logits": [], **{hook: 0 for hook in hooks}}
    run_step, policy = engine.runner.run_step, engine.policy

    def logged_run_step(decodes, chunks):
        out = run_step(decodes, chunks)
        record["logits"].append(out.clone())
        return out

    def counted(hook: str):
        method = getattr(policy, hook)

        def call(*args):
            record[hook] += 1
            return method(*args)
        return call

    engine.runner.run_step = logged_run_step
    for hook in hooks:
        setattr(policy, hook, counted(hook))
    return record


def _instrumented(path, name: str, defer: bool, blocks: int):
    """An engine whose fused step defers eviction or not, recording each step's logits and which hook ran."""
    engine = _engine(path, load_policy(MODULE.get(name, name), POLICIES[name]), blocks)
    assert engine.runner.fused is not None
    engine.runner.fused.defer = defer
    # mixed steps per op on both sides: decode steps are compared here, block for block; test_fused_mixed compares
    # the fused mixed step (which defers too) with the per-op one
    engine.runner.mixed = None
    return engine, instrument(engine, ("after_decode_step", "after_append"))


def _state(engine) -> dict:
    kv, policy = engine.kv, engine.policy
    resident = kv.block_table != 0
    out = {"num_tokens": kv.num_tokens, "block_table": kv.block_table, "host_table": kv.host_table,
           "k_pool": kv.k_pool, "v_pool": kv.v_pool, "kmin": kv.kmin[resident], "kmax": kv.kmax[resident],
           "free_device": kv.device_blocks._stack[:kv.device_blocks.num_free],
           "free_host": kv.host_blocks._stack[:kv.host_blocks.num_free]}
    ledger = getattr(policy, "ledger", None)
    if ledger is not None:
        held = torch.arange(ledger.pos.shape[-1]).view(1, 1, 1, -1) < ledger.count.unsqueeze(-1)
        out.update(ledger_count=ledger.count, ledger_pos=ledger.pos[held])
        if ledger.score is not None:
            out["ledger_score"] = ledger.score[held]
    return {key: value.clone() for key, value in out.items()}


def pages_state(engine) -> dict:
    """_state read through the block tables: what each head's pages hold on each tier and how many blocks are free,
    not which blocks hold them (two engines that free and take blocks in another order still agree here)."""
    kv = engine.kv
    resident, hosted = kv.block_table != 0, kv.host_table != 0
    device, host = kv.block_table[resident].long(), kv.host_table[hosted].long()

    def held(pool: torch.Tensor, blocks: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        """The blocks' token rows below each head's count (a block's later rows keep what its last user left)."""
        P = kv.page_size
        page = where.nonzero()[:, 3]
        count = kv.num_tokens.unsqueeze(-1).expand_as(where)[where]
        valid = page.unsqueeze(-1) * P + torch.arange(P) < count.unsqueeze(-1)
        return torch.where(valid.view(-1, P, 1), pool[blocks], torch.zeros((), dtype=pool.dtype))

    out = {"num_tokens": kv.num_tokens, "resident": resident, "hosted": hosted,
           "k": held(kv.k_pool, device, resident), "v": held(kv.v_pool, device, resident),
           "kmin": kv.kmin[resident], "kmax": kv.kmax[resident],
           "host_k": held(kv.host_k_pool, host, hosted), "host_v": held(kv.host_v_pool, host, hosted),
           "free": torch.tensor([kv.device_blocks.num_free, kv.host_blocks.num_free])}
    out.update({key: value for key, value in _state(engine).items() if key.startswith("ledger")})
    return {key: value.clone() for key, value in out.items()}


def lockstep(engines: tuple, logs: tuple[dict, dict], requests: list, arrive_at: list[int],
             state=None) -> tuple[list, list]:
    """Run two engines over the same arrivals, one step each in turn, asserting after every step that they hold the
    same state (`state`, by default _state), logits bits and preemptions; then the same outputs and kv_stats
    (wall-clock seconds, keys ending in _time_s, aside). Returns their sequences."""
    state = state or _state
    pending, step, seqs = sorted(zip(arrive_at, range(len(requests))), key=lambda p: p[0]), 0, ([], [])
    first, second = engines
    while pending or first.scheduler.has_work() or second.scheduler.has_work():
        while pending and pending[0][0] <= step:
            i = pending.pop(0)[1]
            for engine, out in zip(engines, seqs):
                out.append(engine.add_request(requests[i]))
        first.step()
        second.step()
        a, b = state(first), state(second)
        for key in a:
            assert torch.equal(a[key], b[key]), f"{key} differs after step {step}"
        assert len(logs[0]["logits"]) == len(logs[1]["logits"])
        assert all(torch.equal(x, y) for x, y in zip(logs[0]["logits"], logs[1]["logits"])), f"logits at step {step}"
        assert first.scheduler.num_preemptions == second.scheduler.num_preemptions
        assert first.kv.minmax_bytes_read == second.kv.minmax_bytes_read
        step += 1
        assert step < 5000
    for d, p in zip(*seqs):
        assert d.output_ids == p.output_ids and d.token_logprobs == p.token_logprobs and not d.error
        untimed = [{k: v for k, v in s.kv_stats.items() if not k.endswith("_time_s")} for s in (d, p)]
        assert untimed[0] == untimed[1]
    return seqs


def _lockstep(path, name: str, requests: list, arrive_at: list[int], blocks: int, kept: str | None = None):
    (deferred, dlog), (per_layer, plog) = (_instrumented(path, name, defer, blocks) for defer in (True, False))
    lockstep((deferred, per_layer), (dlog, plog), requests, arrive_at)
    if kept is not None:
        assert deferred.release_prefix(kept) and per_layer.release_prefix(kept)
        assert torch.equal(_state(deferred)["free_device"], _state(per_layer)["free_device"])
    assert dlog["after_decode_step"] > 0 and plog["after_decode_step"] == 0      # both kinds of eviction did run
    assert plog["after_append"] > dlog["after_append"]
    return deferred.scheduler.num_preemptions


@needs_kernels
@pytest.mark.parametrize("name", DEFERRING)
def test_deferred_eviction_equals_per_layer_eviction_under_preemption(tiny_llama_dir, name):
    preemptions = 0
    for seed in (0, 1):
        rng = random.Random(seed)
        g = torch.Generator().manual_seed(seed)
        requests = [GenerationRequest(f"r{i}", torch.randint(3, 200, (rng.randint(3, 72),), generator=g).tolist(),
                                      rng.randint(1, 30), ignore_eos=True, logprob_steps=0) for i in range(9)]
        # admission fits each prompt (CAKE's whole-prompt prefill peak needs more), but a head at its budget needs a
        # fresh page before it evicts, so decodes preempt
        blocks = 90 if name.startswith("cake") else 70
        preemptions += _lockstep(tiny_llama_dir, name, requests, [rng.randint(0, 20) for _ in requests], blocks)
    assert preemptions > 0                                  # the pool was tight enough to preempt


@needs_kernels
@pytest.mark.parametrize("name", DEFERRING)
def test_deferred_eviction_equals_per_layer_eviction_with_forks(tiny_llama_dir, name):
    rng = random.Random(3)
    requests = _shared_requests(rng, torch.Generator().manual_seed(3), 3)
    _lockstep(tiny_llama_dir, name, requests, [rng.randint(0, 30) for _ in requests], blocks=160, kept="3-kept")


def test_policies_that_defer_and_those_that_do_not():
    """Deferring needs a rule that knows multi-layer steps: a subclass with its own after_append, or a scorer that
    does not say its rows are scored alone, keeps the per-layer hook."""
    from tests.test_score_and_keep import KeepOldest

    def policy(name):
        return load_policy(MODULE.get(name, name), POLICIES.get(name, {}))

    for name in ("streaming", "tova", "h2o", "cake", "cake_nocascade", "snapkv", "knorm", "pyramidkv"):
        assert policy(name).defers_eviction(), name
    for name in ("dense", "quest", "flexicache", "flexicache_naive", "lserve"):
        assert not policy(name).defers_eviction(), name
    assert not KeepOldest(budget=8).defers_eviction()
    streaming = type(load_policy("streaming", {}))

    class OwnRule(streaming):
        def after_append(self, kv, step):
            pass

    assert not OwnRule().defers_eviction()


def test_the_engine_asks_a_policy_which_hooks_it_overrides():
    """What the engine skips for a policy is decided by the hooks its class (or a base below Policy) defines."""
    def cls(name):
        return type(load_policy(MODULE.get(name, name), POLICIES.get(name, {})))

    dense, quest, flexicache, cake = cls("dense"), cls("quest"), cls("flexicache"), cls("cake")
    assert not any(dense.overrides(h) for h in ("select_pages", "after_append", "after_prefill_layer",
                                                "after_extend_layer", "decode_page_rule"))
    assert quest.overrides("select_pages") and not quest.overrides("after_append")
    assert flexicache.overrides("decode_page_rule") and flexicache.overrides("after_prefill_layer")
    assert cake.overrides("after_append") and cake.overrides("after_prefill_layer")   # from its ScoreAndKeep base
    assert not cake.overrides("select_pages")

    class OwnRule(cake):
        def select_pages(self, kv, step):
            return None

    assert OwnRule.overrides("select_pages") and OwnRule.overrides("after_append")


def test_drop_with_a_layer_per_entry_equals_one_drop_per_layer():
    """Same storage, bounds, counts and free list (ids in order) as one call per layer, pages emptied included."""
    def cache():
        kv = TieredKVCache(num_layers=3, num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=4, max_seqs=2,
                           max_model_len=64, device_memory_gb=1e-4, host_memory_gb=1e-4, dtype=torch.float32,
                           device=torch.device("cpu"))
        gen = torch.Generator().manual_seed(0)
        for slot, n in ((0, 13), (1, 9)):
            for layer in range(3):
                k = torch.randn(n, 2, 8, generator=gen)
                kv.store_prefill(slot, layer, k, k + 1)
        return kv

    slots, layers = torch.tensor([0, 1, 0, 0, 1, 1]), torch.tensor([0, 0, 1, 2, 2, 2])
    heads, index = torch.tensor([1, 0, 0, 1, 0, 1]), torch.tensor([3, 8, 12, 0, 5, 8])
    one, per = cache(), cache()
    one.drop_tokens(slots, layers, heads, index)
    for layer in range(3):
        at = layers == layer
        per.drop_tokens(slots[at], layer, heads[at], index[at])
    assert one.device_blocks.num_free > cache().device_blocks.num_free        # pages did empty
    for key in ("num_tokens", "block_table", "k_pool", "v_pool"):
        assert torch.equal(getattr(one, key), getattr(per, key)), key
    resident = one.block_table != 0
    assert torch.equal(one.kmin[resident], per.kmin[resident]) and torch.equal(one.kmax[resident], per.kmax[resident])
    assert torch.equal(one.device_blocks._stack[:one.device_blocks.num_free],
                       per.device_blocks._stack[:per.device_blocks.num_free])

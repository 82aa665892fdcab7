"""Quest, FlexiCache and LServe-style on the engine with a tiny random fp32 model: dense parity at full budget, real
device memory, admission under a capped pool, promotion = set difference, no block leak."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from systems.base import GenerationRequest
from systems.engine.engine import Engine
from systems.policies import load_policy
from systems.policy_support import selection

P = 4                     # page size of the tests: short prompts span many pages
LAYERS, KV_HEADS = 4, 2


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls on a shared 2-core box: one thread avoids spin-wait contention (60x faster under load)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("retrieval_llama")
    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                                 num_attention_heads=4, num_key_value_heads=KV_HEADS, max_position_embeddings=512,
                                 initializer_range=0.2)).save_pretrained(path)
    return path


def _engine(path, policy, blocks=4096, max_num_seqs=4, chunked_prefill=True):
    block_bytes = 2 * P * 8 * 4                                        # K and V, head_dim 8, fp32
    cfg = SimpleNamespace(page_size=P, device_memory_gb=blocks * block_bytes / 2 ** 30,
                          host_memory_gb=4096 * block_bytes / 2 ** 30, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=1024, chunked_prefill=chunked_prefill)
    return Engine(str(path), policy, cfg, dtype="float32")


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def _generate(engine, prompts, max_new=24):
    free = (engine.kv.free_device_blocks(), engine.kv.free_host_blocks())
    seqs = engine.generate([GenerationRequest(str(i), p, max_new, ignore_eos=True) for i, p in enumerate(prompts)])
    assert (engine.kv.free_device_blocks(), engine.kv.free_host_blocks()) == free   # no block leaked
    return [s.output_ids for s in seqs], seqs


FLEXI = dict(rerank_interval=4, unstable_heads=[[1, 0], [3, 1]])


@pytest.mark.parametrize("name,params", [
    ("quest", dict(budget=512, skip_layers=0, selection_rule="efficiency_kernels")),
    ("flexicache", dict(budget=512, **FLEXI)),
    ("flexicache", dict(budget=512, naive=True, **FLEXI)),
    ("lserve", dict(budget=512, sink_tokens=8, local_tokens=16, streaming_heads=[], physical_page=16)),
])
def test_budget_at_least_context_gives_exactly_dense(tiny_dir, name, params):
    prompts = _prompts([37, 70, 12])
    dense, _ = _generate(_engine(tiny_dir, load_policy("dense")), prompts)
    out, seqs = _generate(_engine(tiny_dir, load_policy(name, params)), prompts)
    assert out == dense
    assert seqs[0].kv_stats["policy"] == name


@pytest.mark.parametrize("rule", ["accuracy_path", "efficiency_kernels"])
@pytest.mark.parametrize("granularity", ["query_head", "kv_head"])
def test_quest_reads_k_pages_and_changes_little_at_small_budget(tiny_dir, granularity, rule):
    policy = load_policy("quest", dict(budget=3 * P, skip_layers=1, granularity=granularity, selection_rule=rule))
    engine = _engine(tiny_dir, policy)
    seen = []
    select = policy.select_pages

    def spy(kv, step):
        chosen = select(kv, step)
        heads = policy._query_heads if granularity == "query_head" else None
        scores = kv.score_pages(step.slots, step.layer, step.q, heads=heads)
        seen.append((step.layer, step.slots.tolist(), chosen,
                     selection.pages_of(kv.num_tokens[step.slots, step.layer], P), scores))
        return chosen
    policy.select_pages = spy
    counted, reset = {}, policy.reset

    def reset_spy(slot):
        counted[slot] = (policy._pages_read[slot] + int(policy._union_read[slot])) if hasattr(
            policy, "_pages_read") else 0
        reset(slot)
    policy.reset = reset_spy
    _generate(engine, _prompts([50, 31]), max_new=6)
    read, per_head_sets, last_skipped = {}, 0, 0
    for layer, slots, chosen, num_pages, scores in seen:
        if chosen is None:
            per_row = num_pages.sum(-1)
        else:                                   # a KV head reads the union of its query heads' sets
            group = chosen.shape[1] // num_pages.shape[1]
            union = selection.as_mask(chosen.reshape(len(slots), num_pages.shape[1], -1), int(num_pages.max()))
            per_row = union.sum((-1, -2))
            per_head_sets += int(group > 1 and bool((chosen.view(len(slots), -1, group, 3).sort(-1).values
                                                     != chosen.view(len(slots), -1, group, 3)[:, :, :1]
                                                     .sort(-1).values).any()))
        for slot, n in zip(slots, per_row.tolist()):
            read[slot] = read.get(slot, 0) + n
        if layer < 1:
            assert chosen is None
            continue
        heads = 4 if granularity == "query_head" else 2                  # the tiny model: 4 query / 2 KV heads
        assert chosen is not None and chosen.shape[1:] == (heads, 3)
        last = (num_pages - 1).repeat_interleave(heads // 2, 1).unsqueeze(-1)
        has_last = (chosen == last).any(-1)
        if rule == "efficiency_kernels":
            assert bool(has_last.all())                                  # the last page is always read
        else:                                                            # the 3 best of all pages, last included
            best = scores.topk(3, dim=-1).values[..., -1:]
            assert bool((scores.gather(-1, chosen) >= best).all())
            last_skipped += int((~has_last).sum())
    # the counters behind kv_stats' mean_pages_read count exactly the pages the engine read
    assert {s: counted[s] for s in read} == read
    assert (per_head_sets > 0) == (granularity == "query_head")     # query heads of a group choose differently
    assert (last_skipped > 0) == (rule == "accuracy_path")           # the accuracy path may leave the last page out


def test_quest_accuracy_path_reads_kv_len_over_page_pages_below_the_budget(tiny_dir):
    """Below the budget the accuracy path reads min(max(3, kv_len // page), pages): with a partial last page that is
    one page less than the head holds, so it is not dense; the efficiency kernels' rule is dense there."""
    accuracy = load_policy("quest", dict(budget=64 * P, skip_layers=0))
    kernels = load_policy("quest", dict(budget=64 * P, skip_layers=0, selection_rule="efficiency_kernels"))
    picks: dict[str, list] = {"accuracy": [], "kernels": []}
    for name, policy in (("accuracy", accuracy), ("kernels", kernels)):
        select = policy.select_pages

        def spy(kv, step, select=select, name=name):
            chosen = select(kv, step)
            picks[name].append((step.seqs[0].seq_len, chosen))
            return chosen
        policy.select_pages = spy
        _generate(_engine(tiny_dir, policy), _prompts([30]), max_new=3)
    assert all(chosen is None for _, chosen in picks["kernels"])
    for seq_len, chosen in picks["accuracy"]:
        want = max(3, seq_len // P)
        if want >= -(-seq_len // P):
            assert chosen is None
        else:
            assert chosen is not None and bool(((chosen >= 0).sum(-1) == want).all())
    assert any(chosen is not None for _, chosen in picks["accuracy"])


def _analytic_blocks(policy, pages):
    n_unstable = int(policy.unstable.sum())
    return n_unstable * pages + (LAYERS * KV_HEADS - n_unstable) * min(pages, policy.top_k)


def test_flexicache_device_blocks_equal_analytic_count(tiny_dir):
    policy = load_policy("flexicache", dict(budget=2 * P, **FLEXI))
    engine = _engine(tiny_dir, policy)
    used0 = engine.kv.device_blocks.num_used
    seq = engine.add_request(GenerationRequest("a", _prompts([61])[0], 30, ignore_eos=True))
    engine.step()                                                      # prefill
    pages = -(-61 // P)
    assert engine.kv.device_blocks.num_used - used0 == _analytic_blocks(policy, pages)
    while not engine.step():
        pages = -(-len(seq.token_ids) // P)
        used = engine.kv.device_blocks.num_used - used0
        assert abs(used - _analytic_blocks(policy, pages)) <= LAYERS * KV_HEADS   # within one page per head
    stats, block = seq.kv_stats, policy.bytes_per_block
    assert abs(stats["device_kv_bytes"] - stats["analytic_device_kv_bytes"]) <= LAYERS * KV_HEADS * block
    assert stats["reranks"] >= 30 // 4 and stats["promoted_pages"] == stats["bytes_host_to_device"] // block
    assert stats["offloaded_pages"] > 0 and stats["minmax_bytes"] > 0


def test_flexicache_heads_read_k_pages_counting_the_last(tiny_dir):
    """The official scorer's rule: the last page holds a sentinel score, then the top K; so an unstable head reads K
    pages, the last among them, and a stable head holds K right after prefill and after each rerank."""
    policy = load_policy("flexicache", dict(budget=2 * P, **FLEXI))
    engine = _engine(tiny_dir, policy)
    K, select, reads = policy.top_k, policy.select_pages, []

    def spy(kv, step):
        pages = select(kv, step)
        if pages is not None:
            n = selection.pages_of(kv.num_tokens[step.slots, step.layer], P)
            for heads in (policy._unstable_heads[step.layer], policy._stable_heads[step.layer]):
                chosen = pages[:, heads]
                reads.append(((chosen >= 0).sum(-1), (chosen == (n[:, heads] - 1).unsqueeze(-1)).any(-1),
                              heads is policy._unstable_heads[step.layer]))
        return pages
    policy.select_pages = spy
    seq = engine.add_request(GenerationRequest("a", _prompts([70])[0], 9, ignore_eos=True))
    engine.step()                                                      # prefill: stable heads keep K pages
    table = engine.kv.block_table[seq.slot]
    for layer in range(LAYERS):
        for h in policy._stable_heads[layer].tolist():
            assert int((table[layer, h] != 0).sum()) == K and bool(table[layer, h, -(-70 // P) - 1] != 0)
    while not engine.step():
        pass
    unstable = [(count, last) for count, last, is_unstable in reads if is_unstable and count.numel()]
    assert unstable and all(bool((c == K).all()) and bool(last.all()) for c, last in unstable)
    # stable heads read what they hold: K, or K + the page begun since the last rerank
    assert all(bool(((c >= K) & (c <= K + 1)).all()) and bool(last.all()) for c, last, u in reads if not u)


def test_capped_pool_admits_more_flexicache_requests_than_dense(tiny_dir):
    def peak_running(policy):
        engine = _engine(tiny_dir, policy, blocks=420, max_num_seqs=8)
        for i, p in enumerate(_prompts([96] * 6)):
            engine.add_request(GenerationRequest(str(i), p, 4, ignore_eos=True))
        peak = 0
        while engine.scheduler.has_work():
            engine.step()
            peak = max(peak, len(engine.scheduler.running))
        return peak
    dense = peak_running(load_policy("dense"))
    flexi = peak_running(load_policy("flexicache", dict(budget=2 * P, unstable_heads=[[0, 0]])))
    assert flexi > dense >= 1


def test_a_promotion_moves_exactly_the_set_difference(tiny_dir):
    policy = load_policy("flexicache", dict(budget=2 * P, **FLEXI))
    engine = _engine(tiny_dir, policy)
    kv, records = engine.kv, []
    swap, promote = policy._swap, kv.promote_pages

    def spy_swap(kv_, step, rows, heads, resident, chosen):
        records.append({"step": step, "rows": rows, "heads": heads, "resident": resident.clone(),
                        "chosen": chosen.clone(), "moved": []})
        swap(kv_, step, rows, heads, resident, chosen)
        after = kv.block_table[step.slots[rows].view(-1, 1), step.layer, heads.view(1, -1), :chosen.shape[-1]] != 0
        assert torch.equal(after, chosen)                              # the device now holds exactly the new set

    def spy_promote(slots, layers, heads, pages, recycle=None):
        records[-1]["moved"] += list(zip(slots.tolist(), heads.tolist(), pages.tolist()))
        promote(slots, layers, heads, pages, recycle=recycle)
    policy._swap, kv.promote_pages = spy_swap, spy_promote
    _generate(engine, _prompts([45, 66]), max_new=20)
    moved_total = 0
    for rec in records:
        want = set()
        for i, b in enumerate(rec["rows"].tolist()):
            slot = int(rec["step"].slots[b])
            for j, h in enumerate(rec["heads"].tolist()):
                new = rec["chosen"][i, j] & ~rec["resident"][i, j]
                want |= {(slot, h, int(p)) for p in new.nonzero().view(-1)}
        assert sorted(rec["moved"]) == sorted(want)
        moved_total += len(want)
    assert moved_total > 0                                             # the workload did promote pages


@pytest.mark.parametrize("name,params,blocks", [
    ("flexicache", dict(budget=2 * P, **FLEXI), 115),
    ("flexicache", dict(budget=3 * P, naive=True, **FLEXI), 105),
    ("quest", dict(budget=2 * P), 300),
    ("lserve", dict(budget=4 * P, sink_tokens=4, local_tokens=8, physical_page=8, reuse_interval=2,
                    streaming_heads=[[0, 1], [2, 0], [3, 1]]), 200),
])
def test_no_block_leak_after_a_randomized_workload_with_preemption(tiny_dir, name, params, blocks):
    rng = random.Random(7)
    # prefill-first scheduling fills the pool before decodes grow: the sizes below are tuned to preempt under it
    # (tests/test_chunked_prefill.py preempts chunked sequences of every policy)
    engine = _engine(tiny_dir, load_policy(name, params), blocks=blocks, max_num_seqs=6, chunked_prefill=False)
    free = (engine.kv.free_device_blocks(), engine.kv.free_host_blocks())
    prompts = _prompts([rng.randint(5, 90) for _ in range(8)], seed=3)
    reqs = [GenerationRequest(str(i), p, rng.randint(1, 30), ignore_eos=True) for i, p in enumerate(prompts)]
    seqs = engine.generate(reqs)
    assert all(s.num_output_tokens == r.max_new_tokens for s, r in zip(seqs, reqs))
    assert engine.scheduler.num_preemptions > 0                       # the pool was tight enough to preempt
    assert (engine.kv.free_device_blocks(), engine.kv.free_host_blocks()) == free


def test_lserve_streaming_heads_keep_sink_and_window_and_retrieval_heads_read_k_physical_pages(tiny_dir):
    params = dict(budget=8, physical_page=8, sink_tokens=4, local_tokens=8, reuse_interval=2,
                  streaming_heads=[[0, 1], [2, 0]])
    policy = load_policy("lserve", params)
    engine = _engine(tiny_dir, policy)
    reads = []
    select = policy.select_pages

    def spy(kv, step):
        chosen = select(kv, step)
        reads.append((step.layer, step.seqs[0].seq_len, chosen))
        return chosen
    policy.select_pages = spy
    seq = engine.add_request(GenerationRequest("a", _prompts([57])[0], 12, ignore_eos=True))
    while not engine.step():
        kv = engine.kv
        for layer, head in ((0, 1), (2, 0)):
            n = int(kv.num_tokens[seq.slot, layer, head])
            resident = set((kv.block_table[seq.slot, layer, head, :-(-n // P)] != 0).nonzero().view(-1).tolist())
            last = (n - 1) // P
            assert resident == {0} | set(range(last - 2, last + 1))    # 1 sink page + 8/4 local + the last page
    by_step = {}
    for layer, seq_len, chosen in reads:
        if layer == 1 and chosen is not None:                          # a retrieval-only layer, past the budget
            by_step[seq_len] = {p // 2 for p in chosen[0, 0].tolist() if p >= 0}
    assert len(by_step) >= 8
    for seq_len, phys in by_step.items():
        last = (seq_len - 1) // P // 2
        if seq_len % 2 == 0:                                           # refresh: max(3, 8 // 8) physical pages
            assert len(phys) == 3 and last in phys
        elif seq_len - 1 in by_step:                                   # reuse: the last choice + the newest page
            assert phys == by_step[seq_len - 1] | {last}


def test_lserve_reused_answers_equal_a_fresh_selection(tiny_dir):
    """LServe returns a layer's last answer while nothing it depends on changed (no choice due, no page started or
    released, no row crossing the budget): at every such step it must equal a fresh selection (sequences join,
    finish and start pages at different steps)."""
    params = dict(budget=8, physical_page=8, sink_tokens=4, local_tokens=8, reuse_interval=8,
                  streaming_heads=[[0, 1], [2, 0], [3, 1]])
    policy = load_policy("lserve", params)
    engine = _engine(tiny_dir, policy, max_num_seqs=2)
    select, reused = policy.select_pages, []

    def checked_select(kv, step):
        before = dict(policy._last_read)
        pages = select(kv, step)
        if step.layer in before and policy._last_read[step.layer] is before[step.layer]:    # answered from before
            fresh = policy._read_pages(kv, step, [], [s.pages(kv.page_size) for s in step.seqs],
                                       [s.seq_len > policy.budget for s in step.seqs])
            width = kv.max_pages
            assert (pages is None) == (fresh is None)
            if pages is not None:
                assert torch.equal(selection.as_mask(pages, width), selection.as_mask(fresh, width))
            reused.append(step.layer)
        return pages
    policy.select_pages = checked_select
    rng = random.Random(5)
    _generate(engine, _prompts([rng.randint(20, 70) for _ in range(6)], seed=5), max_new=32)
    assert len(reused) > 40


def test_bad_params_fail_in_one_line(tiny_dir):
    with pytest.raises(ValueError, match="engine.page_size"):          # the page size is the engine's alone
        _engine(tiny_dir, load_policy("quest", dict(budget=3 * P + 1)))
    with pytest.raises(ValueError, match="unknown parameter"):
        load_policy("quest", dict(page_size=16))
    with pytest.raises(ValueError, match="multiple of physical_page"):
        load_policy("lserve", dict(budget=100))
    with pytest.raises(ValueError, match="outside the model"):
        _engine(tiny_dir, load_policy("flexicache", dict(unstable_heads=[[9, 0]])))
    with pytest.raises(ValueError, match="no flexicache profile"):
        load_policy("flexicache", dict(profile_model="nope"))
    with pytest.raises(ValueError, match="lserve: no profile"):
        load_policy("lserve", dict(profile_model="nope"))


def test_naive_reranks_every_step_and_stability_aware_every_r_steps(tiny_dir):
    prompts = _prompts([61])
    stats = {}
    for naive in (False, True):
        _, seqs = _generate(_engine(tiny_dir, load_policy("flexicache", dict(budget=2 * P, naive=naive, **FLEXI))),
                            prompts, max_new=17)
        stats[naive] = seqs[0].kv_stats
    steps = 16                                                         # decode steps after the prefill token
    assert stats[True]["reranks"] == steps
    assert stats[False]["reranks"] == 1 + steps // 4                   # step 1 and every R = 4 steps
    assert stats[True]["promoted_pages"] > stats[False]["promoted_pages"]


def test_flexicache_reads_exactly_the_pages_its_stable_heads_hold(tiny_dir):
    """The stable heads' read list is kept between reranks; at every step it must equal what the device holds
    (a randomized workload: sequences join, finish and start pages at different steps)."""
    policy = load_policy("flexicache", dict(budget=2 * P, **FLEXI))
    engine = _engine(tiny_dir, policy, max_num_seqs=3)
    kv, select, checked = engine.kv, policy.select_pages, []

    def checked_select(kv_, step):
        pages = select(kv_, step)
        stable = policy._stable_heads[step.layer]
        if pages is not None and stable.numel():
            held = kv.resident_pages(step.slots, step.layer, heads=stable)
            got = pages[:, stable]
            assert torch.equal(selection.as_mask(got, kv.max_pages), selection.as_mask(held, kv.max_pages))
            checked.append(step.layer)
        return pages
    policy.select_pages = checked_select
    rng = random.Random(3)
    _generate(engine, _prompts([rng.randint(30, 70) for _ in range(5)], seed=3), max_new=18)
    assert len(checked) > 50

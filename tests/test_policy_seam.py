"""The policy seam: KV view primitives (evict, drop, offload, promote) and hook wiring, with test-local policies."""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from systems.base import GenerationRequest
from systems.engine.engine import Engine
from systems.engine.kv_cache import TieredKVCache
from systems.policies import load_policy
from systems.policies.base import Policy

P, H, D = 4, 2, 8


def _cache(**kw):
    args = dict(num_layers=2, num_q_heads=4, num_kv_heads=H, head_dim=D, page_size=P, max_seqs=2, max_model_len=64,
                device_memory_gb=1e-4, host_memory_gb=1e-4, dtype=torch.float32, device=torch.device("cpu"))
    args.update(kw)
    return TieredKVCache(**args)


def _check_minmax(kv, slot, layer):
    k, _, counts = kv.gather_tokens(torch.tensor([slot]), layer)
    for h in range(H):
        n = int(counts[0, h])
        for page in range(-(-n // P)):
            keys = k[0, h, page * P:min(n, page * P + P)]
            assert torch.equal(kv.kmin[slot, layer, h, page], keys.amin(0))
            assert torch.equal(kv.kmax[slot, layer, h, page], keys.amax(0))


def test_keep_tokens_compacts_frees_and_keeps_minmax_exact():
    kv = _cache()
    free0 = kv.free_device_blocks()
    k, v = torch.randn(13, H, D), torch.randn(13, H, D)
    kv.store_prefill(1, 0, k, v)
    assert kv.free_device_blocks() == free0 - H * 4
    keep = [torch.tensor([0, 1, 7, 12]), torch.tensor([2, 3, 4, 5, 6, 8, 9])]
    kv.keep_tokens(1, 0, keep)
    gk, gv, counts = kv.gather_tokens(torch.tensor([1]), 0)
    assert counts[0].tolist() == [4, 7]
    for h in range(H):
        assert torch.equal(gk[0, h, :len(keep[h])], k[keep[h], h])
        assert torch.equal(gv[0, h, :len(keep[h])], v[keep[h], h])
    assert kv.free_device_blocks() == free0 - (1 + 2)
    _check_minmax(kv, 1, 0)
    kv.free_seq(1)
    assert kv.free_device_blocks() == free0


def test_drop_tokens_moves_last_into_hole_and_frees_empty_page():
    kv = _cache()
    free0 = kv.free_device_blocks()
    k = torch.randn(9, H, D)
    kv.store_prefill(0, 1, k, k.clone())
    kv.drop_tokens(torch.tensor([0, 0]), 1, torch.tensor([0, 1]), torch.tensor([2, 8]))
    gk, _, counts = kv.gather_tokens(torch.tensor([0]), 1)
    assert counts[0].tolist() == [8, 8]
    expect0 = k[:, 0].clone()
    expect0[2] = k[8, 0]
    assert torch.equal(gk[0, 0], expect0[:8]) and torch.equal(gk[0, 1], k[:8, 1])
    assert kv.free_device_blocks() == free0 - H * 2               # the 9th token's page is gone in both heads
    _check_minmax(kv, 0, 1)
    kv.free_seq(0)
    assert kv.free_device_blocks() == free0


def test_offload_release_promote_round_trip_counts_bytes_and_recycles_blocks():
    kv = _cache()
    free_dev, free_host = kv.free_device_blocks(), kv.free_host_blocks()
    k = torch.randn(12, H, D)
    kv.store_prefill(0, 0, k, -k)
    s, lyr, h = torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long), torch.tensor([0, 0, 1])
    pages = torch.tensor([0, 1, 0])
    kv.offload_pages(s, lyr, h, pages)
    kv.release_device_pages(s, lyr, h, pages)
    assert kv.free_device_blocks() == free_dev - H * 3 + 3 and kv.free_host_blocks() == free_host - 3
    assert kv.block_table[0, 0, 0, :2].eq(0).all() and kv.host_table[0, 0, 0, :2].ne(0).all()
    recycled = int(kv.block_table[0, 0, 0, 2])
    kv.promote_pages(s[:1], lyr[:1], h[:1], pages[:1], recycle=torch.tensor([2]))   # page 0 takes page 2's block
    assert int(kv.block_table[0, 0, 0, 0]) == recycled and int(kv.block_table[0, 0, 0, 2]) == 0
    kv.promote_pages(s[1:], lyr[1:], h[1:], pages[1:])
    gk, gv, _ = kv.gather_tokens(torch.tensor([0]), 0)
    assert torch.equal(gk[0, 0, :8], k[:8, 0]) and torch.equal(gv[0, 1, :4], -k[:4, 1])
    assert kv.bytes_device_to_host == 3 * kv.bytes_per_block and kv.bytes_host_to_device == 3 * kv.bytes_per_block
    kv.free_seq(0)
    assert kv.free_device_blocks() == free_dev and kv.free_host_blocks() == free_host


def test_unknown_policy_and_params_fail_in_one_line():
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        load_policy("nope")
    with pytest.raises(ValueError, match=r"valid: none"):
        load_policy("dense", {"budget": 1})


# ---- hook wiring on a tiny model: policies that must reproduce dense exactly -------------------------------------

@dataclass
class KeepAllViaEviction(Policy):
    """Runs keep_tokens after every prefill layer, keeping every token (storage rewritten in place)."""

    name = "keep_all"

    def after_prefill_layer(self, kv, seq, layer, q, k):
        assert q.shape[0] == k.shape[0] == seq.prefill_len and seq.decode_step == 0
        n = int(kv.num_tokens[seq.slot, layer, 0])
        kv.keep_tokens(seq.slot, layer, [torch.arange(n)] * kv.num_kv_heads)


@dataclass
class ShuffledSelectAll(Policy):
    """Selects every page, in a shuffled order with padding, through the sparse path."""

    name = "select_all"

    def select_pages(self, kv, step):
        counts = kv.num_tokens[step.slots, step.layer].long()
        pages = -(-counts // kv.page_size)
        width = int(pages.max()) + 2
        idx = torch.arange(width).view(1, 1, -1).expand(*pages.shape, width)
        sel = torch.where(idx < pages.unsqueeze(-1), idx, -1)
        return sel.flip(-1)


@dataclass
class OffloadThenPromote(Policy):
    """Offloads and releases every full page after prefill, promotes them back at the first decode step, and pauses
    each sequence for one step after its promotion: tier traffic and pausing with dense results."""

    name = "offload_promote"

    def __post_init__(self):
        self.offloaded: dict[int, list] = {}

    def reset(self, slot):
        self.offloaded.pop(slot, None)

    def after_prefill_layer(self, kv, seq, layer, q, k):
        full = int(kv.num_tokens[seq.slot, layer, 0]) // kv.page_size
        if full == 0:
            return
        heads, pages = torch.meshgrid(torch.arange(kv.num_kv_heads), torch.arange(full), indexing="ij")
        args = (torch.full((heads.numel(),), seq.slot), torch.full((heads.numel(),), layer), heads.flatten(),
                pages.flatten())
        kv.offload_pages(*args)
        kv.release_device_pages(*args)
        self.offloaded.setdefault(seq.slot, []).append(args)

    def select_pages(self, kv, step):
        for slot in step.slots.tolist():
            for args in [a for a in self.offloaded.get(slot, []) if int(a[1][0]) == step.layer]:
                kv.promote_pages(*args)
                if step.layer == kv.num_layers - 1:
                    kv.pause(slot)
        if step.layer == kv.num_layers - 1:
            for slot in step.slots.tolist():
                self.offloaded.pop(slot, None)
        return None


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("seam_llama")
    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                 initializer_range=0.2)).save_pretrained(path)
    return path


def _run(path, policy, prompts):
    cfg = SimpleNamespace(page_size=4, device_memory_gb=0.01, host_memory_gb=0.01, max_num_seqs=4,
                          max_num_batched_tokens=256)
    engine = Engine(str(path), policy, cfg, dtype="float32")
    free = (engine.kv.free_device_blocks(), engine.kv.free_host_blocks())
    seqs = engine.generate([GenerationRequest(str(i), p, 10, ignore_eos=True) for i, p in enumerate(prompts)])
    assert (engine.kv.free_device_blocks(), engine.kv.free_host_blocks()) == free
    return engine, [s.output_ids for s in seqs], seqs


@pytest.mark.parametrize("policy_cls", [KeepAllViaEviction, ShuffledSelectAll, OffloadThenPromote])
def test_hooks_reproduce_dense(tiny_dir, policy_cls):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (6, 19, 33)]
    _, dense, _ = _run(tiny_dir, load_policy("dense"), prompts)
    engine, out, seqs = _run(tiny_dir, policy_cls(), prompts)
    assert out == dense
    assert seqs[1].kv_stats["policy"] == policy_cls.name
    if policy_cls is OffloadThenPromote:
        assert engine.kv.bytes_device_to_host == engine.kv.bytes_host_to_device > 0


def test_score_pages_uses_exact_minmax_of_every_page():
    kv = _cache()
    k = torch.randn(10, H, D)
    kv.store_prefill(1, 1, k, k)
    q = torch.randn(1, 4, D)
    scores = kv.score_pages(torch.tensor([1]), 1, q)
    assert scores.shape == (1, H, 3)
    for h in range(H):
        for page in range(3):
            keys = k[page * P:min(10, page * P + P), h]
            bound = torch.maximum(q[0, 2 * h:2 * h + 2, None] * keys.amin(0),
                                  q[0, 2 * h:2 * h + 2, None] * keys.amax(0))
            assert torch.isclose(scores[0, h, page], bound.sum(-1).amax(), atol=1e-5)
            assert scores[0, h, page] >= (keys @ q[0, 2 * h:2 * h + 2].T).max() - 1e-5

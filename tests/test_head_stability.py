"""Head-stability profiler: analysis on hand-made traces, profile files (round trip, leave-one-out), and one tiny
end-to-end run whose profile a FlexiCache engine then loads."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from harness.experiments import head_stability
from harness.experiments.head_stability import analysis as stability
from systems.policies import load_policy
from systems.policy_support import profiles


def _profile(task="t1", **kw):
    base = {"kind": "flexicache", "model": "m", "task": task, "K": 2, "W": 3, "page_size": 16, "num_layers": 2,
            "num_kv_heads": 2, "unstable_heads": [[1, 1]], "head_stats": [{"layer": 1, "head": 1, "ts_mean": 0.1}]}
    return {**base, **kw}


def test_profile_round_trip_and_validation(tmp_path):
    from systems.policies import policy_class

    schema = policy_class("flexicache").profile_schema           # the policy declares what its profile holds
    path = profiles.save_profile(tmp_path / "p.json", _profile(), schema)
    assert profiles.load_profile(path, "flexicache", schema) == _profile()
    with pytest.raises(ValueError, match="lacks"):
        profiles.save_profile(tmp_path / "bad.json", {"kind": "flexicache", "model": "m"}, schema)
    with pytest.raises(ValueError, match="lacks"):
        profiles.load_profile(path, "flexicache", (*schema, "extra_key"))
    with pytest.raises(ValueError, match="expected 'lserve'"):
        profiles.load_profile(path, "lserve")
    with pytest.raises(ValueError, match="not found"):
        profiles.load_profile(tmp_path / "none.json", "flexicache")
    # made on this model for its shape: loads; for another shape or model: refused, naming the command that fixes it
    assert profiles.load_model_profile(path, "flexicache", schema, "m", "head_stability", 2, 2) == _profile()
    with pytest.raises(ValueError, match=r"is for 2 layers x 2 KV heads, the model has 3 x 2; .*head_stability"):
        profiles.load_model_profile(path, "flexicache", schema, "m", "head_stability", 3, 2)
    with pytest.raises(ValueError, match="was made on model 'm'"):
        profiles.load_model_profile(path, "flexicache", schema, "other", "head_stability", 2, 2)


def test_find_profile_applies_leave_one_out(tmp_path):
    for task in ("a", "b"):
        profiles.save_profile(profiles.profile_path("flexicache", "m", task, tmp_path), _profile(task))
    assert profiles.find_profile("flexicache", "m", ["a", "b"], None, tmp_path).name == "flexicache__m__a.json"
    assert profiles.find_profile("flexicache", "m", ["a", "b"], "a", tmp_path).name == "flexicache__m__b.json"
    assert profiles.find_profile("flexicache", "m", ["a", "b"], "a_quick", tmp_path).name == "flexicache__m__b.json"
    with pytest.raises(ValueError, match="no flexicache profile"):
        profiles.find_profile("flexicache", "m", ["a"], "a", tmp_path)


def _trace(steps, jumpy_head, K=2, pages=8, seed=0):
    """[T, L, Hkv, K] sets: every head keeps pages {0, 1} except `jumpy_head`, which draws fresh pages each step."""
    g = torch.Generator().manual_seed(seed)
    sets = torch.tensor([0, 1], dtype=torch.int16).repeat(steps, 2, 2, 1)
    for t in range(steps):
        sets[t, jumpy_head[0], jumpy_head[1]] = torch.randperm(pages, generator=g)[:K].to(torch.int16)
    return {"sets": sets, "num_pages": torch.full((steps,), pages),
            "outside_mass": torch.tensor([[0.1, 0.9], [0.2, 0.8]]).expand(steps, 2, 2)}


def test_analyse_finds_the_jumpy_head_on_hand_made_traces():
    knobs = head_stability.Params(top_k=2, window=3, unstable_count=1)
    result = stability.analyse([_trace(12, (1, 0)), _trace(9, (1, 0), seed=1)], knobs, 2, 2)
    assert result["unstable_heads"] == [[1, 0]]
    assert result["windows"] == 4 + 3
    stats = {(s["layer"], s["head"]): s for s in result["head_stats"]}
    assert stats[(0, 0)]["ts_mean"] == 1.0 and stats[(1, 0)]["ts_mean"] < 1.0
    assert stats[(1, 0)]["bottom_frequency"] == 7 and stats[(1, 0)]["unstable"]
    assert result["consensus_recall"] == 1.0                          # the half-split recall of the jumpy head
    assert result["promoted_share_stable"] == 0.0                     # stable heads never change their set
    assert torch.allclose(torch.tensor(result["outside_mass"]), torch.tensor([[0.1, 0.9], [0.2, 0.8]]))


def test_analyse_ranks_only_the_managed_layers_of_a_hybrid_model():
    """A jumpy head on a layer left to its window (no traced sets there: PAD) is never picked; the unstable share is a
    share of the managed layers' heads."""
    knobs = head_stability.Params(top_k=2, window=3, unstable_fraction=0.5)
    traces = [_trace(12, (1, 1)), _trace(9, (1, 1), seed=1)]
    for tr in traces:
        tr["sets"][:, 0] = torch.randint(0, 8, tr["sets"][:, 0].shape, dtype=torch.int16)     # layer 0: noise
    result = stability.analyse(traces, knobs, 2, 2, layers=[1])
    assert result["unstable_count"] == 1 and result["unstable_heads"] == [[1, 1]]
    assert [(s["layer"], s["head"]) for s in result["head_stats"]] == [(1, 0), (1, 1)]
    assert len(result["outside_mass"]) == 2                           # the proxy scores keep the model's shape


def test_overlap_table():
    names, matrix = stability.overlap_table({"a": [[0, 1], [1, 1]], "b": [[1, 1], [2, 0]]})
    assert names == ["a", "b"] and matrix == [[1.0, 0.5], [0.5, 1.0]]


def test_end_to_end_profile_feeds_flexicache(tiny_llama_dir, tmp_path):
    from harness.running.driver import run
    from harness.running.schema import Config
    cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.create({
        "model": {"path": str(tiny_llama_dir), "dtype": "float32", "max_input_tokens": 1500, "max_model_len": 2048,
                  "name": "tiny"},
        "exp": {"name": "hs", "kind": "head_stability", "systems": ["dense"],
                "tasks": ["needlebench_srt", "needlebench_mrt"],
                "params": {"top_k": 4, "window": 4, "decode_steps": 12, "sink_tokens": 16, "local_tokens": 32,
                           "task_overrides": {"params": {"lengths": [300], "depths": [50]}, "limit": 1}}},
        "results_dir": str(tmp_path), "progress": False}))
    torch.set_num_threads(1)
    results = run(cfg)
    assert [m["task"] for m in results] == ["needlebench_srt", "needlebench_mrt"]
    summary = (tmp_path / "hs" / "summary.md").read_text()
    assert "Cross-task overlap" in summary
    cell = next(p for p in (tmp_path / "hs").iterdir() if "needlebench_srt" in p.name)
    prof = json.loads((cell / "profile_flexicache.json").read_text())
    assert prof["K"] == 4 and prof["W"] == 4 and len(prof["unstable_heads"]) == 1 and len(prof["head_stats"]) == 4
    assert len(json.loads((cell / "profile_lserve.json").read_text())["head_scores"]) == 2
    again = run(cfg)[0]                                               # a complete cell is reloaded, not redone
    assert again["complete"] and again["flexicache"] == results[0]["flexicache"]

    from systems.base import GenerationRequest
    from systems.engine.engine import Engine
    engine = Engine(str(tiny_llama_dir), load_policy("flexicache", {"profile": str(cell / "profile_flexicache.json"),
                                                                    "budget": 32}),
                    SimpleNamespace(page_size=16, device_memory_gb=0.01, host_memory_gb=0.01), dtype="float32")
    seq = engine.generate([GenerationRequest("x", list(range(5, 200)), 4, ignore_eos=True)])[0]
    assert seq.kv_stats["unstable_heads"] == 1 and seq.kv_stats["profile"].endswith("profile_flexicache.json")

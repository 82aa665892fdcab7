"""DuoAttention-style gate profiler: samples, streaming mask, schedule, and a short training run on the tiny model."""
import json
import logging
import random

import torch
from hydra import compose, initialize_config_dir

from harness.experiments import duo_attention as duo
from harness.running.config import CONF_DIR
from harness.running.driver import run
from harness.running.schema import register

register()


def test_streaming_mask_keeps_sink_and_recent_tokens():
    mask = duo.streaming_mask(8, sink=2, recent=3)
    assert mask[7].tolist() == [True, True, False, False, False, True, True, True]
    assert mask[2].tolist() == [True, True, True] + [False] * 5           # causal
    assert not mask.triu(1).any()


def test_schedule_warms_up_holds_and_decays_with_a_floor():
    f = [duo.lr_factor(s, 100) for s in range(100)]
    assert f[0] == 0.1 and f[19] == 1.0 and f[50] == 1.0 and f[-1] == 0.1
    assert all(a <= b for a, b in zip(f[:20], f[1:20])) and all(a >= b for a, b in zip(f[80:], f[81:]))


def test_samples_put_passkeys_in_order_and_the_qa_block_last(tokenizer_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    p = {**duo.DEFAULTS, "passkeys": 3, "passkey_words": 4}
    hay = tok.encode("filler text. " * 400, add_special_tokens=False)
    ids, span = duo.sample_ids(tok, hay, 600, p, random.Random(0))
    text = tok.decode(ids)
    keys = [text.split(f"the {o} passkey to the vault: ")[1].split("\n")[0] for o in ("first", "second", "third")]
    assert all(len(k.split()) == 4 and set(k.split()) <= set(duo.NATO) for k in keys)
    assert text.index("first passkey to the vault: ") < text.index("second passkey to the vault: ")
    qa = tok.decode(ids[span])
    assert qa.startswith("Based on the content of the book, what is the first passkey")
    assert qa.rstrip().endswith(keys[2])
    assert span.stop == len(ids)


def test_gates_train_and_become_an_lserve_profile(tiny_llama_dir, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="kvharness")
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=[
            "+exp=duo_attention", f"model.path={tiny_llama_dir}", "model.name=tiny", f"results_dir={tmp_path}",
            "progress=false", "exp.params.steps=4", "exp.params.pool=2", "exp.params.lengths=2",
            "exp.params.context_min=120", "exp.params.context_max=160", "exp.params.sink_tokens=8",
            "exp.params.recent_tokens=16", "exp.params.passkeys=2", "exp.params.passkey_words=4"])
    torch.set_num_threads(1)
    (metrics,) = run(cfg)
    gates = torch.tensor(metrics["gates"])
    assert gates.shape == (2, 2) and bool((gates < 1).all()) and bool((gates >= 0).all())   # L1 pulls them down
    # the L1 term alone would move every gate alike: distinct gates show the distillation gradient reached them
    assert len(set(gates.flatten().tolist())) > 1
    assert "gate training: step 4/4" in caplog.text          # hours on a CPU: training reports its progress
    profile = json.loads((tmp_path / "duo_attention" / "profile_lserve.json").read_text())
    assert profile["kind"] == "lserve" and profile["head_scores"] == metrics["gates"]
    md = (tmp_path / "duo_attention" / "summary.md").read_text()
    assert "gates trained for 4 steps" in md and "streams 2 heads" in md
    from systems.policies import load_policy
    policy = load_policy("lserve", {"profile": str(tmp_path / "duo_attention" / "profile_lserve.json"),
                                    "budget": 64, "physical_page": 16, "sink_tokens": 16,
                                    "local_tokens": 32})
    assert policy.profile.endswith("profile_lserve.json")

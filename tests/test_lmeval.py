"""The lm-eval adapter runs a small generation task and a multiple-choice task offline on fixture data."""
import json

import pytest

lm_eval = pytest.importorskip("lm_eval")

GEN_TASK = """
task: kvh_fixture_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
"""

MC_TASK = """
task: kvh_fixture_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
"""


def _write(tmp_path):
    rows = [{"question": "What is 2 plus 2?", "answer": "4", "choices": [" 4", " 5"], "label": 0},
            {"question": "Name a color.", "answer": "red", "choices": [" red", " dog"], "label": 0},
            {"question": "Capital of France?", "answer": "Paris", "choices": [" Rome", " Paris"], "label": 1}]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "gen.yaml").write_text(GEN_TASK.format(data=data))
    (tmp_path / "mc.yaml").write_text(MC_TASK.format(data=data))
    return rows


def test_lmeval_generate_and_loglikelihood(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from harness.integrations.lmeval import KVHarnessLM
    from systems.base import GenerationRequest

    rows = _write(tmp_path)
    lm = KVHarnessLM(system="hf", model_path=str(tiny_llama_dir), dtype="float32", max_length=1024)
    out = simple_evaluate(model=lm, tasks=["kvh_fixture_gen", "kvh_fixture_mc"],
                          task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True)
    assert "exact_match,none" in out["results"]["kvh_fixture_gen"]
    assert "acc,none" in out["results"]["kvh_fixture_mc"]
    gen = out["samples"]["kvh_fixture_gen"]
    assert len(gen) == len(rows)
    # the adapter's answers are exactly what the system generates for the same prompt
    for s in gen:
        prompt = f"Question: {s['doc']['question']}\nAnswer:"
        ids = lm.tokenizer.encode(prompt, add_special_tokens=False)
        direct = lm.system.generate([GenerationRequest("d", ids, max_new_tokens=6, stop=("\n",))])[0].text
        assert s["resps"][0][0] == direct
    # loglikelihood: two choices per doc, finite log-probabilities
    mc = out["samples"]["kvh_fixture_mc"]
    assert all(len(s["resps"]) == 2 and all(r[0][0] < 0 for r in s["resps"]) for s in mc)


def test_loglikelihood_runs_under_the_policy(tiny_llama_dir):
    """Teacher forcing through the engine: dense equals HF's forward, a small StreamingLLM budget changes it; the
    standard lm-eval model arguments (device, batch sizes) are accepted, not taken for policy parameters."""
    from types import SimpleNamespace

    from harness.integrations.lmeval import KVHarnessLM

    req = SimpleNamespace(args=("one two three four five six seven " * 20, " eight nine ten"))
    common = dict(model_path=str(tiny_llama_dir), dtype="float32", max_length=1024, device="cpu",
                  batch_size="auto", max_batch_size=4)
    dense = KVHarnessLM(system="dense", **common)
    hf = KVHarnessLM(system="hf", **common)
    stream = KVHarnessLM(system="streaming", budget=16, **common)
    (d,), (h,), (s,) = (lm.loglikelihood([req]) for lm in (dense, hf, stream))
    assert d[0] == pytest.approx(h[0], abs=1e-3) and d[1] == h[1]
    assert abs(s[0] - d[0]) > 1e-3
    assert dense.kv_mode["loglikelihood"] == stream.kv_mode["loglikelihood"] == "physical"
    rolling = dense.loglikelihood_rolling([SimpleNamespace(args=("a b c d e f g",))])
    assert rolling[0] < 0


@pytest.mark.parametrize("entry", ["lm_eval", pytest.param("harness.integrations.lmeval", marks=pytest.mark.slow)])
def test_real_cli_runs_an_engine_policy(entry, tiny_llama_dir, tmp_path):
    """lm-eval's own CLI (`lm_eval`, found through the hook `make setup` installs) and `python -m
    harness.integrations.lmeval` run a local task YAML under an engine policy with lm-eval's standard arguments; the
    results record the KV mode."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from harness.integrations import lmeval_hook

    _write(tmp_path)
    bin_dir = Path(sys.executable).parent
    if entry == "lm_eval":
        site = [p for p in map(Path, __import__("site").getsitepackages()) if (p / lmeval_hook.PTH_NAME).is_file()]
        assert site, ("the lm-eval hook is not installed: run `make setup` (or python -m "
                      "harness.integrations.lmeval_hook)")
        cmd = [str(bin_dir / "lm_eval"), "run"]
    else:
        cmd = [sys.executable, "-m", "harness.integrations.lmeval", "run"]
    cmd += ["--model", "kvharness", "--model_args",
            f"system=streaming,budget=32,model_path={tiny_llama_dir},dtype=float32,max_length=1024",
            "--tasks", "kvh_fixture_gen,kvh_fixture_mc", "--include_path", str(tmp_path), "--device", "cpu",
            "--batch_size", "2", "--max_batch_size", "4", "--output_path", str(tmp_path / "out")]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = (tmp_path / "out").rglob("results_*.json")
    out = json.loads(result.read_text())
    assert "exact_match,none" in out["results"]["kvh_fixture_gen"] and "acc,none" in out["results"]["kvh_fixture_mc"]
    assert out["config"]["kv_mode"] == {"generate_until": "physical", "loglikelihood": "physical"}
    assert out["config"]["kv_system"] == "engine-streaming" and out["config"]["kv_params"]["budget"] == 32

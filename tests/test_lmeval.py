"""The lm-eval adapter: fixture tasks in-process, README's command through lm-eval's CLI, devices, result folders."""
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

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


ROOT = Path(__file__).resolve().parents[1]
FIXTURE_TASKS = "tests/fixtures/lmeval"        # kvh_tiny_mc (loglikelihood) and kvh_tiny_gen, relative to ROOT


def _cli(cmd: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    """An lm-eval command line from the repository root, importing this checkout (PYTHONPATH), offline."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)


def _readme_command() -> list[str]:
    """The `lm_eval run --model kvharness ...` command line exactly as README.md shows it."""
    text = (ROOT / "README.md").read_text()
    match = re.search(r"`(lm_eval run --model kvharness [^`]*)`", text)
    assert match, "README.md no longer shows an `lm_eval run --model kvharness ...` command"
    return shlex.split(match.group(1))


def test_readme_command_runs_on_this_machine(tmp_path):
    """README's command through lm-eval's own CLI (found through the hook `make setup` installs), with no --device:
    on a machine without CUDA it runs on the CPU; the results land in a folder named for the system and record the
    resolved dtype and device."""
    import torch

    from harness.integrations import lmeval_hook
    from harness.integrations.assets import cache_root
    from systems.hardware import dtype_name

    site = [p for p in map(Path, __import__("site").getsitepackages()) if (p / lmeval_hook.PTH_NAME).is_file()]
    assert site, "the lm-eval hook is not installed: run `make setup` (or python -m harness.integrations.lmeval_hook)"
    cmd = _readme_command()
    assert cmd[0] == "lm_eval" and cmd[-1] == "TASK" and "--device" not in cmd
    cmd = [str(Path(sys.executable).parent / "lm_eval"), *cmd[1:-1], "kvh_tiny_mc,kvh_tiny_gen",
           "--include_path", FIXTURE_TASKS, "--output_path", str(tmp_path / "out")]
    proc = _cli(cmd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = (tmp_path / "out").rglob("results_*.json")
    args = dict(kv.split("=") for kv in cmd[cmd.index("--model_args") + 1].split(","))
    model = (cache_root() / "smollm2-135m-instruct").name
    assert result.parent.name == f"{model}__{args['system']},budget={args['budget']}"
    out = json.loads(result.read_text())
    assert "acc,none" in out["results"]["kvh_tiny_mc"] and "exact_match,none" in out["results"]["kvh_tiny_gen"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert out["config"]["model_device"].startswith(device)
    assert out["config"]["model_dtype"] == dtype_name("auto", device) != "auto"
    assert out["config"]["kv_system"] == f"engine-{args['system']}"
    assert out["config"]["kv_mode"] == {"generate_until": "physical", "loglikelihood": "physical"}
    if device == "cpu":
        assert "lm-eval's default and this machine has no CUDA GPU: running on cpu" in proc.stderr


def test_module_entry_point_runs_an_engine_policy(tiny_llama_dir, tmp_path):
    """`python -m harness.integrations.lmeval run` with lm-eval's standard arguments and an explicit device; another
    system than the README's, so another folder."""
    cmd = [sys.executable, "-m", "harness.integrations.lmeval", "run", "--model", "kvharness", "--model_args",
           f"system=streaming,budget=32,model_path={tiny_llama_dir},dtype=float32,max_length=1024",
           "--tasks", "kvh_tiny_mc", "--include_path", FIXTURE_TASKS, "--device", "cpu",
           "--batch_size", "2", "--max_batch_size", "4", "--output_path", str(tmp_path / "out")]
    proc = _cli(cmd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = (tmp_path / "out").rglob("results_*.json")
    assert result.parent.name == f"{Path(tiny_llama_dir).name}__streaming,budget=32"
    out = json.loads(result.read_text())
    assert out["config"]["kv_mode"] == {"generate_until": "physical", "loglikelihood": "physical"}
    assert out["config"]["kv_system"] == "engine-streaming" and out["config"]["kv_params"]["budget"] == 32
    assert out["config"]["model_dtype"] == "float32" and out["config"]["model_device"] == "cpu"
    # the recorded model_args rerun the same system into the same folder
    assert out["config"]["model_args"]["model"] == f"{Path(tiny_llama_dir).name}/streaming,budget=32"


def test_each_system_gets_its_own_folder_name(tiny_llama_dir):
    """lm-eval names the folder from model_args (`pretrained`, then `model`); the adapter fills `model` per system
    and moves a `pretrained` path to `model_path`, so the recorded arguments still build the same model."""
    from harness.integrations.lmeval import KVHarnessLM

    names = []
    for args in ({"system": "dense", "pretrained": str(tiny_llama_dir)},
                 {"system": "streaming", "budget": 32, "model_path": str(tiny_llama_dir)},
                 {"system": "streaming", "budget": 64, "model_path": str(tiny_llama_dir), "sink_size": 2}):
        KVHarnessLM.create_from_arg_obj(args, {"device": "cpu", "batch_size": 1})
        assert "pretrained" not in args and args["model_path"] == str(tiny_llama_dir)
        names.append(args["model"])
    tiny = Path(tiny_llama_dir).name
    assert names == [f"{tiny}/dense", f"{tiny}/streaming,budget=32", f"{tiny}/streaming,budget=64,sink_size=2"]
    rebuilt = {"system": "streaming", "budget": 32, "model_path": str(tiny_llama_dir), "model": "mine"}
    KVHarnessLM.create_from_arg_obj(rebuilt, {"device": "cpu"})
    assert rebuilt["model"] == "mine"          # a name given by hand is kept


def test_device_follows_the_machine_only_for_lm_evals_default(monkeypatch, caplog):
    import torch

    from harness.integrations.lmeval import DeviceError, resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(None) is None and resolve_device("cpu") == "cpu"
    with caplog.at_level("WARNING", logger="kvharness.lmeval"):
        assert resolve_device("cuda:0") == "cpu"
    assert "running on cpu" in caplog.text
    for explicit in ("cuda", "cuda:1", "mps"):
        with pytest.raises(DeviceError, match=f"--device {explicit}"):
            resolve_device(explicit)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_explicit_cuda_without_cuda_is_one_line(tiny_llama_dir, capsys, monkeypatch):
    """Both CLIs print the adapter's argument errors as one line: `python -m harness.integrations.lmeval` (run
    in-process here) and lm-eval's own CLI through the hook's excepthook."""
    from harness.integrations import lmeval, lmeval_hook

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(ROOT)
    code = lmeval.main(["run", "--model", "kvharness", "--model_args", f"system=dense,model_path={tiny_llama_dir}",
                        "--device", "cuda", "--tasks", "kvh_tiny_mc", "--include_path", FIXTURE_TASKS])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: --device cuda: this machine has no CUDA GPU")
    assert "Traceback" not in "\n".join(err)
    lmeval_hook.excepthook(lmeval.DeviceError, lmeval.DeviceError("--device cuda: no GPU"), None)
    assert capsys.readouterr().err == "error: --device cuda: no GPU\n"
    try:
        raise RuntimeError("a bug")
    except RuntimeError as exc:
        lmeval_hook.excepthook(RuntimeError, exc, exc.__traceback__)
    assert "Traceback" in capsys.readouterr().err

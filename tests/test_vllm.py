"""The vLLM system: greedy parity with HF transformers on a tiny random Llama, KV accounting, missing-package errors."""
from __future__ import annotations

import builtins
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 10], [1, 40, 41, 42, 43, 44, 45, 46, 47], [1, 200]]
NEW_TOKENS = 12


def _tiny_llama(path: Path) -> Path:
    """2 layers, head_dim 64 (a size vLLM's CPU attention supports), a 256-word WordLevel tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(253)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
    torch.manual_seed(0)
    # A wide init keeps top-1 logits well apart, so fp32 kernel differences cannot flip an argmax.
    cfg = LlamaConfig(vocab_size=len(words), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, initializer_range=0.1)
    LlamaForCausalLM(cfg).eval().save_pretrained(path)
    return path


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()


# The engine process is spawned, so the system runs in a script with the __main__ guard.
_RUN_VLLM = textwrap.dedent("""
    import json, sys
    from systems.base import GenerationRequest
    from systems.vllm import VLLMSystem

    if __name__ == "__main__":
        model_dir, prompts, n, stop = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
        reqs = [GenerationRequest(f"r{i}", p, n, ignore_eos=True) for i, p in enumerate(prompts)]
        reqs.append(GenerationRequest("stop", prompts[0], n, ignore_eos=True, stop=(stop,)))
        with VLLMSystem(model_dir, dtype="float32", max_model_len=256, kv_cache_space_gb=0.25,
                        max_num_seqs=8) as system:
            outs = system.generate(reqs)
            mem = system.memory_report()
        print("RESULT " + json.dumps({"outs": [c.__dict__ for c in outs], "mem": mem.as_dict(),
                                      "ttft": [c.ttft for c in outs]}))
""")


@pytest.mark.slow  # ~30 s of CPU, 70 s wall on the shared 2 cores: three processes each import torch and vLLM
def test_vllm_greedy_equals_hf_fp32(tmp_path):
    pytest.importorskip("vllm")
    model_dir = _tiny_llama(tmp_path / "tiny")
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ref = [_hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    stop_word = f"w{ref[0][3] - 3}"  # the WordLevel word of the 4th greedy token of prompt 0
    script = tmp_path / "run_vllm.py"
    script.write_text(_RUN_VLLM)
    env = dict(os.environ, PYTHONPATH=str(REPO), VLLM_LOGGING_LEVEL="WARNING")
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_space_gb
    proc = subprocess.run([sys.executable, str(script), str(model_dir), json.dumps(PROMPTS), str(NEW_TOKENS),
                           stop_word], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(line[len("RESULT "):])
    outs, mem = result["outs"], result["mem"]

    for out, expected, prompt in zip(outs, ref, PROMPTS):
        assert out["token_ids"] == expected
        assert out["output_tokens"] == NEW_TOKENS == len(out["token_times"])
        assert out["prompt_tokens"] == len(prompt) and out["finish_reason"] == "length"
        assert out["text"].split() == [f"w{t - 3}" for t in expected]
        assert all(b >= a for a, b in zip(out["token_times"], out["token_times"][1:]))
        assert out["kv_stats"]["engine_ttft_s"] > 0
    assert all(t is not None and t > 0 for t in result["ttft"])

    stopped = outs[-1]
    assert stopped["finish_reason"] == "stop" and stop_word not in stopped["text"].split()
    assert stopped["token_ids"] == ref[0][:len(stopped["token_ids"])]

    # Five requests of < 128 tokens run together: one 128-token block each at the peak.
    extra = mem["extra"]
    assert extra["bytes_per_block"] == 2 * 2 * 1 * 64 * extra["block_size"] * 4  # K+V, layers, kv heads, fp32
    assert mem["device_kv_capacity_bytes"] == extra["num_blocks"] * extra["bytes_per_block"] == 2**28
    assert mem["device_kv_peak_bytes"] == len(outs) * extra["bytes_per_block"]


def test_missing_vllm_names_the_fix(tmp_path, monkeypatch):
    import systems.vllm as vllm_system

    (tmp_path / "config.json").write_text("{}")
    real_import = builtins.__import__

    def no_vllm(name, *args, **kwargs):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("No module named 'vllm'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_vllm)
    with pytest.raises(ImportError, match="make setup-vllm"):
        vllm_system.VLLMSystem(tmp_path)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(ImportError, match="make setup-vllm"):
        vllm_system.serve(tmp_path, port=18999)


def test_bad_model_dir_fails_before_import(tmp_path):
    from systems.vllm import VLLMSystem, serve
    with pytest.raises(FileNotFoundError, match="config.json"):
        VLLMSystem(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="config.json"):
        serve(tmp_path, port=18999)


def test_serve_spins_as_the_engine_server_does(tmp_path, monkeypatch):
    """`vllm serve` gets libgomp's default spin count, the engine server's, not the short one this process carries."""
    import systems.vllm as vllm_system
    from systems import SERVER_SPIN_COUNT

    (tmp_path / "config.json").write_text("{}")
    seen = {}

    def popen(cmd, env, **kwargs):
        seen.update(env)
        raise RuntimeError("stop here")
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object())
    monkeypatch.setattr(vllm_system.subprocess, "Popen", popen)
    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")
    with pytest.raises(RuntimeError, match="stop here"):
        vllm_system.serve(tmp_path, port=18999, log_path=tmp_path / "serve.log")
    assert seen["GOMP_SPINCOUNT"] == str(SERVER_SPIN_COUNT) == "300000"


@pytest.mark.slow  # a `vllm serve` start-up: one to two minutes on the shared 2 cores
def test_serve_answers_completions_and_closes(tmp_path):
    pytest.importorskip("vllm")
    import urllib.request

    from systems.vllm import serve

    model_dir = _tiny_llama(tmp_path / "tiny")
    from transformers import AutoModelForCausalLM
    expected = _hf_greedy(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(),
                          PROMPTS[0], NEW_TOKENS)
    with socket.socket() as probe:  # a free loopback port: other servers may be running on this machine
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with serve(model_dir, port=port, dtype="float32", max_model_len=256, kv_cache_space_gb=0.25,
               served_model_name="tiny", log_path=tmp_path / "serve.log") as server:
        body = json.dumps({"model": "tiny", "prompt": PROMPTS[0], "max_tokens": NEW_TOKENS, "temperature": 0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(server.url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            answer = json.loads(resp.read())
        group = server.process.pid
    assert answer["usage"]["completion_tokens"] == NEW_TOKENS
    assert answer["choices"][0]["text"].split() == [f"w{t - 3}" for t in expected]
    with pytest.raises(ProcessLookupError):  # close() left no process of the server's group behind
        os.killpg(group, 0)

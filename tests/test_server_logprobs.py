"""`logprobs` and `echo` on /v1/completions: vLLM's shape, the model's numbers, lm-eval's local-completions on top."""
from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
ENGINE = SimpleNamespace(device_memory_gb=0.01, host_memory_gb=0.01, max_num_seqs=2, page_size=16)
PROMPT = "The quick brown fox jumps over the lazy dog because"


def _serve(model_dir, policy: str = "dense", params: dict | None = None, **engine):
    from systems.engine.system import EngineSystem
    from systems.openai_server import start_in_thread

    system = EngineSystem(str(model_dir), policy, params or {}, engine=SimpleNamespace(**{**vars(ENGINE), **engine}),
                          dtype="float32")
    return system, start_in_thread(system, "tiny")


@pytest.fixture(scope="module")
def dense(tiny_llama_dir):
    system, server = _serve(tiny_llama_dir)
    yield system, server
    server.close()


def _post(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json={"model": "tiny", **body}, timeout=60)


def _reference(model_dir, ids: list[int]) -> torch.Tensor:
    """HF transformers' log-softmax at every position of `ids` (fp32): what prompt scoring must reproduce."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def test_echo_scores_the_prompt_as_the_model_does(dense, tiny_llama_dir):
    system, server = dense
    ids = system.tokenizer.encode(PROMPT)
    ref = _reference(tiny_llama_dir, ids)
    body = _post(server, prompt=PROMPT, max_tokens=0, echo=True, logprobs=3).json()
    (choice,) = body["choices"]
    lp = choice["logprobs"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    assert lp["tokens"] == system.tokenizer.batch_decode([[t] for t in ids])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None      # nothing predicts the first token
    want = ref[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert lp["token_logprobs"][1:] == pytest.approx(want.tolist(), abs=1e-4)
    for pos, top in enumerate(lp["top_logprobs"][1:]):
        # the token itself and the 3 most likely ones, by text
        vals, best = ref[pos].topk(3)
        expect = {system.tokenizer.decode([int(t)]): float(v) for t, v in zip(best, vals)}
        assert {k: top[k] for k in expect} == pytest.approx(expect, abs=1e-4) and len(top) <= 4
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(ids))]


def test_echo_with_generation_and_logprobs_without_echo(dense):
    """max_tokens 1 (what lm-eval sends): the prompt's entries then the generated token's; without echo only the
    generated tokens, whose greedy choice is their own top-1."""
    system, server = dense
    ids = system.tokenizer.encode(PROMPT)
    echoed = _post(server, prompt=[ids], max_tokens=1, echo=True, logprobs=1, temperature=0).json()["choices"][0]
    plain = _post(server, prompt=ids, max_tokens=4, logprobs=2, temperature=0,
                  ignore_eos=True).json()["choices"][0]
    assert len(echoed["logprobs"]["tokens"]) == len(ids) + 1
    assert echoed["text"].startswith(system.tokenizer.decode(ids))         # token-id prompts echo decoded
    assert echoed["logprobs"]["token_logprobs"][-1] == pytest.approx(plain["logprobs"]["token_logprobs"][0],
                                                                        abs=1e-5)
    lp = plain["logprobs"]
    assert len(lp["tokens"]) == 4 and "".join(lp["tokens"]) == plain["text"]
    for own, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
        assert own == pytest.approx(max(top.values())) and len(top) <= 3
    assert lp["text_offset"] == [0, *[sum(map(len, lp["tokens"][:i])) for i in range(1, 4)]]


def test_streamed_logprobs_join_to_the_non_streamed_ones(dense):
    system, server = dense
    body = {"prompt": PROMPT, "max_tokens": 3, "echo": True, "logprobs": 2, "temperature": 0, "ignore_eos": True}
    whole = _post(server, **body).json()["choices"][0]
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    chunks = [e["choices"][0] for e in events]
    assert len(chunks) == 3 and chunks[0]["text"].startswith(PROMPT)
    assert "".join(c["text"] for c in chunks) == whole["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for c in chunks for x in c["logprobs"][key]] == whole["logprobs"][key]


@pytest.mark.parametrize("body, param", [
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": "2"}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"echo": "yes"}, "echo"),
    ({"echo": 1}, "echo"),
    ({"max_tokens": 0}, "max_tokens"),                    # 0 only with echo
    ({"max_tokens": -1, "echo": True}, "max_tokens"),
    ({"prompt_logprobs": 2}, "prompt_logprobs"),          # vLLM's own field: refused, not silently ignored
])
def test_bad_logprobs_fields_get_400_naming_the_field(dense, body, param):
    resp = _post(dense[1], prompt="x", **body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param and body and str(next(iter(body))) in resp.json()["error"]["message"]


def test_chat_keeps_refusing_logprobs(dense):
    resp = httpx.post(dense[1].url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "max_tokens": 2})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "logprobs"


def test_prompt_scores_come_from_the_prefill_before_any_eviction(dense, tiny_llama_dir):
    """Under StreamingLLM with a 16-token budget the echoed prompt's log-probabilities are the dense ones (the prefill
    attends to the whole prompt), while the generated tokens are decoded under the policy and differ."""
    _, server = dense
    system, stream = _serve(tiny_llama_dir, "streaming", {"budget": 16, "sink_size": 4})
    try:
        ids = system.tokenizer.encode(PROMPT * 6)
        body = {"prompt": ids, "max_tokens": 4, "echo": True, "logprobs": 1, "temperature": 0, "ignore_eos": True}
        full, evicted = (_post(s, **body).json()["choices"][0]["logprobs"]["token_logprobs"] for s in (server, stream))
    finally:
        stream.close()
    n = len(ids)
    assert evicted[:n] == pytest.approx(full[:n], abs=1e-5)
    assert max(abs(a - b) for a, b in zip(evicted[n + 1:], full[n + 1:])) > 1e-3


def test_lm_eval_local_completions_scores_through_the_server(dense, tiny_llama_dir, monkeypatch):
    """lm-eval's local-completions (tokenized requests, echo + logprobs + max_tokens 1) against the live server on
    127.0.0.1: the same per-request log-likelihoods as the adapter's teacher forcing on the dense engine."""
    from importlib.util import find_spec

    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from harness.integrations.lmeval import KVHarnessLM

    assert find_spec("tenacity"), "lm-eval's API models need lm_eval[api] (tenacity): run `make setup`"

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(ROOT)                       # the fixture task's data path is relative to the repository
    tasks = TaskManager(include_path=str(ROOT / "tests/fixtures/lmeval"))
    served = simple_evaluate(model="local-completions", tasks=["kvh_tiny_mc"], task_manager=tasks, log_samples=True,
                             model_args={"model": "tiny", "base_url": dense[1].url + "/v1/completions",
                                         "tokenizer": str(tiny_llama_dir), "tokenized_requests": True})
    adapter = KVHarnessLM(system="dense", model_path=str(tiny_llama_dir), dtype="float32", max_length=1024)
    direct = simple_evaluate(model=adapter, tasks=["kvh_tiny_mc"], task_manager=tasks, log_samples=True)

    def scores(out: dict) -> list[tuple[float, bool]]:
        return [tuple(r[0]) for s in sorted(out["samples"]["kvh_tiny_mc"], key=lambda s: s["doc_id"])
                for r in s["resps"]]

    got, want = scores(served), scores(direct)
    assert len(got) == 6 and all(math.isfinite(ll) and ll < 0 for ll, _ in got)
    assert [ll for ll, _ in got] == pytest.approx([ll for ll, _ in want], abs=1e-4)
    assert [greedy for _, greedy in got] == [greedy for _, greedy in want]
    assert served["results"]["kvh_tiny_mc"]["acc,none"] == direct["results"]["kvh_tiny_mc"]["acc,none"]


@pytest.mark.parametrize("name", ["dense", "quest"])
def test_engine_scores_prompts_across_chunks_and_preemption(tiny_llama_dir, name):
    """GenerationRequest.prompt_logprobs: in 24-token chunks beside decodes, in a pool tight enough to preempt (the
    prompt is prefilled again), every prompt position is scored once, as HF's forward scores it."""
    from dataclasses import replace

    from test_chunked_prefill import _engine, _requests

    engine = _engine(tiny_llama_dir, name, chunked=True, budget=24, blocks=160)
    reqs = [replace(r, prompt_logprobs=2, max_new_tokens=40) for r in _requests()]
    seqs = []
    for req in reqs:               # one arrival per step: later prompts need the blocks earlier decodes grow into
        seqs.append(engine.add_request(req))
        engine.step()
    engine.run()
    if name == "dense":
        assert engine.scheduler.num_preemptions > 0
    for req, seq in zip(reqs, seqs):
        ids = req.prompt_token_ids
        ref = _reference(tiny_llama_dir, ids)[:-1]
        assert len(seq.prompt_logprobs) == len(ids) - 1
        own = [e[0] for e in seq.prompt_logprobs]
        assert own == pytest.approx(ref.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist(), abs=1e-4)
        assert [e[1] for e in seq.prompt_logprobs] == ref.topk(2, -1).indices.tolist()

"""lm-evaluation-harness adapter: any lm-eval generation task under any kvharness system and KV policy.

    python -m harness.lmeval --model kvharness --model_args system=flexicache,budget=512 --tasks TASK ...

lm-eval 0.4.13 discovers models only from its own mapping, so this module registers `kvharness` and then hands
the command line to lm-eval's own CLI (programmatic use: `lm_eval.simple_evaluate(model=KVHarnessLM(...))`).

`generate_until` runs through the chosen system, so prefill compression and decode-time selection apply. Prompts
longer than `max_length - max_gen_toks` are middle-truncated (LongBench's rule) instead of lm-eval's left
truncation, which would cut the instruction. `loglikelihood` is a dense forward pass of the same weights: a KV
policy acts at the prefill/decode boundary and cannot change a single forward over context + continuation
(benchmarks.md §6.3), so those scores are labelled dense in `kv_mode`.
"""
from __future__ import annotations

import sys
from typing import Any

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from harness.assets import model_dir as resolve_model_dir
from harness.prompts import truncate_middle
from harness.runner import apply_budget, load_group
from harness.schema import ModelConfig, SystemConfig
from systems.base import GenerationRequest
from systems.registry import build_system


@register_model("kvharness")
class KVHarnessLM(LM):
    def __init__(self, system: str = "dense", model_path: str | None = None, dtype: str = "auto",
                 budget: int | None = None, max_length: int = 8192, max_gen_toks: int = 256,
                 batch_size: int | str = 8, **policy_params: Any):
        super().__init__()
        from transformers import AutoTokenizer

        self.model_dir = resolve_model_dir(model_path)
        self.system_cfg = load_group("system", system, SystemConfig)
        if budget is not None:
            apply_budget(self.system_cfg, int(budget))
        for k, v in policy_params.items():
            self.system_cfg.params[k] = v
        self.system_cfg.batch_size = int(batch_size) if str(batch_size).isdigit() else self.system_cfg.batch_size
        self.model_cfg = ModelConfig(path=str(self.model_dir), dtype=dtype, max_model_len=int(max_length))
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.max_length, self.max_gen_toks = int(max_length), int(max_gen_toks)
        self.system = build_system(self.system_cfg, self.model_dir, self.model_cfg)
        self._scorer = None
        self.kv_mode = {"generate_until": getattr(self.system, "mode", "physical"), "loglikelihood": "dense"}

    # -- chat support (lm-eval's --apply_chat_template) -------------------------------------------------
    @property
    def tokenizer_name(self) -> str:
        return str(self.model_dir)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.tokenizer.chat_template

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    # -- generation through the KV policy ---------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        reqs = []
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            gen_kwargs = dict(gen_kwargs or {})
            until = gen_kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(gen_kwargs.pop("max_gen_toks", self.max_gen_toks))
            temperature = float(gen_kwargs.pop("temperature", 0.0) or 0.0)
            if not gen_kwargs.pop("do_sample", False):
                temperature = 0.0
            ids = self.tokenizer.encode(context, add_special_tokens=False)
            ids = truncate_middle(ids, self.max_length - max_new)
            reqs.append(GenerationRequest(request_id=f"lm{i}", prompt_token_ids=ids, max_new_tokens=max_new,
                                          temperature=temperature, top_p=float(gen_kwargs.pop("top_p", 1.0)),
                                          stop=tuple(until)))
        return [c.text for c in self.system.generate(reqs)]

    # -- scoring: a dense forward of the same weights ---------------------------------------------------
    def _model(self):
        if self._scorer is None:
            from transformers import AutoModelForCausalLM

            from systems.hf import resolve_dtype
            self._scorer = AutoModelForCausalLM.from_pretrained(
                self.model_dir, dtype=resolve_dtype(self.model_cfg.dtype)).eval()
        return self._scorer

    @torch.inference_mode()
    def _logprob(self, context_ids: list[int], cont_ids: list[int]) -> tuple[float, bool]:
        ids = (context_ids + cont_ids)[-self.max_length:]
        n = len(cont_ids)
        logits = self._model()(torch.tensor([ids])).logits[0, -n - 1:-1].float()
        logp = torch.log_softmax(logits, -1)
        target = torch.tensor(cont_ids)
        total = float(logp.gather(1, target[:, None]).sum())
        greedy = bool((logp.argmax(-1) == target).all())
        return total, greedy

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        out = []
        for req in requests:
            context, continuation = req.args
            whole = self.tokenizer.encode(context + continuation, add_special_tokens=False)
            ctx = self.tokenizer.encode(context, add_special_tokens=False)
            cont = whole[len(ctx):] or self.tokenizer.encode(continuation, add_special_tokens=False)
            bos = [self.tokenizer.bos_token_id] if not ctx and self.tokenizer.bos_token_id is not None else []
            out.append(self._logprob(bos + whole[:len(whole) - len(cont)], cont))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for req in requests:
            (text,) = req.args
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            bos = [self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else ids[0]]
            total, start = 0.0, 0
            while start < len(ids):  # windows of max_length, each conditioned on what precedes it
                chunk = ids[start:start + self.max_length - 1]
                prefix = (bos + ids[:start])[-(self.max_length - len(chunk)):]
                total += self._logprob(prefix, chunk)[0]
                start += len(chunk)
            out.append(total)
        return out


def main(argv: list[str] | None = None) -> None:
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm_eval", *(argv if argv is not None else sys.argv[1:])]
    cli_evaluate()


if __name__ == "__main__":
    main()

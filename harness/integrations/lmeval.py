"""lm-evaluation-harness adapter: any lm-eval task under any kvharness system and KV policy.

    lm_eval run --model kvharness --model_args system=flexicache,budget=512 --tasks TASK ...
    python -m harness.integrations.lmeval run --model kvharness --model_args system=flexicache,budget=512 ...

`lm_eval` finds `kvharness` through the start-up hook `make setup` installs (lmeval_hook.py: lm-eval 0.4 reads no
entry points); `python -m harness.integrations.lmeval` imports the adapter and hands its command line to lm-eval's CLI
(programmatic use: `lm_eval.simple_evaluate(model=KVHarnessLM(...))`). The results' config records the system, its
policy parameters and the KV mode of each request kind. A bad model argument (unknown system, a device the machine
lacks, a model folder without config.json) is one line on stderr from either CLI, not a traceback.

Both request kinds run through the chosen system, so the KV policy acts on every number:
- `generate_until` generates; prompts longer than `max_length - max_gen_toks` are middle-truncated (LongBench's rule)
  instead of lm-eval's left truncation, which would cut the instruction.
- `loglikelihood` teacher-forces the continuation after the context: the policy prefills the context (evicting,
  offloading) and then decodes the continuation token by token exactly as when generating, and the log-probabilities
  of the forced tokens are summed; `is_greedy` says whether every forced token was the system's own argmax. Systems
  without teacher forcing (vLLM) fall back to a dense HF forward, and `kv_mode` says so.

Model arguments: `system` (a conf/system name), `budget` (shared token budget), any policy hyperparameter, plus
lm-eval's standard `device`, `batch_size` (an integer or `auto`), `max_batch_size`, `max_length`, `max_gen_toks`,
`dtype`, `model_path` (or lm-eval's usual `pretrained`: a local HF folder; default the embedded SmolLM2) and `model`.

Device: lm-eval fills `--device` with `cuda:0` when the user gives none, so on a machine without CUDA that value
means "the default" and the run follows the machine (CPU, with a warning), as lm-eval's own `hf` model does; any
other device is honoured, and one the machine lacks (`--device cuda` without CUDA) is a one-line error.

Results folder: lm-eval files a run under `<output_path>/<name>/`, the name taken from model_args (`pretrained`,
else `model`, ...). The adapter sets `model` to `<model folder>/<system>[,budget=..,param=..]` (sanitized by lm-eval
to `smollm2-135m-instruct__flexicache,budget=512`), so each system and budget gets its own folder; a `pretrained`
path moves to `model_path`, which the adapter reads the same way. The recorded model_args therefore rerun the same
system into the same folder, and `model=NAME` picks a folder name by hand. `get_model_info` records the device and
dtype the system resolved (`auto` becomes `bfloat16` or `float32`).
"""
from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

import lm_eval.models  # noqa: F401  (lm-eval fills its registry with its own models only while the registry is empty)
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from harness.integrations.assets import AssetError
from harness.integrations.assets import model_dir as resolve_model_dir
from harness.running.config import UserError
from harness.running.grid import apply_budget, system_config
from harness.running.prompts import truncate_middle
from harness.running.schema import ModelConfig
from systems.base import Completion, GenerationRequest
from systems.registry import SystemConfigError, build_system
from tasks.base import chat_template_kwargs

log = logging.getLogger("kvharness.lmeval")
LM_EVAL_ARGS = ("max_batch_size", "trust_remote_code", "parallelize", "backend")
# lm-eval's EvaluatorConfig default for --device: the adapter cannot tell it from a typed `cuda:0`, so (like lm-eval's
# own hf model) it reads it as "no device asked for" on a machine without that GPU
LM_EVAL_DEFAULT_DEVICE = "cuda:0"


class DeviceError(ValueError):
    """A --device this machine does not have."""


def resolve_device(device: str | None) -> str | None:
    """lm-eval's `device` -> the device the system runs on (None: the system's default, CUDA when available)."""
    import torch

    if device is None or str(device).strip().lower() in ("", "auto"):
        return None
    name = str(device).strip().lower()
    if name == "cpu":
        return "cpu"
    if not name.startswith("cuda"):
        raise DeviceError(f"--device {device}: kvharness systems run on cpu or cuda[:N]; pass one of those")
    if not torch.cuda.is_available():
        if name == LM_EVAL_DEFAULT_DEVICE:
            log.warning("--device %s is lm-eval's default and this machine has no CUDA GPU: running on cpu "
                        "(pass --device cpu to say so)", device)
            return "cpu"
        raise DeviceError(f"--device {device}: this machine has no CUDA GPU (torch {torch.__version__}); "
                          "pass --device cpu or leave --device out")
    try:
        index = torch.device(name).index
    except RuntimeError:
        raise DeviceError(f"--device {device} is not a device name; pass cpu, cuda or cuda:N") from None
    count = torch.cuda.device_count()
    if index is not None and index >= count:
        raise DeviceError(f"--device {device}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}")
    return name


def one_line_error(exc: BaseException) -> str | None:
    """The message of an error a user fixes in their command line (printed as one line by both CLIs), else None."""
    return str(exc) if isinstance(exc, (DeviceError, UserError, AssetError, SystemConfigError)) else None


@register_model("kvharness")
class KVHarnessLM(LM):
    def __init__(self, system: str = "dense", model_path: str | None = None, dtype: str = "auto",
                 budget: int | None = None, max_length: int = 8192, max_gen_toks: int = 256,
                 batch_size: int | str = 8, device: str | None = None, max_batch_size: int | None = None,
                 pretrained: str | None = None, model: str | None = None, **policy_params: Any):
        super().__init__()
        from transformers import AutoTokenizer

        for key in LM_EVAL_ARGS:           # lm-eval passes these to every model; none is a policy parameter
            policy_params.pop(key, None)
        if pretrained is not None and model_path is not None and str(pretrained) != str(model_path):
            raise UserError(f"pretrained={pretrained} and model_path={model_path} name two models; pass one of them")
        self.run_device = resolve_device(device)
        self.model_dir = resolve_model_dir(model_path if model_path is not None else pretrained)
        self.system_cfg = system_config(system)
        if budget is not None:
            apply_budget(self.system_cfg, int(budget))
        for k, v in policy_params.items():
            self.system_cfg.params[k] = v
        # the folder lm-eval files this run under: the model, the system and what the user set on it
        chosen = ([f"budget={budget}"] if budget is not None else []) + [f"{k}={v}" for k, v in policy_params.items()]
        self.results_name = str(model) if model else f"{self.model_dir.name}/{','.join([system, *chosen])}"
        size = int(batch_size) if str(batch_size).isdigit() else self.system_cfg.batch_size   # "auto": the config's
        if max_batch_size:
            size = min(size, int(max_batch_size))
        self.system_cfg.batch_size = size
        self.model_cfg = ModelConfig(path=str(self.model_dir), dtype=dtype, max_model_len=int(max_length))
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.max_length, self.max_gen_toks = int(max_length), int(max_gen_toks)
        self.system = build_system(self.system_cfg, self.model_dir, self.model_cfg, device=self.run_device)
        self._scorer: Any = None       # the dense HF model, loaded once for systems without teacher forcing
        forcing = bool(getattr(self.system, "supports_forced_decoding", False))
        mode = getattr(self.system, "mode", "physical")
        self.kv_mode = {"generate_until": mode, "loglikelihood": mode if forcing else "dense (HF forward)"}

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict[str, Any] | None = None
                            ) -> KVHarnessLM:
        """lm-eval's CLI builds the model from its model_args dict and then names the output folder from that same
        dict (`pretrained`, else `model`): give it this run's name, so each system gets its own folder."""
        lm = super().create_from_arg_obj(arg_dict, additional_config)
        if "pretrained" in arg_dict:
            arg_dict.setdefault("model_path", arg_dict.pop("pretrained"))
        arg_dict["model"] = lm.results_name
        return lm

    def _resolved(self, attr: str) -> str | None:
        """The system's own device or dtype (the engine's when it has one), as a plain name."""
        owner = getattr(self.system, "engine", self.system)
        value = getattr(owner, attr, None)
        return None if value is None else str(value).removeprefix("torch.")

    def get_model_info(self) -> dict[str, Any]:
        """Added to lm-eval's results["config"]: which system and policy made the numbers, whether the policy
        acted on each request kind, and the dtype and device the system resolved."""
        from omegaconf import OmegaConf

        return {"kv_system": self.system_cfg.name, "kv_policy": self.system_cfg.policy,
                "kv_params": OmegaConf.to_container(self.system_cfg.params, resolve=True), "kv_mode": self.kv_mode,
                "model_path": str(self.model_dir), "model_dtype": self._resolved("dtype") or self.model_cfg.dtype,
                "model_device": self._resolved("device") or self.run_device or "cpu",
                "results_name": self.results_name}

    # -- chat support (lm-eval's --apply_chat_template) -------------------------------------------------
    @property
    def tokenizer_name(self) -> str:
        return str(self.model_dir)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.tokenizer.chat_template

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  **chat_template_kwargs(self.tokenizer))

    # -- generation through the KV policy ---------------------------------------------------------------
    def generate_until(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[str]:
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
        return self._generate(reqs, lambda c: c.text)

    def _generate(self, reqs: list[GenerationRequest], take: Callable[[Completion], Any]) -> list:
        out = []
        size = max(1, self.system_cfg.batch_size)
        for start in range(0, len(reqs), size):
            out += [take(c) for c in self.system.generate(reqs[start:start + size])]
        return out

    # -- scoring: teacher forcing through the same system ------------------------------------------------
    def _bos(self) -> list[int]:
        bos = self.tokenizer.bos_token_id
        return [bos if bos is not None else (self.tokenizer.eos_token_id or 0)]

    def _forced(self, items: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(context ids, continuation ids) -> (sum of log p of the continuation, every token the argmax)."""
        if not getattr(self.system, "supports_forced_decoding", False):
            return [self._dense_logprob(ctx, cont) for ctx, cont in items]
        reqs = []
        for i, (ctx, cont) in enumerate(items):
            ctx = (ctx or self._bos())[-(self.max_length - len(cont)):]
            reqs.append(GenerationRequest(request_id=f"ll{i}", prompt_token_ids=ctx, max_new_tokens=len(cont),
                                          forced_output_ids=tuple(cont), ignore_eos=True))
        return self._generate(reqs, lambda c: (float(sum(c.token_logprobs)),
                                               list(c.argmax_ids) == list(c.token_ids)))

    def _dense_logprob(self, context_ids: list[int], cont_ids: list[int]) -> tuple[float, bool]:
        import torch

        if self._scorer is None:
            from transformers import AutoModelForCausalLM

            from systems.hardware import resolve_dtype
            device = self.run_device or "cpu"
            self._scorer = AutoModelForCausalLM.from_pretrained(
                self.model_dir, dtype=resolve_dtype(self.model_cfg.dtype, device)).to(device).eval()
        ids = ((context_ids or self._bos()) + cont_ids)[-self.max_length:]
        n = len(cont_ids)
        with torch.inference_mode():
            logits = self._scorer(torch.tensor([ids], device=self._scorer.device)).logits[0, -n - 1:-1].float().cpu()
        logp = torch.log_softmax(logits, -1)
        target = torch.tensor(cont_ids)
        return float(logp.gather(1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all())

    def loglikelihood(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        items = []
        for req in requests:
            context, continuation = req.args
            whole = self.tokenizer.encode(context + continuation, add_special_tokens=False)
            ctx = self.tokenizer.encode(context, add_special_tokens=False)
            cont = whole[len(ctx):] or self.tokenizer.encode(continuation, add_special_tokens=False)
            items.append((whole[:len(whole) - len(cont)], cont))
        return self._forced(items)

    def loglikelihood_rolling(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[float]:
        out = []
        for req in requests:
            (text,) = req.args
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            windows, start = [], 0
            while start < len(ids):  # windows of max_length, each conditioned on what precedes it
                chunk = ids[start:start + self.max_length - 1]
                windows.append(((self._bos() + ids[:start])[-(self.max_length - len(chunk)):], chunk))
                start += len(chunk)
            out.append(sum(ll for ll, _ in self._forced(windows)))
        return out


def main(argv: list[str] | None = None) -> int:
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm_eval", *(argv if argv is not None else sys.argv[1:])]
    try:
        cli_evaluate()
    except Exception as exc:
        message = one_line_error(exc)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

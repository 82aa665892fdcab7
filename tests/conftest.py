"""Shared fixtures: tiny random-weight models (with the embedded model's tokenizer) built in the tests."""
from __future__ import annotations

import sys

import absl.logging
import pytest
import torch

torch.set_num_threads(1)  # tiny models: threads only add contention on a shared 2-core machine
# rouge-score imports absl, whose log handler keeps the sys.stderr of the moment it was made and closes it when
# logging is reconfigured (Hydra does, in-process) unless it is the process's own: under pytest that is a test's
# capture, and closing it loses every later test's output. Give it the process's own stderr.
absl.logging.get_absl_handler().python_handler.stream = sys.__stderr__


@pytest.fixture(scope="session")
def tokenizer_dir():
    """The embedded SmolLM2 folder; only its tokenizer files are used by tiny-model tests."""
    from harness.integrations.assets import prepare
    return prepare(progress=False)


def _save_tiny(path, config, tokenizer_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tokenizer_dir):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), tokenizer_dir)


def save_tiny_llama(path, tokenizer_dir, num_layers: int = 2):
    """The tiny Llama's checkpoint (random weights, seed 0) with `num_layers` layers, in `path`."""
    from transformers import LlamaConfig
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    return _save_tiny(path, cfg, tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, tokenizer_dir):
    from transformers import Qwen2Config
    cfg = Qwen2Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    return _save_tiny(tmp_path_factory.mktemp("tiny_qwen2"), cfg, tokenizer_dir)

"""The Gemma 3 GGUF conversion on a tiny synthetic GGUF the test writes itself: HF names, (1 + w) norms undone, quant
types dequantized, config from metadata, tokenizer with <bos> that round-trips; the embedded asset prepared lazily,
verified and cached from chunk packages."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from harness.integrations import assets
from harness.integrations.gguf_gemma3 import GGUFError, hf_name
from tasks.base import chat_prompt_ids

LAYERS, HIDDEN, HEADS, HEAD_DIM, FFN = 6, 32, 2, 16, 64
PIECES = ["▁hello", "▁world", "▁the", "▁a", "hello", "▁", "e", "l", "o", "h", "w", "r", "d", "t", "a"]


def _vocab() -> tuple[list[str], list[float], list[int]]:
    """Gemma's special ids (pad 0, eos 1, bos 2, unk 3), byte-fallback pieces, then a few words."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + PIECES
    scores = [0.0] * 260 + [-float(i) for i in range(len(PIECES))]
    types = [3, 3, 3, 2] + [6] * 256 + [1] * len(PIECES)        # control, unknown, byte, normal
    return tokens, scores, types


def _tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """HF-convention weights ([out, in]; norms as w, not 1 + w), keyed by llama.cpp name."""
    vocab = len(_vocab()[0])

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)
    out = {"token_embd.weight": w(vocab, HIDDEN), "output_norm.weight": w(HIDDEN)}
    for i in range(LAYERS):
        b = f"blk.{i}."
        out |= {b + "attn_q.weight": w(HEADS * HEAD_DIM, HIDDEN), b + "attn_k.weight": w(HEAD_DIM, HIDDEN),
                b + "attn_v.weight": w(HEAD_DIM, HIDDEN), b + "attn_output.weight": w(HIDDEN, HEADS * HEAD_DIM),
                b + "attn_q_norm.weight": w(HEAD_DIM), b + "attn_k_norm.weight": w(HEAD_DIM),
                b + "ffn_gate.weight": w(FFN, HIDDEN), b + "ffn_up.weight": w(FFN, HIDDEN),
                b + "ffn_down.weight": w(HIDDEN, FFN)}
        out |= {b + n + ".weight": w(HIDDEN) for n in ("attn_norm", "post_attention_norm", "ffn_norm",
                                                       "post_ffw_norm")}
    return out


def write_tiny_gguf(path: Path, seed: int = 0) -> dict[str, np.ndarray]:
    """A 6-layer Gemma 3 GGUF as llama.cpp writes one (norms stored as 1 + w; attn_v in Q8_0); returns the weights
    it holds in HF convention (the Q8_0 ones as they dequantize)."""
    import gguf
    from gguf.quants import dequantize, quantize

    weights = _tensors(np.random.default_rng(seed))
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_context_length(2048)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(1)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_sliding_window(8)
    tokens, scores, types = _vocab()
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    for name, arr in weights.items():
        if name.endswith("norm.weight"):
            writer.add_tensor(name, arr + np.float32(1.0))      # llama.cpp's converter adds 1 to Gemma norms
        elif ".attn_v." in name:
            q = quantize(arr, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            weights[name] = dequantize(q, gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, arr)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from harness.integrations.gguf_gemma3 import convert
    root = tmp_path_factory.mktemp("gemma3")
    weights = write_tiny_gguf(root / "tiny.gguf")
    out = root / "hf"
    out.mkdir()
    convert(root / "tiny.gguf", out)
    return root, out, weights


def test_tensor_names_map_to_hf():
    assert hf_name("blk.3.ffn_norm.weight") == "model.layers.3.pre_feedforward_layernorm.weight"
    assert hf_name("blk.0.post_ffw_norm.weight") == "model.layers.0.post_feedforward_layernorm.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    with pytest.raises(GGUFError, match="no Gemma 3 counterpart"):
        hf_name("blk.0.ssm_conv1d.weight")


def test_conversion_writes_hf_weights_config_and_tokenizer(converted):
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    _, out, weights = converted
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == {hf_name(n) for n in weights}
    for name, arr in weights.items():           # norms back to w: the file held 1 + w
        torch.testing.assert_close(got[hf_name(name)], torch.from_numpy(arr), rtol=0, atol=1e-6)
    cfg = AutoConfig.from_pretrained(out)
    assert cfg.model_type == "gemma3_text" and cfg.architectures == ["Gemma3ForCausalLM"]
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.head_dim, cfg.num_key_value_heads) == (LAYERS, HIDDEN,
                                                                                              HEAD_DIM, 1)
    assert cfg.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert cfg.sliding_window == 8 and cfg.query_pre_attn_scalar == HEAD_DIM and cfg.tie_word_embeddings
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("hello world the").input_ids
    assert ids[0] == 2 and tok.decode(ids, skip_special_tokens=True) == "hello world the"
    odd = "héllo wörld 7!"                     # characters outside the vocabulary fall back to bytes
    assert tok.decode(tok.encode(odd, add_special_tokens=False)) == odd
    assert tok.chat_template is None                # the GGUF carries none: prompts are <bos> + raw text
    assert chat_prompt_ids(tok, "hello world") == [2, *tok.encode("hello world", add_special_tokens=False)]


def test_conversion_agrees_with_transformers_gguf_loader(converted):
    """transformers reads the same GGUF its own way (Gemma2TensorProcessor subtracts 1 from the norms): the two
    state dicts must agree. (Not the logits: its GGUF config leaves query_pre_attn_scalar and the local RoPE base at
    the class defaults, right for the real 270M but not for this tiny head_dim.)"""
    from transformers import AutoModelForCausalLM

    root, out, _ = converted
    theirs = AutoModelForCausalLM.from_pretrained(root, gguf_file="tiny.gguf", dtype=torch.float32).eval()
    ours = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ref = theirs.state_dict()
    for name, tensor in ours.state_dict().items():
        torch.testing.assert_close(tensor, ref[name], rtol=0, atol=1e-6, msg=name)


def _fake_packages(monkeypatch, tmp_path: Path, gguf_file: Path, sha256: str | None) -> assets.Embedded:
    """The tiny GGUF split into two 'installed packages' under tmp_path/pkgs, registered as the Gemma asset; the
    cache is tmp_path/cache."""
    data = gguf_file.read_bytes()
    half = len(data) // 2
    for i, part in enumerate((data[:half], data[half:])):
        (tmp_path / "pkgs" / f"pkg{i}").mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkgs" / f"pkg{i}" / "chunk").write_bytes(part)
    model = assets.Embedded(assets.GEMMA3_NAME, (("pkg0", "chunk"), ("pkg1", "chunk")), "tiny.gguf", sha256,
                            "_convert_gemma3")
    monkeypatch.setitem(assets.EMBEDDED, assets.GEMMA3_NAME, model)
    monkeypatch.setattr(assets, "_package_dir", lambda package, fix: tmp_path / "pkgs" / package)
    monkeypatch.setattr(assets, "_verify_base", lambda folder, tokenizer, model: None)   # random weights
    monkeypatch.setenv("KVHARNESS_CACHE", str(tmp_path / "cache"))
    return model


def test_embedded_gemma_is_prepared_lazily_verified_and_cached(converted, tmp_path, monkeypatch):
    root, _, _ = converted
    digest = assets._sha256(root / "tiny.gguf")
    _fake_packages(monkeypatch, tmp_path, root / "tiny.gguf", digest)
    assert assets.known_model_dir(None, assets.GEMMA3_NAME) is None          # nothing converted before first use
    folder = assets.model_dir(None, assets.GEMMA3_NAME)
    assert folder == tmp_path / "cache" / assets.GEMMA3_NAME and assets.is_verified(folder)
    assert json.loads((folder / assets.MARKER).read_text())["source"] == "tiny.gguf"
    assert not list((tmp_path / "cache").glob("*.gguf")) and not list((tmp_path / "cache").glob("*.partial*"))
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert assets.prepare(progress=False, name=assets.GEMMA3_NAME) == folder                  # cached: no rebuild
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    assert assets.known_model_dir(None, assets.GEMMA3_NAME) == folder


def test_a_damaged_chunk_is_one_line_naming_the_fix(converted, tmp_path, monkeypatch):
    root, _, _ = converted
    _fake_packages(monkeypatch, tmp_path, root / "tiny.gguf", "0" * 64)
    with pytest.raises(assets.AssetError, match="wrong sha256: reinstall with pip install") as info:
        assets.prepare(progress=False, name=assets.GEMMA3_NAME)
    assert "\n" not in str(info.value) and not (tmp_path / "cache" / assets.GEMMA3_NAME).exists()


def test_an_unknown_embedded_name_says_to_set_a_path():
    with pytest.raises(assets.AssetError, match="not an embedded model .*set model.path"):
        assets.model_dir(None, "no-such-model")

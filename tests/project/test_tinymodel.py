import json

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.tinymodel.build import build_tiny_model, bundled_corpus


def test_same_seed_gives_same_bytes(tiny_model, tmp_path):
    again = build_tiny_model(tmp_path / "again", "llama", 0)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (tiny_model / name).read_bytes(), name


def test_loads_with_auto_classes_and_is_peaked(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model, local_files_only=True)
    ids = tokenizer(bundled_corpus()[:400], return_tensors="pt").input_ids
    with torch.no_grad():
        probs = model(ids).logits.softmax(-1)
    top = probs.max(-1).values[0].numpy()
    # A random init gives top-1 probabilities near 1/512; a trained LM is confident.
    assert np.median(top) > 0.5
    assert model.config.vocab_size == len(tokenizer) == 512


def test_qwen2_has_qkv_bias_and_other_seed_differs(tmp_path, tiny_model):
    qwen = build_tiny_model(tmp_path / "qwen", "qwen2", 1)
    config = json.loads((qwen / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    model = AutoModelForCausalLM.from_pretrained(qwen, local_files_only=True)
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    assert (qwen / "model.safetensors").read_bytes() != (
        tiny_model / "model.safetensors"
    ).read_bytes()


def fake_builder(calls: list):
    """A stand-in for the 12-second training (the cache does not care what it keeps)."""

    def build(out_dir, arch="llama", seed=0):
        calls.append((arch, seed))
        out_dir.mkdir(parents=True)
        (out_dir / "model.safetensors").write_bytes(f"{arch}-{seed}".encode() * 100)
        (out_dir / "lpx-model.json").write_text("{}")
        return out_dir

    return build


def test_a_build_made_before_is_copied_and_a_damaged_one_is_built_again(tmp_path, monkeypatch):
    from pipeline.tinymodel import build as builder
    from pipeline.tinymodel.cache import build_key

    calls = []
    monkeypatch.setattr(builder, "build_tiny_model", fake_builder(calls))
    monkeypatch.setenv("LPX_MODEL_CACHE", str(tmp_path / "kept"))
    first = builder.install_tiny_model(tmp_path / "a", "qwen3", 2)
    again = builder.install_tiny_model(tmp_path / "b", "qwen3", 2)
    assert calls == [("qwen3", 2)]  # the second is a copy
    assert (again / "model.safetensors").read_bytes() == (first / "model.safetensors").read_bytes()
    assert sorted(p.name for p in again.iterdir()) == ["lpx-model.json", "model.safetensors"]
    builder.install_tiny_model(tmp_path / "c", "qwen3", 3)  # another seed: another key
    assert calls == [("qwen3", 2), ("qwen3", 3)]
    kept = tmp_path / "kept" / build_key("qwen3", 2) / "model.safetensors"
    kept.write_bytes(b"bit rot")
    damaged = builder.install_tiny_model(tmp_path / "d", "qwen3", 2)
    assert calls[-1] == ("qwen3", 2) and len(calls) == 3
    assert (damaged / "model.safetensors").read_bytes() == (
        first / "model.safetensors"
    ).read_bytes()
    assert kept.read_bytes() == (first / "model.safetensors").read_bytes()  # kept anew
    monkeypatch.setenv("LPX_MODEL_CACHE", "off")
    builder.install_tiny_model(tmp_path / "e", "qwen3", 2)
    assert len(calls) == 4


def test_the_key_follows_the_builder_and_the_libraries(monkeypatch):
    from importlib import metadata

    from pipeline.tinymodel import cache

    key = cache.build_key("llama", 0)
    assert key.startswith("llama-seed0-") and key != cache.build_key("llama", 1)
    real = metadata.version
    monkeypatch.setattr(
        cache.metadata, "version", lambda name: "9.9" if name == "torch" else real(name)
    )
    assert cache.build_key("llama", 0) != key  # another torch may train other bytes

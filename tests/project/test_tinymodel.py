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

"""Build a tiny, deterministic causal LM and tokenizer offline, for tests and the smoke."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from pipeline import devices
from pipeline.families import families

VOCAB_SIZE = 512
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
TRAIN_STEPS = 150
SEQUENCE_LENGTH = 48


def bundled_corpus() -> str:
    """The English text shipped in the package that the tokenizer and model learn from."""
    return resources.files("pipeline.tinymodel").joinpath("corpus.txt").read_text("utf-8")


def build_tiny_model(out_dir: Path, arch: str = "llama", seed: int = 0) -> Path:
    """Write safetensors weights, config and tokenizer for a tiny LM into ``out_dir``.

    The model is trained for a few hundred steps on the bundled corpus so its next-token
    distributions are peaked like a real LM's. Everything runs single-threaded with
    fixed seeds, so the same (arch, seed, torch version) always gives the same bytes.
    """
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if arch not in families():
        raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(families())}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer()
    token_ids = tokenizer.encode(bundled_corpus()).ids

    with devices.torch_threads(1):  # the same bits on every machine and in every process
        model = _train_model(arch, seed, token_ids)
    model.save_pretrained(out_dir, safe_serialization=True)
    _save_tokenizer(tokenizer, out_dir)
    (out_dir / "lpx-model.json").write_text(
        json.dumps({"built_by": "lpx make-model", "arch": arch, "seed": seed}, indent=1) + "\n"
    )
    return out_dir


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(bundled_corpus().splitlines(), trainer=trainer)
    return tokenizer


def _model_config(arch: str):
    import transformers

    family = families()[arch]
    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    config = getattr(transformers, family.config_class)(**{**common, **family.tiny})
    config.dtype = "float32"
    return config


def _train_model(arch: str, seed: int, token_ids: list[int]):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_model_config(arch))
    data = torch.tensor(token_ids, dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    with torch.enable_grad():
        for _ in range(TRAIN_STEPS):
            starts = torch.randint(0, len(data) - SEQUENCE_LENGTH - 1, (16,), generator=generator)
            batch = torch.stack([data[s : s + SEQUENCE_LENGTH] for s in starts.tolist()])
            loss = model(input_ids=batch, labels=batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    model.eval()
    return model


def _save_tokenizer(tokenizer, out_dir: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    from pipeline.trajectory.template import TINY_CHAT_TEMPLATE

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = TINY_CHAT_TEMPLATE  # Qwen3's structure, for multi-turn trajectories
    fast.save_pretrained(out_dir)


def install_tiny_model(out_dir: Path, arch: str = "llama", seed: int = 0) -> Path:
    """Build the tiny model beside ``out_dir`` and move it in whole: a crash or Ctrl-C never
    leaves half a model, and nothing lpx did not create is ever replaced. ``out_dir`` may be
    missing, empty, or a model lpx built earlier (it holds lpx-model.json). The same build
    made before is copied from lpx's cache (tinymodel/cache.py) instead of trained again."""
    import os
    import shutil

    from pipeline.errors import BadInput
    from pipeline.tinymodel import cache as kept_builds

    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise BadInput(f"{out_dir}: is a file; give a directory path for the model.")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / "lpx-model.json").is_file():
        raise BadInput(
            f"{out_dir}: exists and holds files lpx did not create (no lpx-model.json); choose a "
            "new or empty directory. lpx never deletes or overwrites what it did not create."
        )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.with_name(f".{out_dir.name}.building-{os.getpid()}")
    stale = out_dir.with_name(f".{out_dir.name}.stale-{os.getpid()}")
    try:
        with kept_builds.one_builder(arch, seed) as entry:
            if not kept_builds.copy_kept(entry, staging):
                build_tiny_model(staging, arch=arch, seed=seed)
                kept_builds.keep(staging, entry)
        if out_dir.exists():  # empty, or lpx's own earlier build: set it aside, then drop it
            out_dir.rename(stale)
        staging.rename(out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(stale, ignore_errors=True)
    return out_dir

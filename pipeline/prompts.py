"""Prompt sets: token ids from JSONL (`prompt_ids`) or text tokenized with the model's tokenizer."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from pipeline.engines.model_dir import check_model_dir
from pipeline.errors import BadInput


def smoke_prompt_texts() -> list[str]:
    text = resources.files("pipeline").joinpath("smoke_prompts.txt").read_text("utf-8")
    return [line for line in text.splitlines() if line.strip()]


def load_prompts(path: Path, model_dir: Path) -> list[list[int]]:
    """Read prompts from ``path``: JSONL lines with `prompt_ids` or `text`, or plain text lines."""
    try:
        lines = Path(path).read_text("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise BadInput(f"{path}: cannot read prompts ({error}).") from None
    prompts: list = []  # token-id lists, or text to tokenize in one go below
    vocab_size = check_model_dir(model_dir).get("vocab_size")
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if not line.lstrip().startswith("{"):
            prompts.append(line)
            continue
        try:
            record = json.loads(line)
        except ValueError as error:
            raise BadInput(f"{path} line {number}: not valid JSON ({error.msg}).") from None
        if "prompt_ids" in record:
            ids = record["prompt_ids"]
            if not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
                raise BadInput(
                    f"{path} line {number}: prompt_ids must be a non-empty list of token ids."
                )
            if vocab_size and max(ids) >= vocab_size:
                raise BadInput(
                    f"{path} line {number}: prompt token id {max(ids)} is outside the model's "
                    f"vocabulary [0, {vocab_size}) ({model_dir}); these ids were made with "
                    "another tokenizer, or give the prompts as text."
                )
            prompts.append(list(ids))
        elif "text" in record:
            prompts.append(str(record["text"]))
        else:
            raise BadInput(f"{path} line {number}: needs `prompt_ids` (token ids) or `text`.")
    if not prompts:
        raise BadInput(f"{path}: no prompts found.")
    texts = [p for p in prompts if isinstance(p, str)]
    encoded = iter(tokenize(model_dir, texts) if texts else [])
    return [next(encoded) if isinstance(p, str) else p for p in prompts]


def tokenize(model_dir: Path, texts: list[str]) -> list[list[int]]:
    """Token ids with the model's own tokenizer, BOS first when the tokenizer has one."""
    from transformers import AutoTokenizer

    check_model_dir(model_dir, need_tokenizer=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as error:  # tokenizers raises its own exception types for bad files
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        raise BadInput(
            f"{model_dir}: cannot load its tokenizer to encode text prompts ({first}); the "
            "tokenizer files are corrupt or of another model. Give prompts as token ids instead."
        ) from None
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return [bos + tokenizer(text, add_special_tokens=False).input_ids for text in texts]


def load_prompt_texts(path: Path) -> list[str]:
    """Prompts as text, for an agent loop that renders them through a chat template: plain
    text lines, or JSONL lines with `text` (token-id prompts cannot be rendered)."""
    try:
        lines = Path(path).read_text("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise BadInput(f"{path}: cannot read prompts ({error}).") from None
    texts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if not line.lstrip().startswith("{"):
            texts.append(line)
            continue
        try:
            record = json.loads(line)
        except ValueError as error:
            raise BadInput(f"{path} line {number}: not valid JSON ({error.msg}).") from None
        if not isinstance(record.get("text"), str):
            raise BadInput(
                f"{path} line {number}: an agent loop renders prompts through the chat "
                "template, so each needs `text` (token-id prompts cannot be rendered)."
            )
        texts.append(record["text"])
    if not texts:
        raise BadInput(f"{path}: no prompts.")
    return texts

"""The one place bench/ builds models, offline and deterministically: the tiny model lpx
trains (and its sibling of every family, `lpx make-model --arch`, at any seed), random llamas
at a given depth, width and init scale, random MoEs of both Qwen families (routing under
bf16), and the token-id-only llamas the serving, weights and GPU benches size by their options.

The random llamas and MoEs share the tiny model's tokenizer, so the bundled prompts tokenize
for them; the token-id-only ones have none (their benches feed token ids).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import _bootstrap  # noqa: F401

from pipeline.flows.smoke import default_model_dir, ensure_tiny_model

CACHE = Path.home() / ".cache" / "lpx" / "bench-models"


def tiny() -> Path:
    return ensure_tiny_model(default_model_dir())


def family(arch: str) -> Path:
    """The tiny model of a family (pipeline/families), as `lpx make-model --arch` builds it."""
    from pipeline.tinymodel.build import install_tiny_model

    out = CACHE / f"tiny-{arch}"
    if not (out / "config.json").is_file():
        install_tiny_model(out, arch=arch, seed=0)
    return out


def seeded_family(arch: str, seed: int, out: Path) -> Path:
    """The tiny model of a family trained from ``seed`` (`lpx make-model --arch --seed`),
    built in ``out``: the fault zoo's models, one per architecture and seed."""
    from pipeline.tinymodel.build import build_tiny_model

    return build_tiny_model(out, arch, seed)


def random_llama(layers: int, width: int, std: float = 0.02, vocab: int | None = None) -> Path:
    """A random-init llama, `layers` x `width`, weights ~ N(0, std), cached by its shape."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = CACHE / f"llama-{layers}x{width}-std{std:g}-v{vocab or 'tiny'}"
    if (out / "config.json").is_file():
        if vocab is None and not (out / "chat_template.jinja").is_file():
            _tokenizer_of_tiny(out)  # cached before the tiny model had its chat template
        return out
    config = LlamaConfig(**_dense(layers, width, std, vocab))
    return _save(LlamaForCausalLM, config, out, vocab is None)


def random_qwen3(layers: int, width: int, std: float = 0.02) -> Path:
    """A random-init Qwen3 (q/k norms; a sliding window where its config sets one),
    `layers` x `width`, weights ~ N(0, std), cached by its shape."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = CACHE / f"qwen3-{layers}x{width}-std{std:g}"
    if (out / "config.json").is_file():
        return out
    config = Qwen3Config(**_dense(layers, width, std), head_dim=64, tie_word_embeddings=False)
    return _save(Qwen3ForCausalLM, config, out, True)


def llama_without_tokenizer(out: Path, layers: int, width: int, vocab: int = 32_000) -> Path:
    """`random_llama`'s shape (std 0.02) over ``vocab`` token ids, with LlamaConfig's own
    special tokens and no tokenizer, built in ``out`` unless it is there: the GPU bench's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if (out / "config.json").is_file():
        return out
    config = LlamaConfig(**_dense(layers, width, 0.02, vocab, special_tokens=False))
    return _save(LlamaForCausalLM, config, out, False)


def multi_head_llama(
    out: Path, layers: int, width: int, vocab: int = 4096, positions: int | None = 4096
) -> Path:
    """A random-init llama with a KV head per attention head and an MLP 8/3 as wide, over
    ``vocab`` token ids (no tokenizer), built in ``out``: the serving and weights benches'
    models (throughput and bytes need no trained weights). ``positions`` None keeps
    LlamaConfig's own maximum."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = dict(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=width * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=max(1, width // 64),
        num_key_value_heads=max(1, width // 64),
    )
    if positions is not None:
        fields["max_position_embeddings"] = positions
    return _save(LlamaForCausalLM, LlamaConfig(**fields), out, False)


def _dense(
    layers: int, width: int, std: float, vocab: int | None = None, special_tokens: bool = True
) -> dict:
    """A dense decoder's shape: 64-wide heads, a KV head per 4 of them, SwiGLU at 8/3."""
    return dict(
        vocab_size=vocab or _tiny_vocab(),
        hidden_size=width,
        intermediate_size=width * 8 // 3 // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=max(1, width // 64),
        num_key_value_heads=max(1, width // 256),
        max_position_embeddings=4096,
        initializer_range=std,
        **(_special_tokens() if special_tokens else {}),
    )


def random_moe(
    layers: int = 8, width: int = 512, experts: int = 8, top_k: int = 2, std=0.02, arch="qwen2_moe"
) -> Path:
    """A random-init MoE: `experts` experts per layer, `top_k` routed per token. Qwen2-MoE
    (shared expert, top-k weights not renormalised) or Qwen3-MoE (q/k norms, renormalised)."""
    import transformers

    name = "qwen2moe" if arch == "qwen2_moe" else arch.replace("_", "")
    out = CACHE / f"{name}-{layers}x{width}-e{experts}k{top_k}-std{std:g}"
    if (out / "config.json").is_file():
        return out
    fields = dict(
        vocab_size=_tiny_vocab(),
        hidden_size=width,
        intermediate_size=width * 2,
        moe_intermediate_size=width,
        num_hidden_layers=layers,
        num_attention_heads=max(1, width // 64),
        num_key_value_heads=max(1, width // 256),
        num_experts=experts,
        num_experts_per_tok=top_k,
        max_position_embeddings=4096,
        initializer_range=std,
        **_special_tokens(),
    )
    if arch == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(**fields, shared_expert_intermediate_size=width)
        return _save(transformers.Qwen2MoeForCausalLM, config, out, True)
    config = transformers.Qwen3MoeConfig(**fields, head_dim=64, norm_topk_prob=True)
    return _save(transformers.Qwen3MoeForCausalLM, config, out, True)


def _save(cls, config, out: Path, with_tokenizer: bool) -> Path:
    import torch

    torch.manual_seed(0)
    out.mkdir(parents=True, exist_ok=True)
    cls(config).save_pretrained(out)
    if with_tokenizer:
        _tokenizer_of_tiny(out)
    return out


TOKENIZER_FILES = ("special_tokens_map.json", "chat_template.jinja")


def _tokenizer_of_tiny(out: Path) -> None:
    """The tiny model's tokenizer and chat template, copied beside a random model's weights."""
    for path in tiny().iterdir():
        if path.name.startswith("tokenizer") or path.name in TOKENIZER_FILES:
            shutil.copy(path, out / path.name)


def _tiny_vocab() -> int:
    return int(json.loads((tiny() / "config.json").read_text())["vocab_size"])


def _special_tokens() -> dict:
    config = json.loads((tiny() / "config.json").read_text())
    return {k: config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}


# The calibration benches' fixture: an HF fp32 rollout per scale (bench/calibration.py,
# bench/chi2_floor.py and bench/decode_positions.py read the same one).
FIXTURES = Path.home() / ".cache" / "lpx" / "bench-calibration"
SEQUENCES, TOKENS, PROMPT_TOKENS = 32, 128, 24


def calibration_fixture(scale: str, model_dir: Path) -> Path:
    """32 sequences x 128 tokens sampled by the HF engine in fp32 (seed 0), made once."""
    import time

    import numpy as np

    from pipeline.engines.base import SamplingParams
    from pipeline.engines.hf.rollout import HFRolloutEngine
    from pipeline.fixture.io import write_table

    path = FIXTURES / scale / "fixture-fp32.parquet"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(0)
        prompts = [list(map(int, rng.integers(3, 250, PROMPT_TOKENS))) for _ in range(SEQUENCES)]
        params = SamplingParams(max_tokens=TOKENS, samples_per_prompt=1, seed=0, ignore_eos=True)
        began = time.perf_counter()
        table = HFRolloutEngine().rollout(model_dir, prompts, params, {"device": "cpu"})
        write_table(table, path)
        print(f"  {scale}: rollout in {time.perf_counter() - began:.0f} s", flush=True)
    return path


def corpus_prompts(model_dir: Path, count: int, tokens: int) -> list[list[int]]:
    """The first ``count`` lines of the tiny model's corpus, tokenized for ``model_dir``
    and cut to ``tokens`` ids: the benches' prompts."""
    from importlib import resources

    from pipeline.prompts import tokenize

    lines = resources.files("pipeline").joinpath("tinymodel/corpus.txt").read_text()
    texts = [x for x in lines.splitlines() if x.strip()][:count]
    return [p[:tokens] for p in tokenize(model_dir, texts)]
